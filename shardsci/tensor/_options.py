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
    "overlap_halos",
]

_OVERLAP = [False]


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
    convolution reads]).
    """
    previous = _OVERLAP[0]
    _OVERLAP[0] = enabled
    try:
        yield
    finally:
        _OVERLAP[0] = previous


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
    previous = _EXCHANGE[0]
    _EXCHANGE[0] = _ExchangeChoice(mode, gather_limit_bytes)
    try:
        yield
    finally:
        _EXCHANGE[0] = previous


def attention_exchange_choice() -> _ExchangeChoice:
    return _EXCHANGE[0]
