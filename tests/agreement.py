"""Agreeing on what a rank body saw, so that one pool runs case after case.

A case that raises ends the pool call (and the pool, NOTE [A failed call kills the pool] in
``shardsci/testing/_pool.py``), which costs a fresh pool and its imports for the next case.
Sweeps of many cases (the op database, the third-party models) instead catch what a case
raises on each rank and agree on every rank's verdict; only a case that leaves some ranks
behind still ends the call.

# NOTE [Agreeing on a case's outcome]
After each case every rank reports what it saw (a result, what it raised, a skip) in an
all-gather on a process group of its own, with a deadline. A case that raised on some ranks
only leaves the others waiting in one of the op's collectives, on the mesh's groups: they never
reach the agreement, which times out on the ranks that did, and those end the pool call naming
the case. Because the agreement never shares a group with the op's collectives, a rank stuck
there cannot be fed the agreement's messages.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

AGREEMENT_TIMEOUT_S = 30.0

_groups: dict[int, object] = {}


def agreement_group() -> Any:
    """This world's process group for agreements (created once, collectively)."""
    world = dist.get_world_size()
    if world not in _groups:
        _groups[world] = dist.new_group(
            backend="gloo", timeout=timedelta(seconds=AGREEMENT_TIMEOUT_S)
        )
    return _groups[world]


def verdict_of(fn: Callable[..., Any], *args: Any) -> tuple:
    """``("ran", fn(*args))`` or ``("raised", exception type name, message)`` on this rank."""
    try:
        return ("ran", fn(*args))
    except Exception as exc:
        message = " ".join(str(exc).split())
        return ("raised", type(exc).__name__, message[:2000])


def agree(verdict: tuple, where: str) -> list[tuple]:
    """Every rank's verdict (picklable), in rank order. One all-gather of a fingerprint when
    every rank saw the same; the verdicts themselves only when they differ.

    Raises
    ------
    RuntimeError
        When some rank did not reach the agreement within ``AGREEMENT_TIMEOUT_S`` (see the
        NOTE above): the pool call ends, naming ``where``.
    """
    group = agreement_group()
    code = zlib.crc32(repr(verdict).encode())
    world = dist.get_world_size(group)
    fingerprints = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    try:
        dist.all_gather(fingerprints, torch.tensor([code]), group=group)
        if all(f.item() == code for f in fingerprints):
            return [verdict] * world
        verdicts: list = [None] * world
        dist.all_gather_object(verdicts, verdict, group=group)
    except RuntimeError as exc:
        raise RuntimeError(
            f"{where}: not every rank reached the agreement within "
            f"{AGREEMENT_TIMEOUT_S:.0f} s; this rank saw {verdict}"
        ) from exc
    return verdicts
