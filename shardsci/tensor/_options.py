"""User-facing switches."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "attention_exchange",
    "attention_exchange_choice",
    "halo_overlap_enabled",
    "normalization_statistics",
    "normalization_statistics_choice",
    "overlap_halos",
    "statistics_all_reduced",
]

_OVERLAP = [False]


@contextmanager
def _within(slot: list, value: object) -> Iterator[None]:
    """``slot[0]`` is ``value`` inside the block, and what it was after."""
    previous = slot[0]
    slot[0] = value
    try:
        yield
    finally:
        slot[0] = previous


@contextmanager
def overlap_halos(enabled: bool = True) -> Iterator[None]:
    """Overlap halo exchanges with the interior computation of windowed ops.

    Inside the block, a convolution over a slab decomposition posts its halo messages, computes
    the outputs that need only the rank's own cells while they are in flight, then the edge
    outputs; its backward likewise sends halo gradients while the interior's backward runs.
    Outputs are identical to the synchronous path; gradients agree to rounding (interior and
    edge contributions are summed in another order). Block decompositions (several sharded
    windowed dims) run synchronously. A circular, reflect or replicate padding (``F.pad``,
    as ``nn.ConvNd(padding_mode=...)`` pads) then exchanges only the boundary cells, and the
    convolution overlaps the exchange of the faces: two exchanges per layer, one hidden,
    instead of the single synchronous one (NOTE [A padded tensor carries the halo its
    convolution reads]). On a GPU the messages are packed and posted on a side stream of the
    device, ordered by events, so that the interior's kernels overlap them (NOTE [Halo overlap
    on streams]: checked on the CPU against a stand-in for the streams, and on an H200 on two
    ranks sharing it over gloo, ``scripts/gpu_two_ranks.py``); on the CPU no stream is created.
    """
    with _within(_OVERLAP, enabled):
        yield


def halo_overlap_enabled() -> bool:
    return _OVERLAP[0]


Exchange = Literal["auto", "ring", "all_gather"]


@dataclass(frozen=True)
class _ExchangeChoice:
    mode: Exchange = "auto"
    gather_limit_bytes: int = 16 * 2**20


_EXCHANGE = [_ExchangeChoice()]


@contextmanager
def attention_exchange(
    mode: Exchange = "auto", gather_limit_bytes: int = 16 * 2**20
) -> Iterator[None]:
    """How attention over a sharded sequence meets the key/value blocks of other ranks, and
    a product of two operands sharded on different dims over the same mesh axes (``q @ k^T``
    with tokens sharded in both) meets the other operand's blocks.

    Parameters
    ----------
    mode : {"auto", "ring", "all_gather"}
        ``"auto"`` follows NOTE [Ring or all-gather] (``tensor/_ops/_ring.py``); the
        others force one exchange.
    gather_limit_bytes : int
        ``"auto"`` gathers the keys and values (the other operand) of a call up to this size
        per rank.
    """
    if mode not in ("auto", "ring", "all_gather"):
        raise ValueError(f"mode must be 'auto', 'ring' or 'all_gather', got {mode!r}")
    if gather_limit_bytes < 0:
        raise ValueError(f"gather_limit_bytes must be >= 0, got {gather_limit_bytes!r}")
    with _within(_EXCHANGE, _ExchangeChoice(mode, gather_limit_bytes)):
        yield


def attention_exchange_choice() -> _ExchangeChoice:
    return _EXCHANGE[0]


Combination = Literal["auto", "all_gather", "all_reduce"]

ALL_REDUCE_FROM_RANKS = 104
"""The smallest group on which two all-reduces cost less than one all-gather of a
normalisation's statistics on an H100 cluster (``planning._machine.Machine()``, 8 rows of
float32 statistics; ``benchmarks.cost_model.statistics_crossover`` computes it, and a test
holds this number to it)."""


@dataclass(frozen=True)
class _StatisticsChoice:
    mode: Combination = "auto"
    all_reduce_from_ranks: int = ALL_REDUCE_FROM_RANKS


_STATISTICS = [_StatisticsChoice()]


@contextmanager
def normalization_statistics(
    mode: Combination = "auto", all_reduce_from_ranks: int = ALL_REDUCE_FROM_RANKS
) -> Iterator[None]:
    """How group, batch, instance, layer and RMS normalisation combine the statistics of a
    row split over several ranks: one all-gather of every rank's partial statistics, or two
    all-reduces (NOTE [Normalisation statistics across shards], ``tensor/_ops/_norm_ops.py``).
    Both give the single-device statistics, bitwise identical on every rank.

    Parameters
    ----------
    mode : {"auto", "all_gather", "all_reduce"}
        ``"auto"`` gathers over groups of fewer than ``all_reduce_from_ranks`` ranks and
        all-reduces over larger ones; the others force one combination.
    all_reduce_from_ranks : int
        The crossover of the latency model: 104 for an H100 cluster (the default); for
        another cluster, ``benchmarks.cost_model.statistics_crossover(machine)``.
    """
    if mode not in ("auto", "all_gather", "all_reduce"):
        raise ValueError(f"mode must be 'auto', 'all_gather' or 'all_reduce', got {mode!r}")
    if isinstance(all_reduce_from_ranks, bool) or not isinstance(all_reduce_from_ranks, int):
        raise ValueError(f"all_reduce_from_ranks must be an int, got {all_reduce_from_ranks!r}")
    if all_reduce_from_ranks < 2:
        raise ValueError(f"all_reduce_from_ranks must be >= 2, got {all_reduce_from_ranks}")
    with _within(_STATISTICS, _StatisticsChoice(mode, all_reduce_from_ranks)):
        yield


def normalization_statistics_choice() -> _StatisticsChoice:
    return _STATISTICS[0]


def statistics_all_reduced(ranks: int) -> bool:
    """Whether the statistics of a row split over a group of ``ranks`` ranks are combined by
    all-reduces (NOTE [Normalisation statistics across shards])."""
    choice = _STATISTICS[0]
    if choice.mode != "auto":
        return choice.mode == "all_reduce"
    return ranks >= choice.all_reduce_from_ranks
