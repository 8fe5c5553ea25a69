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

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from shardsci.tensor._box_packing import (
    NO_PIECES,
    Box,
    Side,
    narrow_box,
    pack,
    side_of,
    unpack,
    wire_order,
    with_range,
)
from shardsci.tensor._caches import BoundedCache
from shardsci.tensor._collectives import (
    AxisGroup,
    all_gather,
    all_reduce,
    axis_group,
    exchange_packed,
)
from shardsci.tensor._comm_stats import record_comm
from shardsci.tensor._gather_guard import check_redistribution
from shardsci.tensor._spec import (
    DimSharding,
    ShardTensorSpec,
    coordinate_over_axes,
    mesh_coordinate,
)

__all__ = ["largest_receive", "redistribute_local", "target_spec"]


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
    steps = _PLANS.get_or_make((src.key, dst.key), lambda: _plan(src, dst))
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
        # Every peer's piece travels with the scattered dim first: one pack, and the pieces
        # received are one tensor to sum (NOTE [One pack and one unpack per collective]).
        order = (self.dim, *(d for d in range(local.ndim) if d != self.dim))
        starts = [sum(extents[:k]) for k in range(group.size)]
        whole = tuple((0, n) for n in local.shape)
        peers = [k for k in range(group.size) if k != group.index]
        peers.sort(key=group.group_ranks.__getitem__)
        sends = [
            with_range(whole, self.dim, (starts[k], starts[k] + extents[k]))
            for k in peers
            if extents[k]
        ]
        own = local.narrow(self.dim, starts[group.index], extents[group.index])
        row = math.prod(local.shape) // max(local.shape[self.dim], 1)
        send_counts, recv_counts = [0] * group.size, [0] * group.size
        for k in peers:
            send_counts[group.group_ranks[k]] = extents[k] * row
            recv_counts[group.group_ranks[k]] = extents[group.index] * row
        if row == 0 or not any(extents):
            result = own.clone()
        else:
            received = exchange_packed(
                group,
                pack(local, side_of(sends, order), order),
                send_counts,
                recv_counts,
                kind="reduce_scatter",
            )
            piece = own.permute(order).shape
            result = own + received.view(len(peers), *piece).sum(0).permute(_inverse(order))
        if reduce_op == "avg":
            result /= group.size
        return result


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
            return narrow_box(local, plan.own_source_box)
        if plan.gathers_equal_shards:
            out = local.new_empty(plan.out_shape)
            unpack(out, all_gather(local, plan.group).reshape(-1), plan.receives, plan.order)
            return out
        if not plan.moves:
            received = local.new_empty(0)
        else:  # the packed buffer is freed before the output is made
            received = exchange_packed(
                plan.group,
                pack(local, plan.sends, plan.order),
                plan.send_counts,
                plan.recv_counts,
                kind=plan.kind,
            )
        if plan.received_fills_output:
            # What arrives is the whole output, in order: the buffer is it (no copy) when that
            # order is the dims' own. Packed in another order it is copied out, contiguous as
            # every other rank's output is: ranks that hold the same tensor with other strides
            # part ways in any op that asks (``_pdist_forward`` raised on one rank only).
            shape = [plan.out_shape[d] for d in plan.order]
            return received.view(shape).permute(_inverse(plan.order)).contiguous()
        out = local.new_empty(plan.out_shape)
        if plan.own_source_box is not None:
            narrow_box(out, plan.own_target_box).copy_(narrow_box(local, plan.own_source_box))
        unpack(out, received, plan.receives, plan.order)
        return out


def _inverse(order: tuple[int, ...]) -> list[int]:
    return sorted(range(len(order)), key=order.__getitem__)


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


# The steps from one layout to another, planned once per pair of layouts (NOTE [Caches are keyed
# by value]): a spec's key holds its dtype too, since the steps hold the specs they run on.
_PLANS: BoundedCache[tuple, tuple] = BoundedCache("redistribution plans", 4096)


def _plan(src: ShardTensorSpec, dst: ShardTensorSpec) -> tuple:
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
    return tuple(steps)


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


def _reduce_with_placement(
    local: torch.Tensor, axis: int, spec: ShardTensorSpec, group: AxisGroup
) -> torch.Tensor:
    """Partial subclasses with their own reduction (e.g. the p-norm partial of ``norm``)."""
    placement = spec.placements[axis]
    if getattr(getattr(placement, "mask_buffer", None), "data", False) is None:
        # DTensor's _MaskPartial keeps its mask from its own dispatch, which shardsci replaces:
        # no rank has it, so every rank says so here, before the all-reduce.
        raise NotImplementedError(
            f"shardsci cannot reduce DTensor's {placement} over mesh axis {axis}: the mask it "
            "needs was never saved; redistribute the indexed input to the layout you want first"
        )
    result = placement._reduce_value(local, spec.mesh, axis)
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
    """This rank's part of one box exchange (NOTE [One pack and one unpack per collective])."""

    group: AxisGroup | None
    kind: str
    own_source_box: Box | None  # the part of its target box this rank holds, in its shard
    own_target_box: Box | None  # ... and in its output
    out_shape: tuple[int, ...]
    order: tuple[int, ...] = ()  # the wire order
    sends: Side = NO_PIECES
    receives: Side = NO_PIECES
    send_counts: tuple[int, ...] = ()  # elements sent to each group rank
    recv_counts: tuple[int, ...] = ()  # elements received from each
    moves: bool = False  # anything moves between any two members (else no collective)
    received_fills_output: bool = False  # no own part; the received pieces are the output
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
        return _ExchangePlan(None, "", _relative(own, _box(src, me)), None, out_shape)
    group = axis_group(mesh, comm_axes)
    members = [_member_coordinate(me, comm_axes, mesh.shape, k) for k in range(group.size)]
    source_boxes = [_box(src, c) for c in members]
    target_boxes = [_box(dst, c) for c in members]
    mine = group.index
    moving = [
        (s, d)
        for s in range(group.size)
        for d in range(group.size)
        if s != d and _volume(_intersect(source_boxes[s], target_boxes[d])) > 0
    ]
    # A gather: every rank that sends to another wants the same box as it (a target
    # Replicate, or sharded along axes that do not move).
    gather = all(target_boxes[s] == target_boxes[d] for s, d in moving)
    kind = "all_gather" if gather else "all_to_all"
    whole = [_box_shape(box) for box in source_boxes]
    gathers = (
        kind == "all_gather"
        and len(set(whole)) == 1
        and 0 not in whole[0]
        and all(_intersect(s, t) == s for s in source_boxes for t in target_boxes)
    )
    if gathers:
        stacked = [_relative(box, target_boxes[mine]) for box in source_boxes]
        identity = tuple(range(len(out_shape)))
        return _ExchangePlan(
            group,
            kind,
            None,
            None,
            out_shape,
            identity,
            receives=side_of(stacked, identity),
            gathers_equal_shards=True,
        )
    order = wire_order(source_boxes, target_boxes)
    # Peers in group-rank order: the order of an all-to-all's splits.
    peers = sorted((k for k in range(group.size) if k != mine), key=group.group_ranks.__getitem__)
    sends = {
        d: _relative(_intersect(source_boxes[mine], target_boxes[d]), source_boxes[mine])
        for d in peers
    }
    receives = {
        s: _relative(_intersect(source_boxes[s], target_boxes[mine]), target_boxes[mine])
        for s in peers
    }
    send_counts, recv_counts = [0] * group.size, [0] * group.size
    for k in peers:
        send_counts[group.group_ranks[k]] = _volume(sends[k])
        recv_counts[group.group_ranks[k]] = _volume(receives[k])
    own = _intersect(source_boxes[mine], target_boxes[mine])
    own_target = _relative(own, target_boxes[mine])
    receive_side = side_of([b for b in receives.values() if b is not None], order)
    return _ExchangePlan(
        group,
        kind,
        _relative(own, source_boxes[mine]),
        own_target,
        out_shape,
        order,
        side_of([b for b in sends.values() if b is not None], order),
        receive_side,
        tuple(send_counts),
        tuple(recv_counts),
        moves=bool(moving),
        received_fills_output=(
            own_target is None
            and receive_side.how == "rows"
            and receive_side.index is None
            and _box_shape(receive_side.region) == out_shape
        ),
    )


def largest_receive(src: ShardTensorSpec, dst: ShardTensorSpec) -> int:
    """Elements the busiest rank receives moving from ``src`` to ``dst`` (neither Partial):
    its target box less the part of it it holds, the bytes one box exchange moves."""
    coordinates = itertools.product(*(range(n) for n in src.mesh.shape))
    return max(
        _volume(_box(dst, c)) - _volume(_intersect(_box(dst, c), _box(src, c))) for c in coordinates
    )


def _volume(box: Box | None) -> int:
    return 0 if box is None else math.prod(_box_shape(box))


def _moving_axes(src: ShardTensorSpec, dst: ShardTensorSpec) -> tuple[int, ...]:
    """Source-sharded axes of dims whose sharding changes: the only axes data moves along."""
    axes = set()
    for s in src.shardings:
        if dst.sharding_by_dim.get(s.dim) != s:
            axes.update(s.axes)
    return tuple(sorted(axes))


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
