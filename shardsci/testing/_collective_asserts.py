"""Assertions for rank bodies that every rank passes or fails together.

A rank that raises alone leaves the others waiting in their next collective until the
process-group timeout. These helpers first agree, over the default process group, on whether
any rank failed, then raise the same ``AssertionError`` on every rank, naming each failing
rank and its message. Every rank must call them at the same point of the body, like any
collective.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

__all__ = ["assert_all_ranks", "assert_close_all_ranks", "assert_raises_all_ranks"]

_E = TypeVar("_E", bound=BaseException)

# What torch.testing.assert_close raises for a mismatch or for inputs it cannot compare.
_CLOSE_CHECK_ERRORS = (AssertionError, TypeError, ValueError)


def assert_all_ranks(ok: bool, message: str = "") -> None:
    """Raise the same ``AssertionError`` on every rank if ``ok`` is false on any rank.

    Costs one ``all_reduce`` of a flag when every rank passes; the messages are gathered only
    when some rank failed.

    Parameters
    ----------
    ok
        This rank's verdict.
    message
        What went wrong on this rank, reported if ``ok`` is false.

    Raises
    ------
    AssertionError
        On every rank, listing each failing rank with its message.
    """
    failures = torch.tensor([0 if ok else 1], dtype=torch.int64)
    dist.all_reduce(failures)
    if failures.item() == 0:
        return
    verdicts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, (bool(ok), message))
    failing = [(rank, text) for rank, (passed, text) in enumerate(verdicts) if not passed]
    details = "\n".join(f"  rank {rank}: {text}" for rank, text in failing)
    raise AssertionError(
        f"assertion failed on {len(failing)} of {len(verdicts)} ranks "
        f"{[rank for rank, _ in failing]}:\n{details}"
    )


def assert_close_all_ranks(
    actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float, what: str
) -> None:
    """Check ``actual`` against ``expected`` on this rank, then agree across ranks.

    The local check is ``torch.testing.assert_close``: same shape, dtype and device, and
    ``|actual - expected| <= atol + rtol * |expected|`` elementwise; its report (mismatched
    elements, greatest absolute and relative difference) becomes this rank's message.

    Parameters
    ----------
    actual, expected
        This rank's local tensors (call ``to_local()`` or ``full_tensor()`` on a DTensor).
    atol, rtol
        Absolute and relative tolerance.
    what
        Name of the compared quantity, e.g. ``"conv2d output"``, used in the message.

    Raises
    ------
    AssertionError
        On every rank if the check failed on any rank.
    """
    try:
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
    except _CLOSE_CHECK_ERRORS as exc:
        assert_all_ranks(False, f"{what}: {exc}")
    else:
        assert_all_ranks(True)


def assert_raises_all_ranks(
    exc_type: type[_E], match: str, fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> _E:
    """Check that ``fn(*args, **kwargs)`` raises ``exc_type`` matching ``match`` on every rank.

    Parameters
    ----------
    exc_type
        The expected exception class (subclasses count).
    match
        Regular expression searched for in ``str(exception)``.
    fn, *args, **kwargs
        The call expected to raise. If it runs collectives, every rank must stop at the same
        one, or the ranks that get further wait for the others.

    Returns
    -------
    BaseException
        The exception raised on this rank, for further checks.

    Raises
    ------
    AssertionError
        On every rank if any rank did not raise a matching exception.
    """
    caught, problem = _call_expecting(exc_type, match, fn, *args, **kwargs)
    assert_all_ranks(problem is None, problem or "")
    # Past the agreement, this rank raised a matching exception.
    return cast(_E, caught)


def _call_expecting(
    exc_type: type[_E], match: str, fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> tuple[_E | None, str | None]:
    """Run ``fn``; return what it raised and a description of the mismatch, or None."""
    expected = f"{exc_type.__name__} matching {match!r}"
    try:
        fn(*args, **kwargs)
    except exc_type as exc:
        if re.search(match, str(exc)):
            return exc, None
        return exc, f"expected {expected}, got {type(exc).__name__}: {exc}"
    except Exception as exc:
        return None, f"expected {expected}, got {type(exc).__name__}: {exc}"
    return None, f"expected {expected}, but {getattr(fn, '__qualname__', fn)!r} returned"
