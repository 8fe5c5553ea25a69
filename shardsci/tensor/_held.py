"""Dims one rank holds whole along some mesh axes (NOTE [A dim one rank holds is whole on that
rank]): finding those axes, taking them off a layout and putting them back. Rules at every level
use them: views, products and reductions in ``_ops``, the pointwise rule in ``_propagation``."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Replicate, Shard

from shardsci.tensor._caches import cached
from shardsci.tensor._spec import DimSharding, ShardTensorSpec

__all__ = ["Held", "held_axes", "held_on", "without_held"]


# NOTE [A dim one rank holds is whole on that rank]
# A dim sharded over mesh axes along which one rank holds all of it, the others nothing (a
# contraction's output kept by its holder, NOTE above; a slice of one rank's part; a dim of
# extent 1), is, for the ranks that hold anything, a whole dim: along those axes there is one
# piece, on the holder. A rule that reads such axes as splitting the dim (every rank holds
# part, so the dim must be gathered before the op works across it) would broadcast the
# holder's part to every rank. So a rule takes the held axes off first (``without_held``: the
# dim whole, as the holder sees it), decides on what is left, and nests them back, outermost,
# on the output dim the held dim becomes (``held_on``): the holder's row of ranks does the
# op, the others hold empty shards and do it on nothing. No byte moves along held axes.
# Where: ``_view_ops._view_plan`` (view, reshape, flatten, unflatten; ``expand`` and
# ``squeeze`` of a held dim of extent 1), ``_matmul_ops._product_layout`` (NOTE [A product of
# held operands runs on their holder]) and the pointwise rule in ``_propagation`` (NOTE [A
# pointwise op on held operands runs on their holder]).
@dataclass(frozen=True)
class Held:
    """Mesh ``axes`` along which the rank at index ``holder`` over them holds all of ``dim``
    (NOTE [A dim one rank holds is whole on that rank])."""

    dim: int
    axes: tuple[int, ...]
    holder: int


def held_axes(
    sharding: DimSharding, mesh_shape: Sequence[int]
) -> tuple[Held | None, tuple[int, ...]]:
    """The outermost axes of ``sharding`` along which one rank holds its whole dim (None if
    the first already splits it, none holds any, or they are axes of one rank: a one-rank
    mesh splits nothing), and the sizes within the holder's block over the remaining axes."""
    found, inner_sizes = None, sharding.sizes
    blocks = 1
    for j, axis in enumerate(sharding.axes, 1):
        blocks *= mesh_shape[axis]
        inner = len(sharding.sizes) // blocks
        full = [k for k in range(blocks) if any(sharding.sizes[k * inner : (k + 1) * inner])]
        if len(full) != 1:
            break
        if blocks > 1:
            found = Held(sharding.dim, sharding.axes[:j], full[0])
            inner_sizes = sharding.sizes[full[0] * inner : (full[0] + 1) * inner]
    return found, inner_sizes


@cached("layouts without held axes", 1024)
def without_held(spec: ShardTensorSpec) -> tuple[ShardTensorSpec, tuple[Held, ...]]:
    """``spec`` with every held axis (``held_axes``) replicated, its dim whole there and split
    over the rest of its axes as within the holder's block; and the held axes taken off."""
    placements = list(spec.placements)
    sizes, order, held = {}, {}, []
    for s in spec.shardings:
        found, inner = held_axes(s, spec.mesh_shape)
        count = 0 if found is None else len(found.axes)
        if found is not None:
            held.append(found)
            for axis in found.axes:
                placements[axis] = Replicate()
        if count < len(s.axes):
            sizes[s.dim], order[s.dim] = inner, s.axes[count:]
    if not held:
        return spec, ()
    return spec.relaid(placements, sizes, order=order), tuple(held)


def held_on(spec: ShardTensorSpec, held: Iterable[Held]) -> ShardTensorSpec:
    """``spec`` with each of ``held``'s axes sharding its dim, nested outermost: the holder
    holds what ``spec`` lays out along the dim, the other ranks along those axes nothing."""
    placements = list(spec.placements)
    sizes = {s.dim: s.sizes for s in spec.shardings}
    order = {s.dim: s.axes for s in spec.shardings}
    for h in held:
        count = math.prod(spec.mesh_shape[a] for a in h.axes)
        inner = sizes.get(h.dim, (spec.shape[h.dim],))
        sizes[h.dim] = tuple(n if k == h.holder else 0 for k in range(count) for n in inner)
        order[h.dim] = (*h.axes, *order.get(h.dim, ()))
        for axis in h.axes:
            placements[axis] = Shard(h.dim)
    return spec.relaid(placements, sizes, order=order)
