"""Run a piece of filesystem work on rank 0 and give every rank its result or its error.

A checkpoint's directory is created, committed, validated and pruned by one process. If that
process failed alone, the other ranks would wait for it in their next collective until the
process-group timeout, and then fail with a message that says nothing about the cause. So
every piece of rank-0 work is followed by one broadcast, on the saving or loading group, of
either its result or a description of its error, and the error is raised on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed import ProcessGroup

from shardsci.checkpoint._errors import CheckpointError

__all__ = ["on_coordinator"]

_T = TypeVar("_T")


def on_coordinator(fn: Callable[[], _T], group: ProcessGroup | None, what: str) -> _T:
    """Run ``fn()`` on rank 0 of ``group``; return its result on every rank.

    Without a default process group (one process, no launcher) ``fn`` simply runs here.
    The broadcast runs on ``group`` and so carries its timeout.

    Parameters
    ----------
    fn
        The work, returning a picklable result.
    group
        The process group whose rank 0 runs ``fn``; None for the default group.
    what
        What ``fn`` does, for the error message, e.g. ``"committing step 100"``.

    Raises
    ------
    CheckpointError
        On every rank of ``group`` if ``fn`` raised on rank 0; chained to the original
        exception on rank 0.
    """
    if not dist.is_initialized():
        try:
            return fn()
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(_describe(exc, what)) from exc
    outcome: list[Any] = [None]
    error: Exception | None = None
    if dist.get_rank(group) == 0:
        try:
            outcome[0] = (True, fn())
        except Exception as exc:
            error = exc
            outcome[0] = (False, _describe(exc, what))
    dist.broadcast_object_list(outcome, group_src=0, group=group)
    ok, value = outcome[0]
    if not ok:
        raise CheckpointError(value) from error
    return value


def _describe(exc: Exception, what: str) -> str:
    if isinstance(exc, CheckpointError):
        return str(exc)
    return f"{what} failed on rank 0: {type(exc).__name__}: {exc}"
