"""Byte accounting for every collective shardsci issues.

# NOTE [What a byte count means]
Counts are per rank and per collective kind, in bytes of payload, and exclude data a rank
keeps for itself:
- ``all_to_all``, ``all_gather``, ``reduce_scatter``, ``p2p``: bytes this rank sends to and
  receives from other ranks (all shardsci gathers and scatters are direct exchanges).
- ``all_reduce``: the bandwidth-optimal (ring) cost, ``2 (N - 1) / N`` times the buffer, sent and
  received, which is also the lower bound for an all-reduce.
- ``broadcast``: the source sends the buffer to each other rank once; the others receive it once.
Counts do not depend on the machine, which is why tests assert them and benchmarks report them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.distributed as dist

__all__ = ["CommStats", "comm_counter", "record_comm"]


@dataclass
class CommStats:
    """Bytes moved by this rank while a :func:`comm_counter` was active.

    Attributes
    ----------
    sent, received : dict[str, int]
        Collective kind -> bytes sent to / received from other ranks.
    calls : dict[str, int]
        Collective kind -> number of collectives issued (or batches of point-to-point
        messages).
    message_batches : dict[str, int]
        Collective kind -> how many of its ``calls`` were batches of point-to-point messages
        rather than one collective (a halo exchange: NOTE [An exchange of messages as one
        all-to-all where messages are slow]).
    """

    sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    received: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    message_batches: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def collective_calls(self) -> int:
        """Collectives issued, batches of messages apart."""
        return sum(self.calls.values()) - sum(self.message_batches.values())

    @property
    def total_sent(self) -> int:
        return sum(self.sent.values())

    @property
    def total_received(self) -> int:
        return sum(self.received.values())

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {
            "sent": dict(self.sent),
            "received": dict(self.received),
            "calls": dict(self.calls),
        }

    def gather(self, group: dist.ProcessGroup | None = None) -> list[dict[str, dict[str, int]]]:
        """Every rank's counts (in group rank order); a collective over ``group``."""
        everyone: list[dict[str, dict[str, int]] | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, self.as_dict(), group=group)
        return everyone  # type: ignore[return-value]


_ACTIVE: list[CommStats] = []


@contextmanager
def comm_counter() -> Iterator[CommStats]:
    """Count the bytes this rank moves inside the ``with`` block.

    Examples
    --------
    >>> with comm_counter() as stats:  # doctest: +SKIP
    ...     y = x.redistribute(mesh, [Replicate()])
    >>> stats.received["all_gather"]  # doctest: +SKIP
    """
    stats = CommStats()
    _ACTIVE.append(stats)
    try:
        yield stats
    finally:
        _ACTIVE.remove(stats)


def record_comm(kind: str, sent: int, received: int, *, as_messages: bool = False) -> None:
    """Add one collective (``as_messages``: one batch of point-to-point messages) to every
    active counter."""
    for stats in _ACTIVE:
        stats.sent[kind] += sent
        stats.received[kind] += received
        stats.calls[kind] += 1
        stats.message_batches[kind] += as_messages
