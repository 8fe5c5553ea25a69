"""Gathering global index intervals along one sharded dim.

roll, flip and cat along a sharded dim keep every element's data but move it to another
index; each rank then needs a few intervals of the input that other ranks hold. Every rank
can compute from the layout who holds what and who wants what, so one exchange moves exactly
the overlapping parts: each rank receives only the elements it lacks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from shardsci.tensor._collectives import AxisGroup, exchange

__all__ = ["Interval", "gather_intervals"]

Interval = tuple[int, int]  # [start, stop) in global indices along the dim
Segment = tuple[int, int, int, int]  # (wanted index, start, stop, held index)


def gather_intervals(
    pieces: Sequence[torch.Tensor],
    held: Callable[[int], Sequence[Interval]],
    wanted: Callable[[int], Sequence[Interval]],
    dim: int,
    group: AxisGroup,
) -> torch.Tensor:
    """Concatenate, along ``dim``, the intervals this rank wants, from whoever holds them.

    Parameters
    ----------
    pieces : sequence of Tensor
        This rank's local tensors, one per interval in ``held(group.index)``, same shape
        except along ``dim``.
    held : callable
        Flat group index -> the intervals that member holds, in the order of its pieces.
        Intervals held by different members must not overlap.
    wanted : callable
        Flat group index -> the intervals that member wants, in output order.
    dim : int
        The tensor dim the intervals run along.
    group : AxisGroup
        The ranks along the mesh axes sharding ``dim``.

    Returns
    -------
    Tensor
        The wanted intervals of this rank, concatenated along ``dim``.
    """
    me = group.index
    segments = {
        (src, dst): _segments(held(src), wanted(dst))
        for src in range(group.size)
        for dst in range(group.size)
    }
    template = pieces[0] if pieces else None
    rest = list(template.shape) if template is not None else []

    def shape_of(src: int, dst: int) -> list[int]:
        length = sum(stop - start for _, start, stop, _ in segments[(src, dst)])
        return [*rest[:dim], length, *rest[dim + 1 :]]

    my_held = held(me)
    outgoing = [
        _cut(pieces, my_held, segments[(me, dst)], dim) if segments[(me, dst)] else None
        for dst in range(group.size)
    ]
    received = exchange(
        group, outgoing, shape_of, dtype=template.dtype, device=template.device, kind="all_to_all"
    )
    return _assemble(received, segments, wanted(me), me, group.size, dim, rest, template)


def _segments(held: Sequence[Interval], wanted: Sequence[Interval]) -> list[Segment]:
    """Overlaps of held and wanted intervals, in output order."""
    found = []
    for w, (w0, w1) in enumerate(wanted):
        for h, (h0, h1) in enumerate(held):
            start, stop = max(w0, h0), min(w1, h1)
            if start < stop:
                found.append((w, start, stop, h))
    return sorted(found)


def _cut(
    pieces: Sequence[torch.Tensor], held: Sequence[Interval], segments: list[Segment], dim: int
) -> torch.Tensor:
    parts = [
        pieces[h].narrow(dim, start - held[h][0], stop - start) for _, start, stop, h in segments
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _assemble(
    received: list[torch.Tensor],
    segments: dict[tuple[int, int], list[Segment]],
    wanted: Sequence[Interval],
    me: int,
    size: int,
    dim: int,
    rest: list[int],
    template: torch.Tensor,
) -> torch.Tensor:
    output_offsets = []
    running = 0
    for start, stop in wanted:
        output_offsets.append(running)
        running += stop - start
    out = template.new_empty([*rest[:dim], running, *rest[dim + 1 :]])
    for src in range(size):
        position = 0
        for w, start, stop, _ in segments[(src, me)]:
            length = stop - start
            target = out.narrow(dim, output_offsets[w] + start - wanted[w][0], length)
            target.copy_(received[src].narrow(dim, position, length))
            position += length
    return out
