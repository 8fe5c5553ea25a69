"""Packing a box exchange's pieces into one buffer, and unpacking them, in O(1) aten ops.

# NOTE [One pack and one unpack per collective]
A box exchange (NOTE [Redistribution is one box exchange plus reductions]) sends each peer a
box of the local shard and fills boxes of the output with what each peer sends. Narrowing,
flattening and copying each piece apart costs the host a handful of aten ops per peer (about
250 per added peer in a 2-D FNO step: NOTE [Ops per peer] in ``benchmarks/cost_model.py``).
Instead every piece travels laid out in one dim order, the *wire order*, chosen from the
group's boxes alone (so sender and receiver agree): the dim along which the pieces a rank
sends differ first, the dim along which the pieces it receives differ second, the others in
their order. Then, on each side:

- ``copies``: one box to every peer (the sender of an uneven gather): the permuted box
  expanded over the peers and copied once;
- ``rows``: the pieces differ along the wire order's first dim only (any extents, uneven and
  empty included, in any order): one ``index_select`` of the permuted shard packs them (a
  ``narrow`` and at most one copy when they are one run in order), one ``index_copy_`` into
  the permuted output unpacks them;
- ``blocks``: they differ along one other dim only, in blocks of one extent on a grid (the
  receiving side of an all-to-all ``Shard(a) -> Shard(b)`` whose sources are even, the
  sending side when its targets are, a native all-gather's stacked shards): that dim is
  unflattened into (block, extent) and one ``index_select`` or ``index_copy_`` over the block
  dim does it;
- ``pieces``: anything else: one narrow, permute and copy per piece, as before. These
  layouts keep a per-peer cost: pieces that differ along two dims (a swap of two dims sharded
  over a 2x2 group, a 2x2 block decomposition gathered to Replicate) and an
  all-to-all ``Shard(a) -> Shard(b)`` uneven on both sides (its receiving side only). In a
  traced graph (torch.compile) ``blocks`` unpack piece by piece too: functionalization cannot
  invert the blocks' view chain, and a compiled graph pays no host cost per op.

Only redistributions pack this way. The other callers of ``exchange`` (graph gathers and
scatters, scans, ring attention, statistics of uneven shards) still pack and unpack a piece
per peer that sends or receives something (a graph's neighbours); the peers that send
nothing cost no aten op (``tests/test_redistribute_ops.py``).

The indices hold one entry per row or block of a shard (never more than its elements), and no
buffer is larger than the per-peer path's: the packed buffer is the concatenated pieces (the
shard itself when it is already one run in order), the output is filled in place.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from shardsci.tensor._caches import cached
from shardsci.tensor._torch_compat import is_fake
from shardsci.tensor._torch_compile import in_graph

__all__ = [
    "NO_PIECES",
    "Box",
    "Narrowing",
    "Side",
    "narrow_box",
    "narrowed",
    "pack",
    "side_of",
    "unpack",
    "wire_order",
    "with_range",
]

Box = tuple[tuple[int, int], ...]
# (dim, start, length): a narrowing of one dim.
Narrowing = tuple[int, int, int]


def narrowed(t: torch.Tensor, narrowings: Iterable[Narrowing]) -> torch.Tensor:
    """``t`` narrowed along each ``(dim, start, length)`` (a view; ``t`` itself where every
    narrowing spans its dim: a third of a UNet step's halo narrowings do, each an aten op)."""
    for dim, start, length in narrowings:
        if start != 0 or length != t.shape[dim]:
            t = t.narrow(dim, start, length)
    return t


def narrow_box(tensor: torch.Tensor, box: Box) -> torch.Tensor:
    """The region ``box`` (one ``(start, stop)`` per dim) of ``tensor``, a view."""
    return narrowed(tensor, ((dim, start, stop - start) for dim, (start, stop) in enumerate(box)))


def wire_order(source_boxes: Sequence[Box], target_boxes: Sequence[Box]) -> tuple[int, ...]:
    """The dim order every piece travels in, from the group's source and target boxes (the
    same on every member): the dim the target boxes differ along (what a sender's pieces
    differ by), then the one the source boxes differ along; identity when either differs
    along several dims. Of an all-to-all ``Shard(a) -> Shard(b)``, the uneven side goes
    first: the even side unpacks (or packs) as blocks."""
    ndim = len(source_boxes[0])
    differ_src = _differing_dims(source_boxes)
    differ_dst = _differing_dims(target_boxes)
    if len(differ_src) > 1 or len(differ_dst) > 1:
        return tuple(range(ndim))
    lead = [*differ_dst, *(d for d in differ_src if d not in differ_dst)]
    if len(lead) == 2 and _one_extent(target_boxes, lead[0]):
        lead.reverse()
    return (*lead, *(d for d in range(ndim) if d not in lead))


def _differing_dims(boxes: Sequence[Box]) -> list[int]:
    return [d for d in range(len(boxes[0])) if len({box[d] for box in boxes}) > 1]


def _one_extent(boxes: Sequence[Box], dim: int) -> bool:
    return len({stop - start for start, stop in (box[dim] for box in boxes)}) == 1


@dataclass(frozen=True)
class Side:
    """How one rank packs the pieces it sends, or unpacks those it receives.

    Attributes
    ----------
    how : str
        ``copies``, ``rows``, ``blocks``, ``pieces`` (NOTE [One pack and one unpack per
        collective]) or
        ``none`` (no piece).
    region : Box
        Where the pieces lie in the tensor (``copies``, ``rows``, ``blocks``; natural dim
        order).
    index : tuple of int or None
        ``rows``: each piece's rows along the wire order's first dim, relative to the region,
        in wire order (None: the region's rows, in order); ``blocks``: each piece's block.
    extent : int
        ``blocks``: the pieces' extent along the dim they differ by.
    position : int
        ``blocks``: that dim's position in the wire order.
    boxes : tuple of Box
        Each piece's box, in wire order.
    """

    how: str
    region: Box = ()
    index: tuple[int, ...] | None = None
    extent: int = 0
    position: int = 0
    boxes: tuple[Box, ...] = ()


NO_PIECES = Side("none")


def side_of(boxes: Sequence[Box], order: tuple[int, ...]) -> Side:
    """How to pack (or unpack) the pieces ``boxes`` (relative to the tensor, in the order
    they travel, none empty) laid out in ``order``."""
    if not boxes:
        return NO_PIECES
    if len(boxes) > 1 and all(box == boxes[0] for box in boxes):
        return Side("copies", boxes[0], boxes=tuple(boxes))
    if all(box[d] == boxes[0][d] for box in boxes for d in order[1:]):
        return _rows(boxes, order[0])
    differing = _differing_dims(boxes)
    if len(differing) == 1:
        blocks = _blocks(boxes, differing[0], order.index(differing[0]))
        if blocks is not None:
            return blocks
    return Side("pieces", boxes=tuple(boxes))


def _rows(boxes: Sequence[Box], dim: int) -> Side:
    start = min(box[dim][0] for box in boxes)
    stop = max(box[dim][1] for box in boxes)
    region = with_range(boxes[0], dim, (start, stop))
    rows = [row - start for box in boxes for row in range(*box[dim])]
    index = None if rows == list(range(stop - start)) else tuple(rows)
    return Side("rows", region, index, boxes=tuple(boxes))


def _blocks(boxes: Sequence[Box], dim: int, position: int) -> Side | None:
    extents = {box[dim][1] - box[dim][0] for box in boxes}
    start = min(box[dim][0] for box in boxes)
    extent = extents.pop()
    if extents or any((box[dim][0] - start) % extent for box in boxes):
        return None
    index = tuple((box[dim][0] - start) // extent for box in boxes)
    stop = start + (max(index) + 1) * extent
    region = with_range(boxes[0], dim, (start, stop))
    return Side("blocks", region, index, extent, position, tuple(boxes))


def with_range(box: Box, dim: int, interval: tuple[int, int]) -> Box:
    """``box`` with ``interval`` along ``dim``."""
    return (*box[:dim], interval, *box[dim + 1 :])


# NOTE [An exchange's index is built once]
# ``rows`` and ``blocks`` pack and unpack with a small int64 index (one entry per row or
# block). Built per call, it would be a host-to-device copy per exchange on a GPU; so each
# index is kept per value and device (NOTE [Caches are keyed by value]) and a repeated
# exchange reuses it (``tests/test_redistribute_ops.py`` counts the indices built). Nothing
# writes an index. Under tracing or fake tensors it is a constant of the trace, built anew.
def _index(values: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """``values`` as an int64 index on ``like``'s device."""
    if in_graph() or is_fake(like):
        return torch.tensor(values, dtype=torch.int64, device=like.device)
    return _kept_index(values, like.device)


@cached("exchange indices", 1024)
def _kept_index(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):  # an index made in inference mode is used outside it
        return torch.tensor(values, dtype=torch.int64, device=device)


def pack(tensor: torch.Tensor, side: Side, order: tuple[int, ...]) -> torch.Tensor:
    """The pieces of ``tensor`` that ``side`` sends, each laid out in ``order``, one after
    the other: a contiguous tensor (the send buffer)."""
    if side.how == "none":
        return tensor.new_empty(0)
    if side.how == "pieces":
        return torch.cat([narrow_box(tensor, box).permute(order).reshape(-1) for box in side.boxes])
    region = narrow_box(tensor, side.region).permute(order)
    if side.how == "copies":
        return region.expand(len(side.boxes), *region.shape).contiguous()
    if side.how == "blocks":
        blocks = _as_blocks(region, side).movedim(side.position, 0)
        return blocks.index_select(0, _index(side.index, tensor))
    if side.index is None:
        return region.contiguous()
    return region.index_select(0, _index(side.index, tensor))


def _as_blocks(region: torch.Tensor, side: Side) -> torch.Tensor:
    """``region`` (in the wire order) with the dim the pieces differ by split into (block,
    extent), the block dim where that dim was."""
    return region.unflatten(side.position, (-1, side.extent))


def unpack(out: torch.Tensor, received: torch.Tensor, side: Side, order: tuple[int, ...]) -> None:
    """Write the pieces in ``received`` (flat, each laid out in ``order``, one after the
    other) into their places in ``out``."""
    if side.how == "none":
        return
    # A traced graph cannot write through the blocks' view chain (functionalization replays
    # its inverse, a view of a permuted tensor); a compiled graph pays no host per op anyway.
    if side.how in ("pieces", "copies") or (side.how == "blocks" and in_graph()):
        start = 0
        for box in side.boxes:
            region = narrow_box(out, box).permute(order)
            region.copy_(received[start : start + region.numel()].view(region.shape))
            start += region.numel()
        return
    region = narrow_box(out, side.region).permute(order)
    if side.how == "blocks":
        blocks = _as_blocks(region, side).movedim(side.position, 0)
        pieces = received.view(len(side.index), *blocks.shape[1:])
        blocks.index_copy_(0, _index(side.index, out), pieces)
    elif side.index is None:
        region.copy_(received.view(region.shape))
    else:
        pieces = received.view(len(side.index), *region.shape[1:])
        region.index_copy_(0, _index(side.index, out), pieces)
