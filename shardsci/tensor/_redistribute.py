"""Redistribution of local shards between any two layouts, uneven sizes included.

# NOTE [Redistribution is one box exchange plus reductions]
Outside Partial axes, every rank's shard is a box of the global index space (an interval per
dim). Any change of Shard / Replicate placements or shard sizes, on any number of mesh axes,
is planned as ONE exchange: each rank needs its target box, already holds part of it, and
receives the rest from the unique rank in its replica group (same coordinates on the axes
where the source is replicated) that holds it. The exchange runs as a single all-to-all over
the axes whose sharding changes, so Shard(i) -> Shard(j) is one all-to-all, Shard -> Replicate
an all-gather, Replicate -> Shard a local slice, and every rank receives exactly the bytes it
lacks: the lower bound.
Partial axes reduce around that exchange: to Shard(d) by a reduce-scatter along d when the
axis is innermost for d in the target order; the others by one all-reduce over all of them
together (one ring over N ranks moves 2 (N - 1) / N of the buffer, less than a ring per axis),
done where the fewest elements are held: before the exchange, after it, or, when those axes
shard nothing in the target, after the reduce-scatters. ``tests/test_redistribute.py`` checks
every transition against the cheapest of these ways, computed from boxes alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from shardsci.tensor._caches import BoundedCache
from shardsci.tensor._collectives import AxisGroup, all_gather, all_reduce, axis_group, exchange
from shardsci.tensor._comm_stats import record_comm
from shardsci.tensor._gather_guard import check_redistribution
from shardsci.tensor._spec import (
    DimSharding,
    ShardTensorSpec,
    coordinate_over_axes,
    mesh_coordinate,
)

__all__ = ["redistribute_local", "target_spec"]

Box = tuple[tuple[int, int], ...]


# ----------------------------------------------------------------------------- target specs
def target_spec(
    src: ShardTensorSpec,
    placements: Sequence[Placement],
    sizes: dict[int, Sequence[int]] | None = None,
) -> ShardTensorSpec:
    """The spec ``src`` becomes when redistributed to ``placements``.

    Shard sizes come from ``sizes`` (tensor dim -> flat extents) when given, else stay as in
    ``src`` for a dim sharded over the same axes, else come from the hints (the sizes the dim
    had when it was last sharded over those axes, in that order: NOTE [Shard-size hints]),
    else follow ``torch.chunk`` over the axes in increasing order.
    """
    placements = tuple(placements)
    frozen = None if sizes is None else tuple((d, tuple(s)) for d, s in sizes.items())
    key = (src.key, placements, frozen)
    spec = _TARGETS.get(key)
    if spec is None:
        spec = _TARGETS.put(key, _target_spec(src, placements, sizes))
    return spec


_TARGETS: BoundedCache[tuple, ShardTensorSpec] = BoundedCache("redistribution targets", 4096)


def _target_spec(
    src: ShardTensorSpec,
    placements: tuple[Placement, ...],
    sizes: dict[int, Sequence[int]] | None,
) -> ShardTensorSpec:
    ndim = src.ndim
    axes_by_dim: dict[int, list[int]] = {}
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            axes_by_dim.setdefault(p.dim % ndim if ndim else p.dim, []).append(axis)
    order: dict[int, tuple[int, ...]] = {}
    chosen: dict[int, Sequence[int]] = dict(sizes or {})
    # The current sharding of a dim wins over its hint for the same axes.
    remembered = {_hint_key(h): h for h in (*src.hints, *src.shardings)}
    for dim, axes in axes_by_dim.items():
        order[dim] = tuple(axes)
        hint = remembered.get((dim, frozenset(axes)))
        if hint is not None and sum(hint.sizes) == src.shape[dim]:
            order[dim] = hint.axes
            chosen.setdefault(dim, hint.sizes)
    return src.relaid(placements, chosen, order=order, hints=_updated_hints(src))


def _updated_hints(src: ShardTensorSpec) -> tuple[DimSharding, ...]:
    """The source's hints plus its current shardings: the newest per dim and set of axes."""
    kept = {_hint_key(h): h for h in src.hints}
    kept.update({_hint_key(s): s for s in src.shardings})
    return tuple(kept.values())


def _hint_key(sharding: DimSharding) -> tuple[int, frozenset[int]]:
    return sharding.dim, frozenset(sharding.axes)


# ----------------------------------------------------------------------------- execution
def redistribute_local(
    local: torch.Tensor, src: ShardTensorSpec, dst: ShardTensorSpec
) -> torch.Tensor:
    """Move this rank's shard of ``src`` to its shard of ``dst`` (same mesh and shape).

    Collective over the mesh: every rank must call it with the same ``src`` and ``dst``. A
    gather an op makes is put to the gather policy first, before any data moves (NOTE
    [Gathers an op was not asked to make] in ``_gather_guard``).
    """
    if src.same_layout(dst) or math.prod(src.mesh_shape) == 1:
        return local
    if src.mesh != dst.mesh or src.shape != dst.shape:
        raise ValueError(f"cannot redistribute {src} to {dst}: mesh or global shape differ")
    check_redistribution(src, dst)
    steps = _plan(src, dst)
    for step in steps:
        local = step.run(local)
    return local


@dataclass(frozen=True)
class _AllReduce:
    """One all-reduce over the group of ``axes``: every axis Partial with the same reduce op
    (sum and avg combine: a sum divided by the ranks along the avg axes), or a single axis."""

    axes: tuple[int, ...]
    spec: ShardTensorSpec  # the layout before, with the axes still Partial

    def run(self, local: torch.Tensor) -> torch.Tensor:
        group = axis_group(self.spec.mesh, self.axes)
        placements = [self.spec.placements[a] for a in self.axes]
        if len(self.axes) == 1 and not _plain_partial(placements[0]):
            return _reduce_with_placement(local, self.axes[0], self.spec, group)
        ops = {p.reduce_op for p in placements}
        if ops <= {"sum", "avg"} and len(ops) > 1:
            averaged = math.prod(
                self.spec.mesh_shape[a]
                for a, p in zip(self.axes, placements)
                if p.reduce_op == "avg"
            )
            return all_reduce(local, group, "sum") / averaged
        return all_reduce(local, group, ops.pop())


def _plain_partial(placement: Placement) -> bool:
    return type(placement) is Partial and placement.reduce_op in ("sum", "avg", "max", "min")


def _all_reduces(axes: list[int], spec: ShardTensorSpec) -> list[_AllReduce]:
    """All-reduces over ``axes``: one over all of them when their reductions combine (one ring
    over N ranks moves ``2 (N - 1) / N`` of the buffer, less than one ring per axis), else one
    per axis."""
    placements = [spec.placements[a] for a in axes]
    ops = {p.reduce_op for p in placements}
    combined = ops <= {"sum", "avg"} or len(ops) == 1
    if len(axes) > 1 and all(map(_plain_partial, placements)) and combined:
        return [_AllReduce(tuple(axes), spec)]
    steps = []
    for axis in axes:
        steps.append(_AllReduce((axis,), spec))
        spec = _with_placement(spec, axis, Replicate())
    return steps


@dataclass(frozen=True)
class _ReduceScatter:
    axis: int
    dim: int
    before: ShardTensorSpec
    after: ShardTensorSpec

    def run(self, local: torch.Tensor) -> torch.Tensor:
        group = axis_group(self.before.mesh, (self.axis,))
        reduce_op = self.before.placements[self.axis].reduce_op
        coordinate = list(mesh_coordinate(self.before.mesh))
        extents = []
        for c in range(group.size):
            coordinate[self.axis] = c
            extents.append(self.after.local_shape(coordinate)[self.dim])
        pieces = list(torch.split(local, extents, dim=self.dim))
        shape = list(local.shape)

        def shape_of(src: int, dst: int) -> list[int]:
            return [*shape[: self.dim], extents[dst], *shape[self.dim + 1 :]]

        received = exchange(
            group, pieces, shape_of, dtype=local.dtype, device=local.device, kind="reduce_scatter"
        )
        return _combine(received, reduce_op, group.size)


@dataclass(frozen=True)
class _Exchange:
    """The box exchange of NOTE [Redistribution is one box exchange plus reductions]."""

    src: ShardTensorSpec
    dst: ShardTensorSpec

    def run(self, local: torch.Tensor) -> torch.Tensor:
        plan = _exchange_plan(self.src, self.dst)
        if plan.group is None:
            if plan.own_source_box is None:
                return local.new_empty(plan.out_shape)
            return _narrow_box(local, plan.own_source_box)
        if plan.gathers_equal_shards:
            return _assemble(list(all_gather(local, plan.group).unbind(0)), plan, local)
        pieces = [None if box is None else _narrow_box(local, box) for box in plan.send_boxes]
        received = exchange(
            plan.group,
            pieces,
            lambda s, d: plan.shapes[s][d],
            dtype=local.dtype,
            device=local.device,
            kind=plan.kind,
        )
        return _assemble(received, plan, local)


@dataclass(frozen=True)
class _ToPartial:
    """Replicate -> Partial on one axis (internal: DTensor strategies ask for it)."""

    axis: int
    reduce_op: str
    spec: ShardTensorSpec

    def run(self, local: torch.Tensor) -> torch.Tensor:
        if self.reduce_op == "sum" and mesh_coordinate(self.spec.mesh)[self.axis] != 0:
            return torch.zeros_like(local)
        return local


def _plan(src: ShardTensorSpec, dst: ShardTensorSpec) -> list:
    reduce_axes = [
        a for a, p in enumerate(src.placements) if isinstance(p, Partial) and dst.placements[a] != p
    ]
    scatter_axes = _reduce_scatter_axes(src, dst, reduce_axes)
    all_reduce_axes = [a for a in reduce_axes if a not in scatter_axes]
    # Where the exchange must land: the target with reduce-scattered axes still Partial (their
    # dims split by the outer axes only) and target-Partial axes still Replicate.
    landing = _drop_axes(dst, scatter_axes, src)  # scatter axes are innermost: never None
    for axis, p in enumerate(dst.placements):
        if isinstance(p, Partial) and not isinstance(src.placements[axis], Partial):
            landing = _with_placement(landing, axis, Replicate())
    steps: list = []
    current = src
    reduce_at = _where_to_all_reduce(src, dst, landing, all_reduce_axes, scatter_axes)
    if reduce_at is src:
        steps += _all_reduces(all_reduce_axes, current)
        current = _replicated(current, all_reduce_axes)
    elif reduce_at is not None and reduce_at is not dst:
        steps.append(_Exchange(current, reduce_at))
        steps += _all_reduces(all_reduce_axes, reduce_at)
        current = _replicated(reduce_at, all_reduce_axes)
    elif reduce_at is dst:
        landing = _drop_axes(landing, all_reduce_axes, src)
    if not current.same_layout(landing):
        steps.append(_Exchange(current, landing))
    current = landing
    for axis in scatter_axes:
        after = _scatter_one(current, dst, axis)
        steps.append(_ReduceScatter(axis, dst.placements[axis].dim, current, after))
        current = after
    if reduce_at is dst:
        steps += _all_reduces(all_reduce_axes, current)
        current = _replicated(current, all_reduce_axes)
    for axis, p in enumerate(dst.placements):
        if isinstance(p, Partial) and not isinstance(current.placements[axis], Partial):
            steps.append(_ToPartial(axis, p.reduce_op, current))
            current = _with_placement(current, axis, p)
    return steps


def _where_to_all_reduce(
    src: ShardTensorSpec,
    dst: ShardTensorSpec,
    landing: ShardTensorSpec,
    axes: list[int],
    scatter_axes: list[int],
) -> ShardTensorSpec | None:
    """The layout on which to all-reduce ``axes`` (None: nothing to all-reduce): the one of
    the fewest elements (over all ranks: the choice must not depend on this rank's shard, or
    ranks would run different collectives) among the source; the landing of the exchange
    with those axes still Partial, unless a reduced axis is an outer axis of a nested target
    dim (the pieces left after dropping it are not intervals); and the target itself, when
    those axes shard nothing in it, after the reduce-scatters have shrunk the data. Ties keep
    the earliest (returned as ``dst`` for the target)."""
    if not axes:
        return None
    options = [src]
    reduced_later = _drop_axes(landing, axes, src)
    if reduced_later is not None:
        options.append(reduced_later)
    if scatter_axes and not any(isinstance(dst.placements[a], Shard) for a in axes):
        options.append(dst)
    return min(options, key=_elements_held)


def _replicated(spec: ShardTensorSpec, axes: list[int]) -> ShardTensorSpec:
    for axis in axes:
        spec = _with_placement(spec, axis, Replicate())
    return spec


def _elements_held(spec: ShardTensorSpec) -> int:
    """Elements held by all ranks together: the shards of each replica partition the tensor."""
    replicas = math.prod(
        n for n, p in zip(spec.mesh_shape, spec.placements) if not isinstance(p, Shard)
    )
    return math.prod(spec.shape) * replicas


def _reduce_scatter_axes(
    src: ShardTensorSpec, dst: ShardTensorSpec, reduce_axes: list[int]
) -> list[int]:
    """Partial axes that can land on their target Shard by a reduce-scatter: plain sum/avg
    partials whose axis is innermost-first among the trailing axes of the target order."""
    chosen = []
    for dim_sharding in dst.shardings:
        tail = []
        for axis in reversed(dim_sharding.axes):
            p = src.placements[axis]
            if axis in reduce_axes and type(p) is Partial and p.reduce_op in ("sum", "avg"):
                tail.append(axis)
            else:
                break
        chosen.extend(reversed(tail))
    return sorted(chosen, key=lambda a: _order_position(dst, a))


def _order_position(spec: ShardTensorSpec, axis: int) -> int:
    for s in spec.shardings:
        if axis in s.axes:
            return s.axes.index(axis)
    return 0


def _drop_axes(
    spec: ShardTensorSpec, axes: list[int], src: ShardTensorSpec
) -> ShardTensorSpec | None:
    """``spec`` with ``axes`` taken out of their dims' sharding and placed as in ``src``;
    None when an axis to drop is outside an axis that stays (no interval layout for that)."""
    if not axes:
        return spec
    placements = list(spec.placements)
    shardings = []
    for s in spec.shardings:
        keep = tuple(a for a in s.axes if a not in axes)
        if keep == s.axes:
            shardings.append(s)
        elif keep:
            if keep != s.axes[: len(keep)]:
                return None
            shardings.append(DimSharding(s.dim, keep, _outer_sizes(spec, s, len(keep))))
    for axis in axes:
        placements[axis] = src.placements[axis]
    return replace(spec, placements=tuple(placements), shardings=tuple(shardings))


def _outer_sizes(spec: ShardTensorSpec, s: DimSharding, keep: int) -> tuple[int, ...]:
    """Sizes of ``s`` summed over its innermost axes, keeping the first ``keep`` axes."""
    inner = math.prod(spec.mesh_shape[a] for a in s.axes[keep:])
    return tuple(sum(s.sizes[i : i + inner]) for i in range(0, len(s.sizes), inner))


def _scatter_one(current: ShardTensorSpec, dst: ShardTensorSpec, axis: int) -> ShardTensorSpec:
    dim = dst.placements[axis].dim
    target = dst.sharding_by_dim[dim]
    keep = target.axes.index(axis) + 1
    placements = list(current.placements)
    placements[axis] = dst.placements[axis]
    shardings = [s for s in current.shardings if s.dim != dim]
    shardings.append(DimSharding(dim, target.axes[:keep], _outer_sizes(dst, target, keep)))
    shardings.sort(key=lambda s: s.dim)
    return replace(current, placements=tuple(placements), shardings=tuple(shardings))


def _with_placement(spec: ShardTensorSpec, axis: int, placement: Placement) -> ShardTensorSpec:
    placements = list(spec.placements)
    placements[axis] = placement
    return replace(spec, placements=tuple(placements))


def _combine(pieces: list[torch.Tensor], reduce_op: str, size: int) -> torch.Tensor:
    result = pieces[0].clone()
    for piece in pieces[1:]:
        result += piece
    if reduce_op == "avg":
        result /= size
    return result


def _reduce_with_placement(
    local: torch.Tensor, axis: int, spec: ShardTensorSpec, group: AxisGroup
) -> torch.Tensor:
    """Partial subclasses with their own reduction (e.g. the p-norm partial of ``norm``)."""
    result = spec.placements[axis]._reduce_value(local, spec.mesh, axis)
    nbytes = local.numel() * local.element_size()
    ring = 2 * (group.size - 1) * nbytes // group.size
    record_comm("all_reduce", ring, ring)
    return result


# ----------------------------------------------------------------------------- box exchange
def _layout_key(spec: ShardTensorSpec) -> tuple:
    """What an exchange plan depends on, by value (NOTE [Caches are keyed by value])."""
    return (spec.mesh, spec.placements, tuple(spec.shape), spec.shardings)


@dataclass(frozen=True)
class _ExchangePlan:
    group: AxisGroup | None
    kind: str
    own_source_box: Box | None  # where this rank's target box lies inside its local shard (no comm)
    send_boxes: tuple[Box | None, ...]  # per member: region of the local shard to send
    recv_boxes: tuple[Box | None, ...]  # per member: region of the output it fills
    shapes: tuple[tuple[tuple[int, ...], ...], ...]  # shapes[src][dst]
    out_shape: tuple[int, ...]
    # Every member sends its whole shard to every other, and the shards have one shape: the
    # native all-gather (NCCL's tuned algorithms), decided from the global layouts.
    gathers_equal_shards: bool = False


_EXCHANGE_PLANS: BoundedCache[tuple, _ExchangePlan] = BoundedCache("exchange plans", 4096)


def _exchange_plan(src: ShardTensorSpec, dst: ShardTensorSpec) -> _ExchangePlan:
    key = (_layout_key(src), _layout_key(dst))
    return _EXCHANGE_PLANS.get_or_make(key, lambda: _make_exchange_plan(src, dst))


def _make_exchange_plan(src: ShardTensorSpec, dst: ShardTensorSpec) -> _ExchangePlan:
    comm_axes = _moving_axes(src, dst)
    mesh = src.mesh
    me = mesh_coordinate(mesh)
    out_shape = tuple(dst.local_shape(me))
    if not comm_axes:
        own = _intersect(_box(dst, me), _box(src, me))
        return _ExchangePlan(None, "", _relative(own, _box(src, me)), (), (), (), out_shape)
    group = axis_group(mesh, comm_axes)
    members = [_member_coordinate(me, comm_axes, mesh.shape, k) for k in range(group.size)]
    source_boxes = [_box(src, c) for c in members]
    target_boxes = [_box(dst, c) for c in members]
    shapes = tuple(
        tuple(_box_shape(_intersect(source_boxes[s], target_boxes[d])) for d in range(group.size))
        for s in range(group.size)
    )
    mine = group.index
    send_boxes = tuple(
        _relative(_intersect(source_boxes[mine], target_boxes[d]), source_boxes[mine])
        for d in range(group.size)
    )
    recv_boxes = tuple(
        _relative(_intersect(source_boxes[s], target_boxes[mine]), target_boxes[mine])
        for s in range(group.size)
    )
    kind = _exchange_kind(dst, comm_axes)
    whole = [_box_shape(box) for box in source_boxes]
    gathers = (
        kind == "all_gather"
        and len(set(whole)) == 1
        and 0 not in whole[0]
        and all(shapes[s][d] == whole[s] for s in range(group.size) for d in range(group.size))
    )
    return _ExchangePlan(group, kind, None, send_boxes, recv_boxes, shapes, out_shape, gathers)


def _moving_axes(src: ShardTensorSpec, dst: ShardTensorSpec) -> tuple[int, ...]:
    """Source-sharded axes of dims whose sharding changes: the only axes data moves along."""
    axes = set()
    for s in src.shardings:
        if dst.sharding_by_dim.get(s.dim) != s:
            axes.update(s.axes)
    return tuple(sorted(axes))


def _exchange_kind(dst: ShardTensorSpec, moving_axes: tuple[int, ...]) -> str:
    if all(isinstance(dst.placements[a], Replicate) for a in moving_axes):
        return "all_gather"
    return "all_to_all"


def _member_coordinate(
    me: tuple[int, ...], axes: tuple[int, ...], mesh_shape: tuple[int, ...], flat: int
) -> tuple[int, ...]:
    coordinate = list(me)
    for axis, position in coordinate_over_axes(flat, axes, mesh_shape).items():
        coordinate[axis] = position
    return tuple(coordinate)


def _box(spec: ShardTensorSpec, coordinate: Sequence[int]) -> Box:
    offsets = spec.local_offsets(coordinate)
    shape = spec.local_shape(coordinate)
    return tuple((o, o + n) for o, n in zip(offsets, shape))


def _intersect(a: Box, b: Box) -> Box:
    return tuple((max(a0, b0), max(max(a0, b0), min(a1, b1))) for (a0, a1), (b0, b1) in zip(a, b))


def _box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def _relative(box: Box, frame: Box) -> Box | None:
    """``box`` in the coordinates of ``frame``; None when it is empty."""
    if any(stop <= start for start, stop in box):
        return None
    return tuple((start - f0, stop - f0) for (start, stop), (f0, _) in zip(box, frame))


def _narrow_box(local: torch.Tensor, box: Box | None) -> torch.Tensor:
    if box is None:
        return local.new_empty((0,) * local.ndim)
    result = local
    for dim, (start, stop) in enumerate(box):
        if start != 0 or stop != result.shape[dim]:
            result = result.narrow(dim, start, stop - start)
    return result


def _assemble(
    received: list[torch.Tensor], plan: _ExchangePlan, local: torch.Tensor
) -> torch.Tensor:
    filled = [(box, piece) for box, piece in zip(plan.recv_boxes, received) if box is not None]
    if len(filled) == 1 and _box_shape(filled[0][0]) == plan.out_shape:
        return filled[0][1]
    out = local.new_empty(plan.out_shape)
    for box, piece in filled:
        _narrow_box(out, box).copy_(piece)
    return out
