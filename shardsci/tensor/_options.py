"""User-facing switches."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["halo_overlap_enabled", "overlap_halos"]

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
