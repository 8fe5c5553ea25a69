"""view / reshape with the sharded dim tracked through the new shape.

DTensor rewrites the target shape for each rank assuming ``torch.chunk`` shards, and turns a
flatten whose sharded dim is not the outermost into an interleaved (strided) sharding. Here
the view is decomposed into groups of input dims that become groups of output dims (DTensor's
``view_groups``), and for each group holding a sharded dim:
- forwarded unchanged: the output dim keeps the shard sizes;
- flattened (several dims into one): the output is sharded like the group's outermost dim,
  sizes times the product of the other dims. A sharding on an inner dim of the group is first
  moved onto the outermost dim (one all-to-all, nested after that dim's own axes), which is
  how flattening H and W of a 2-D block decomposition works;
- split (one dim into several): the outermost output dim is sharded, sizes divided by the
  product of the inner output dims; shard boundaries that do not fall on multiples of that
  product are first moved to the nearest ones. A split that undoes a flatten returns to the
  layout the flatten came from (NOTE [An unflatten returns to the layout before the
  flatten]);
- a flatten then a split that mixes dims (``(B, H * D) -> (B * H, D)``): both rules in turn,
  the head's shard boundaries moved to the nearest ones that fall on whole output rows.
Mesh axes along which one rank holds a dim whole (a contraction's output kept by its holder,
a dim of extent 1) are taken off first and nested back, outermost, on the output dim the held
dim becomes: the holder's view, no byte moved (NOTE [A dim one rank holds is whole on that
rank] in ``_common``); the rules above never move or replicate them.

``unbind`` and ``stack`` remove / insert a dim: local unbinds and stacks (the slices of a
sharded dim stay with their holders; a 1-D tensor's dim is unbound after an all-gather), the
layout and its memory renumbered.

``view_as_real`` / ``view_as_complex`` add / drop a trailing dim of 2 (real, imaginary) and
keep every sharding of the other dims: local views, no communication (DTensor gathers a
sharded last dim first, which every backward of a complex op on a W-sharded spectrum hit).
"""

from __future__ import annotations

import contextlib
import itertools
import math

import torch
from torch.distributed.tensor import Replicate, Shard

from shardsci.tensor._api import ShardTensor
from shardsci.tensor._binding import bind, replaced
from shardsci.tensor._caches import cached
from shardsci.tensor._collectives import axis_group
from shardsci.tensor._ops._common import (
    Held,
    accepts,
    dim_layout,
    held_on,
    reduced_now,
    with_dims_whole,
    without_held,
)
from shardsci.tensor._redistribute import redistribute_local
from shardsci.tensor._registry import register_aten_handler
from shardsci.tensor._spec import DimSharding, ShardTensorSpec, chunk_sizes, merged_hints
from shardsci.tensor._torch_compat import (
    Flatten,
    InputDim,
    Split,
    infer_size,
    view_groups,
)

aten = torch.ops.aten

Group = tuple[tuple[int, ...], tuple[int, ...]]


@register_aten_handler(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(func, args, kwargs):
    a = bind(func, args, kwargs)
    x = a.self
    spec = x._spec
    numel = math.prod(spec.shape)
    out_shape = _inferred_shape(numel, a["shape" if "shape" in a else "size"])
    if not spec.shardings and numel:
        if func is not aten.view.default or _viewable(x._local, out_shape):
            return NotImplemented
        # Every rank holds the whole tensor, in a memory layout the view cannot take (as below).
        out_spec = ShardTensorSpec.build(spec.mesh, spec.placements, out_shape, spec.dtype)
        return ShardTensor(x._local.reshape(out_shape), out_spec)
    needed, out_spec, restored = _view_plan(spec, out_shape)
    local = x._local
    if not needed.same_layout(spec):
        local = redistribute_local(local, spec, needed)
    local_shape = list(out_spec.local_shape())
    if restored is not None:
        local = redistribute_local(local.reshape(local_shape), out_spec, restored)
        return ShardTensor(local, restored)
    if func is aten.view.default and local is x._local:
        # A view the spec's (global) strides allow can still be impossible on the local shard,
        # whose memory layout may differ (a transposed gradient, an einsum's permuted output):
        # then the shard is copied.
        with contextlib.suppress(*_VIEW_REFUSED):
            return ShardTensor(local.view(local_shape), out_spec)
    return ShardTensor(local.reshape(local_shape), out_spec)


def _inferred_shape(numel: int, shape: list[int]) -> tuple[int, ...]:
    """``shape`` with its -1 filled in and its count checked against ``numel`` (DTensor's
    ``infer_size``), cached per value: it runs torch's symbolic-shape guards on every size, a
    third of a view's host time otherwise."""
    try:
        return _inferred(numel, tuple(shape))
    except TypeError:  # a symbolic size (torch.compile's dynamic shapes) is no value
        return tuple(infer_size(numel, list(shape)))


@cached("inferred view shapes", 1024)
def _inferred(numel: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(infer_size(numel, list(shape)))


@cached("view plans", 4096)
def _view_plan(
    spec: ShardTensorSpec, out_shape: tuple[int, ...]
) -> tuple[ShardTensorSpec, ShardTensorSpec, ShardTensorSpec | None]:
    """The layout the input takes first, the view's layout, and the layout an unflatten then
    returns to (NOTE [An unflatten returns to the layout before the flatten]) or None; cached
    per layout and shape, as a training step views the same layouts every iteration."""
    groups = _view_groups(tuple(spec.shape), out_shape)
    whole, held = without_held(spec) if out_shape else (spec, ())
    needed = _layout_for_view(whole, groups, out_shape)
    out_spec = _output_spec(needed, groups, out_shape, _carried_hints(spec, groups))
    restored = _unflattened(whole, groups, out_spec)
    if held:
        moved = _held_targets(held, groups, len(out_shape))
        needed, out_spec = held_on(needed, held), held_on(out_spec, moved)
        restored = None if restored is None else held_on(restored, moved)
    return needed, out_spec, restored


def _held_targets(held: tuple[Held, ...], groups: list[Group], ndim: int) -> list[Held]:
    """``held`` moved to the output dims their dims become (NOTE [A dim one rank holds is
    whole on that rank]): the first of the dim's group; for a dim in no group (of extent 1),
    the same dim if it is an output dim in no group, else the first such, else dim 0."""
    first_out = {d: out_dims[0] for in_dims, out_dims in groups for d in in_dims}
    grouped = {d for _, out_dims in groups for d in out_dims}
    free = [d for d in range(ndim) if d not in grouped]
    targets = []
    for h in held:
        target = first_out.get(h.dim)
        if target is None:
            target = h.dim if h.dim in free else (free or [0])[0]
        targets.append(Held(target, h.axes, h.holder))
    return targets


#: What ``Tensor.view`` raises for a shape the memory layout cannot take: RuntimeError on a
#: real tensor, ValueError on a fake one (torch._refs' view), as when torch.compile runs the
#: op on fake shards to learn its output (NOTE [torch.compile and ShardTensor]).
_VIEW_REFUSED = (RuntimeError, ValueError)


def _viewable(local: torch.Tensor, shape: tuple[int, ...]) -> bool:
    try:
        local.view(shape)
    except _VIEW_REFUSED:
        return False
    return True


# NOTE [Views of empty tensors]
# torch's view_groups (DTensor's rule for every view) never returns on some views of a tensor
# with no elements: (4, 0) -> (4, 2, 0, 0) loops forever (torch 2.13), so DTensor hangs there
# whatever the placements; torch.unflatten of an empty dim reaches it. An empty tensor's view
# moves no data, so its groups are chosen here instead: dims of equal extent at the front and
# at the back are forwarded one to one, and the dims between them belong to no group, so any
# sharding of theirs is replicated, which moves nothing.
def _view_groups(in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> list[Group]:
    """(input dims, output dims) pairs of a view from ``in_shape`` to ``out_shape``."""
    if math.prod(in_shape):
        return _groups(view_groups(in_shape, out_shape))
    common = min(len(in_shape), len(out_shape))
    lead = 0
    while lead < common and in_shape[lead] == out_shape[lead]:
        lead += 1
    trail = 0
    while trail < common - lead and in_shape[-1 - trail] == out_shape[-1 - trail]:
        trail += 1
    front = [((d,), (d,)) for d in range(lead)]
    back = [((len(in_shape) - k,), (len(out_shape) - k,)) for k in range(trail, 0, -1)]
    return front + back


def _groups(rule: tuple) -> list[Group]:
    """(input dims, output dims) pairs; output dims of a split share one group."""
    groups: dict[object, tuple[tuple[int, ...], list[int]]] = {}
    for out_dim, cmd in enumerate(rule):
        if isinstance(cmd, InputDim):
            groups[("forward", out_dim)] = ((cmd.input_dim,), [out_dim])
        elif isinstance(cmd, Flatten):
            groups[("flatten", out_dim)] = (_input_dims(cmd), [out_dim])
        elif isinstance(cmd, Split):
            key = ("split", _input_dims(cmd.input_dim))
            groups.setdefault(key, (_input_dims(cmd.input_dim), []))[1].append(out_dim)
    return [(in_dims, tuple(out_dims)) for in_dims, out_dims in groups.values()]


def _input_dims(cmd: object) -> tuple[int, ...]:
    if isinstance(cmd, InputDim):
        return (cmd.input_dim,)
    if isinstance(cmd, Flatten):
        return tuple(d for inner in cmd.input_dims for d in _input_dims(inner))
    return ()


def _layout_for_view(
    spec: ShardTensorSpec, groups: list[Group], out_shape: tuple[int, ...]
) -> ShardTensorSpec:
    """The input layout from which every rank can take its part of the view locally."""
    placements = list(spec.placements)
    sizes = {s.dim: s.sizes for s in spec.shardings}
    order = {s.dim: s.axes for s in spec.shardings}

    def replicate(dim: int) -> None:
        for axis in order.pop(dim):
            placements[axis] = Replicate()
        del sizes[dim]

    grouped = {d for in_dims, _ in groups for d in in_dims}
    for dim in [d for d in order if d not in grouped]:
        replicate(dim)
    for in_dims, out_dims in groups:
        sharded = [d for d in in_dims if d in order]
        if not sharded:
            continue
        head = in_dims[0]
        inner = [d for d in sharded if d != head]
        if inner:
            moved = tuple(a for d in inner for a in order[d])
            count = math.prod(spec.mesh_shape[a] for a in moved)
            outer = sizes.get(head, (spec.shape[head],))
            sizes[head] = tuple(x for size in outer for x in chunk_sizes(size, count))
            order[head] = order.get(head, ()) + moved
            for dim in inner:
                del sizes[dim], order[dim]
            for axis in moved:
                placements[axis] = Shard(head)
        if len(out_dims) > 1:
            # A flatten then a split (``(B, H * D) -> (B * H, D)``): the head's shards, each
            # times the flattened inner extent, must split into whole outer output rows.
            flattened = math.prod(spec.shape[d] for d in in_dims[1:])
            split = math.prod(out_shape[d] for d in out_dims[1:])
            sizes[head] = _on_multiples(sizes[head], split // math.gcd(flattened, split))
    return ShardTensorSpec.build(
        spec.mesh,
        placements,
        spec.shape,
        spec.dtype,
        sizes,
        stride=spec.stride,
        order=order,
        hints=spec.hints,
    )


def _on_multiples(sizes: tuple[int, ...], step: int) -> tuple[int, ...]:
    """Shard sizes whose boundaries are the multiples of ``step`` nearest to the current ones."""
    if all(s % step == 0 for s in sizes):
        return sizes
    boundaries = [0]
    running = 0
    for s in sizes:
        running += s
        boundaries.append(round(running / step) * step)
    boundaries[-1] = running
    return tuple(b - a for a, b in itertools.pairwise(boundaries))


def _output_spec(
    spec: ShardTensorSpec,
    groups: list[Group],
    out_shape: tuple[int, ...],
    hints: tuple[DimSharding, ...],
) -> ShardTensorSpec:
    placements = list(spec.placements)
    sizes: dict[int, tuple[int, ...]] = {}
    order: dict[int, tuple[int, ...]] = {}
    for in_dims, out_dims in groups:
        sharding: DimSharding | None = spec.sharding_by_dim.get(in_dims[0])
        if sharding is None:
            continue
        flattened = math.prod(spec.shape[d] for d in in_dims[1:])
        split = math.prod(out_shape[d] for d in out_dims[1:])
        head = out_dims[0]
        sizes[head] = tuple(s * flattened // split for s in sharding.sizes)
        order[head] = sharding.axes
        for a in sharding.axes:
            placements[a] = Shard(head)
    return ShardTensorSpec.build(
        spec.mesh, placements, out_shape, spec.dtype, sizes, order=order, hints=hints
    )


def _carried_hints(spec: ShardTensorSpec, groups: list[Group]) -> tuple[DimSharding, ...]:
    """The input's hints and shardings, each renumbered to the first output dim of its group
    (NOTE [Shard-size hints]); those of dims in no group are dropped."""
    first_out = {d: out_dims[0] for in_dims, out_dims in groups for d in in_dims}
    return tuple(
        DimSharding(first_out[h.dim], h.axes, h.sizes)
        for h in merged_hints(spec.hints, spec.shardings)
        if h.dim in first_out
    )


# NOTE [An unflatten returns to the layout before the flatten]
# Code written for one device flattens the spatial dims to apply a per-position op and
# unflattens them again: ``x.reshape(B, C, -1)``, a 1x1 ``conv1d``, ``y.reshape(B, C, H, W)``
# (neuraloperator's channel MLP), or ``x.view(B, C, H * W).transpose(1, 2)`` around attention
# (diffusers). Flattening an H x W block decomposition moves W's mesh axes onto H (the flatten
# rule above); splitting the flat dim again would leave H sharded over all those axes, slabs
# instead of the input's blocks. So a split of a sharded dim first asks which layouts of its
# output dims the flatten rule maps onto the dim's layout, as an inverse FFT does (NOTE [Where
# a distributed FFT leaves the spectrum]): the outermost output dim keeps a prefix of the mesh
# axes, each further output dim takes the next axes, and every output dim given axes must be
# remembered with them at its extent (NOTE [Shard-size hints]: the flatten passed the input's
# shardings on), the outermost one with the very sizes whose flatten gives the dim's. The
# first such layout, the outermost dim keeping the most axes, is restored, one all-to-all
# that undoes the flatten's; without one, or when the first is every axis on the outermost dim
# (a hint cannot tell H from W of a square grid), the split keeps every axis on the outermost
# dim (no communication). So the module returns its input's layout (NOTE [Which rank owns an output
# of a windowed op] in ``_windows``) at the cost of one all-to-all each way.
def _unflattened(
    source: ShardTensorSpec, groups: list[Group], out_spec: ShardTensorSpec
) -> ShardTensorSpec | None:
    """The layout before the flatten that ``source``'s split dims came from (NOTE above), or
    None when no split restores one."""
    placements = list(out_spec.placements)
    sizes = {s.dim: s.sizes for s in out_spec.shardings}
    order = {s.dim: s.axes for s in out_spec.shardings}
    restored = False
    for in_dims, out_dims in groups:
        sharding = source.sharding_by_dim.get(in_dims[0])
        if len(in_dims) != 1 or len(out_dims) < 2 or sharding is None:
            continue
        extents = [out_spec.shape[d] for d in out_dims]
        layout = _flattened_from(sharding, extents, out_spec.mesh_shape, out_spec.hints)
        if layout is None:
            continue
        restored = True
        del sizes[out_dims[0]], order[out_dims[0]]
        for dim, (axes, dim_sizes) in zip(out_dims, layout):
            if axes:
                sizes[dim], order[dim] = dim_sizes, axes
                for axis in axes:
                    placements[axis] = Shard(dim)
    if not restored:
        return None
    return ShardTensorSpec.build(
        out_spec.mesh,
        placements,
        out_spec.shape,
        out_spec.dtype,
        sizes,
        order=order,
        hints=out_spec.hints,
    )


def _flattened_from(
    sharding: DimSharding,
    extents: list[int],
    mesh_shape: tuple[int, ...],
    hints: tuple[DimSharding, ...],
) -> list[tuple[tuple[int, ...], tuple[int, ...]]] | None:
    """(axes, sizes) per output dim of a layout whose flatten gives ``sharding``, remembered
    in ``hints``, the outermost dim keeping the most axes; None if there is none, or if it
    is every axis on the outermost dim (the split's own layout, which moves nothing: a hint
    cannot tell which dim of equal extent it came from, H or W of a square grid, so the
    layout that needs no communication wins)."""
    axes, inner = sharding.axes, math.prod(extents[1:])
    for cut in _cuts(len(axes), len(extents)):
        parts = [axes[a:b] for a, b in itertools.pairwise(cut)]
        layout = [(part, _remembered(hints, part, extent)) for part, extent in zip(parts, extents)]
        if any(part and dim_sizes is None for part, dim_sizes in layout):
            continue
        head = layout[0][1] or (extents[0],)
        count = math.prod(mesh_shape[a] for a in axes[len(parts[0]) :])
        if tuple(x * inner for s in head for x in chunk_sizes(s, count)) == sharding.sizes:
            return None if parts[0] == axes else layout
    return None


def _cuts(count: int, parts: int) -> list[tuple[int, ...]]:
    """Ways to cut ``count`` axes into ``parts`` consecutive runs (boundaries, 0 to count),
    the first run longest first."""
    inner = itertools.combinations_with_replacement(range(count + 1), parts - 1)
    cuts = [(0, *c, count) for c in inner]
    return sorted(cuts, key=lambda c: [-b for b in c])


def _remembered(
    hints: tuple[DimSharding, ...], axes: tuple[int, ...], extent: int
) -> tuple[int, ...] | None:
    """The newest sizes remembered for ``axes`` at ``extent``, whatever the dim."""
    if not axes:
        return ()
    for hint in reversed(hints):
        if hint.axes == axes and hint.extent == extent:
            return hint.sizes
    return None


@register_aten_handler(aten.squeeze, aten.squeeze_copy)
def _squeeze(func, args, kwargs):
    """Squeeze the dims of global extent 1, named explicitly: on the shards, a bare
    ``squeeze()`` would also drop a sharded dim whose shard happens to hold one element. A
    sharded dim of extent 1 lives on one rank: squeezing it is selecting its one cell, which
    that rank broadcasts (``select``'s handler: the output's bytes, a gradient kept in the
    input's layout, and a write into the result written through, NOTE [An in-place op on a
    select's copy writes through]); DTensor refuses to squeeze a sharded dim."""
    a = bind(func, args, kwargs)
    x = a.self
    if func._overloadname == "default":
        dims = range(x.ndim)
    else:
        dims = [a.dim] if isinstance(a.dim, int) else a.dim
    squeezed = sorted({d % x.ndim for d in dims if x.ndim and x.shape[d % x.ndim] == 1})
    if not squeezed:
        return aten.alias.default(x) if func in _VIEWS else aten.clone.default(x)
    split = [d for d in squeezed if d in x._spec.sharding_by_dim]
    if not split and func._overloadname == "dims" and list(dims) == squeezed:
        return NotImplemented
    kept = x.ndim > len(squeezed)
    if split and kept and not any(d in without_held(x._spec)[0].sharding_by_dim for d in split):
        # Held dims of extent 1 (NOTE [A dim one rank holds is whole on that rank]): the view
        # rule drops them, the holder keeping its cells (a 0-d result has no dim to keep them).
        out = aten.view.default(x, [n for d, n in enumerate(x.shape) if d not in squeezed])
        return out if func in _VIEWS else aten.clone.default(out)
    for d in reversed(split):
        x = aten.select.int(x, d, 0)
    whole = [d - sum(s < d for s in split) for d in squeezed if d not in split]
    out = func.overloadpacket.dims(x, whole) if whole else x
    return out if func in _VIEWS or not split else aten.clone.default(out)


_VIEWS = {aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims}


@register_aten_handler(aten.expand.default)
def _expand(func, args, kwargs):
    """A sharded dim of extent 1 that the expansion broadcasts lives on one rank: it is
    replicated first (the owner broadcasts its element). DTensor's rule fails there with a
    KeyError (torch 2.13). A pending sum that the expansion enlarges is reduced first (an
    all-reduce of the small tensor): left pending, the expanded view (a sum's backward: the
    gradient of ``x.sum(d, keepdim=True)`` spread over ``x``) is held whole on every rank
    and reduced into ``x``'s shards by a reduce-scatter of the whole expanded extent (NOTE
    [Gathers an op was not asked to make] in ``_gather_guard``)."""
    a = bind(func, args, kwargs)
    x = a.self
    # The sizes of x's dims (torch rejects fewer sizes than dims: the default path says so).
    sizes = a.size[len(a.size) - x.ndim :] if len(a.size) >= x.ndim else []
    broadcast = [d for d, n in enumerate(sizes) if x.shape[d] == 1 and n not in (1, -1)]
    pending = (bool(broadcast) or len(a.size) > x.ndim) and bool(x._spec.partial)
    if not accepts(x, partial=True) or not (pending or accepts(x, sharded=broadcast)):
        return NotImplemented
    whole, held = without_held(x._spec)
    if not pending and held and not any(d in whole.sharding_by_dim for d in broadcast):
        return _expand_held(x, list(a.size), whole, held)
    x = reduced_now(x) if pending else x
    args, kwargs = replaced(func, args, kwargs, {"self": with_dims_whole(x, broadcast)})
    return func(*args, **kwargs)


def _expand_held(
    x: ShardTensor, size: list[int], whole: ShardTensorSpec, held: tuple[Held, ...]
) -> ShardTensor:
    """``x`` expanded to ``size`` where the sharded dims it broadcasts are held by one rank
    (NOTE [A dim one rank holds is whole on that rank]): the holder expands its extent-1 dim,
    the others their empty one, and the dim stays with the holder. No byte moves."""
    lead = len(size) - x.ndim
    shape = [x.shape[d - lead] if n == -1 else n for d, n in enumerate(size)]
    stride = torch.empty_strided(x.shape, x._spec.stride, device="meta").expand(shape).stride()
    spec = ShardTensorSpec.build(
        whole.mesh,
        [Shard(p.dim + lead) if isinstance(p, Shard) else p for p in whole.placements],
        shape,
        x.dtype,
        {s.dim + lead: s.sizes for s in whole.shardings},
        stride=stride,
        order={s.dim + lead: s.axes for s in whole.shardings},
    )
    spec = held_on(spec, [Held(h.dim + lead, h.axes, h.holder) for h in held])
    return ShardTensor(x._local.expand(spec.local_shape()), spec)


@register_aten_handler(aten.unbind.int)
def _unbind(func, args, kwargs):
    """Along a sharded dim each slice lives on one rank, and stays there (NOTE [An unbound
    slice stays with its holder]); a 1-D tensor's 0-d slices have no dim to carry it, so the
    dim is replicated first (one all-gather), which DTensor refuses to do. The pieces' layout
    and memory are renumbered past the removed dim (NOTE [Shard-size hints]; the default rule
    keeps the old numbers)."""
    a = bind(func, args, kwargs)
    x = a.self
    if not accepts(x, partial=True) or x.ndim == 0:
        return NotImplemented
    dim = a.dim % x.ndim
    if dim in x._spec.sharding_by_dim and x.ndim > 1:
        return _unbind_held(x, dim)
    x = with_dims_whole(x, {dim})
    spec = x._spec
    kept = [d for d in range(spec.ndim) if d != dim]
    out_spec = _renumbered(
        spec,
        {d: k for k, d in enumerate(kept)},
        [spec.shape[d] for d in kept],
        stride=[spec.stride[d] for d in kept],
    )
    return tuple(ShardTensor(piece, out_spec) for piece in x._local.unbind(dim))


# NOTE [An unbound slice stays with its holder]
# ``unbind`` along a sharded dim gives slices that each lie on one rank of the dim's axes. The
# slice keeps them: those axes shard a dim ``e`` of the slice, nested outermost (NOTE [A dim
# one rank holds is whole on that rank] in ``_held``), its holder holding all that the slice
# lays out along ``e`` and the others nothing. ``e`` is the first dim the input holds whole,
# else the first other dim, whose own axes then split it within the holder's block (2-D
# blocks). No byte moves, and no rank holds a slice it did not hold. ``stack`` of such slices
# in their holders' order (``unbind``'s backward) is the inverse: sharded along the new dim,
# each rank stacking the slices it holds.
def _unbind_held(x: ShardTensor, dim: int) -> tuple[ShardTensor, ...]:
    spec = x._spec
    sharding, group, starts = dim_layout(spec, dim)
    kept = [d for d in range(spec.ndim) if d != dim]
    new_dim = {d: k for k, d in enumerate(kept)}
    whole = [d for d in kept if d not in spec.sharding_by_dim]
    e = new_dim[whole[0] if whole else kept[0]]
    rest = [s for s in spec.shardings if s.dim != dim]
    base = ShardTensorSpec.build(
        spec.mesh,
        [
            (Replicate() if p.dim == dim else Shard(new_dim[p.dim])) if isinstance(p, Shard) else p
            for p in spec.placements
        ],
        [spec.shape[d] for d in kept],
        spec.dtype,
        {new_dim[s.dim]: s.sizes for s in rest},
        order={new_dim[s.dim]: s.axes for s in rest},
        hints=tuple(
            DimSharding(new_dim[h.dim], h.axes, h.sizes) for h in spec.hints if h.dim in new_dim
        ),
    )
    pieces = []
    for i in range(spec.shape[dim]):
        holder = max(k for k, n in enumerate(sharding.sizes) if n and starts[k] <= i)
        out_spec = held_on(base, [Held(e, sharding.axes, holder)])
        local = (
            x._local.select(dim, i - starts[holder])
            if group.index == holder
            else x._local.new_empty(out_spec.local_shape())
        )
        pieces.append(ShardTensor(local, out_spec))
    return tuple(pieces)


@register_aten_handler(aten.stack.default)
def _stack(func, args, kwargs):
    """Tensors of one layout stacked along a new dim: local stacks, the layout and every
    operand's memory renumbered past the new dim (the default rule keeps the old numbers)."""
    a = bind(func, args, kwargs)
    tensors = list(a.tensors)
    first = tensors[0] if tensors else None
    if not isinstance(first, ShardTensor) or not all(
        isinstance(t, ShardTensor) and t._spec.same_layout(first._spec) for t in tensors
    ):
        held = _stack_held(tensors, a.dim)
        return NotImplemented if held is None else held
    spec = first._spec
    dim = a.dim % (spec.ndim + 1)
    shape = list(spec.shape)
    shape.insert(dim, len(tensors))
    local = torch.stack([t._local for t in tensors], dim)
    out_spec = _renumbered(
        spec,
        {d: d + (d >= dim) for d in range(spec.ndim)},
        shape,
        hints=merged_hints(*(t._spec.hints for t in tensors)),
    )
    return ShardTensor(local, out_spec.with_dtype(local.dtype))


def _stack_held(tensors: list, dim: int) -> ShardTensor | None:
    """Slices each held by one rank along a dim ``e`` over the same outermost axes, laid out
    alike within the holder's block, in their holders' order, stacked along the new ``dim``:
    sharded along it over those axes, each rank stacking its own (NOTE [An unbound slice
    stays with its holder]); None for any other operands."""
    if not tensors or not all(isinstance(t, ShardTensor) for t in tensors):
        return None
    holders, base, where = [], None, None
    for t in tensors:
        rest, held = without_held(t._spec)
        if len(held) != 1 or (base is not None and not rest.same_layout(base)):
            return None
        if where is not None and (held[0].dim, held[0].axes) != where:
            return None
        base, where = rest, (held[0].dim, held[0].axes)
        holders.append(held[0].holder)
    if holders != sorted(holders):
        return None
    axes = where[1]
    dim = dim % (base.ndim + 1)
    shape = list(base.shape)
    shape.insert(dim, len(tensors))
    out = _renumbered(
        base,
        {d: d + (d >= dim) for d in range(base.ndim)},
        shape,
        hints=merged_hints(*(t._spec.hints for t in tensors)),
    )
    placements = [Shard(dim) if a in axes else p for a, p in enumerate(out.placements)]
    count = math.prod(base.mesh_shape[a] for a in axes)
    sizes = {s.dim: s.sizes for s in out.shardings}
    order = {s.dim: s.axes for s in out.shardings}
    sizes[dim], order[dim] = tuple(holders.count(k) for k in range(count)), axes
    out = out.relaid(placements, sizes, order=order)
    index = axis_group(base.mesh, axes).index
    mine = [t._local for t, k in zip(tensors, holders) if k == index]
    local = torch.stack(mine, dim) if mine else tensors[0]._local.new_empty(out.local_shape())
    return ShardTensor(local, out.with_dtype(local.dtype))


def _renumbered(
    spec: ShardTensorSpec,
    new_dim: dict[int, int],
    shape: list[int],
    *,
    stride: list[int] | None = None,
    hints: tuple[DimSharding, ...] | None = None,
) -> ShardTensorSpec:
    """``spec`` with dim ``d`` now called ``new_dim[d]`` in a tensor of ``shape``: placements,
    sizes, axis order and hints (``spec``'s or ``hints``); a hint of a dim not in ``new_dim``
    is dropped. Every sharded dim must be in ``new_dim``."""
    placements = [Shard(new_dim[p.dim]) if isinstance(p, Shard) else p for p in spec.placements]
    return ShardTensorSpec.build(
        spec.mesh,
        placements,
        shape,
        spec.dtype,
        {new_dim[s.dim]: s.sizes for s in spec.shardings},
        stride=stride,
        order={new_dim[s.dim]: s.axes for s in spec.shardings},
        hints=tuple(
            DimSharding(new_dim[h.dim], h.axes, h.sizes)
            for h in (spec.hints if hints is None else hints)
            if h.dim in new_dim
        ),
    )


@register_aten_handler(aten.unsafe_split.Tensor, aten.unsafe_split_with_sizes.default)
def _unsafe_split(func, args, kwargs):
    """The same as ``split``, which has the rules."""
    twin = aten.split.Tensor if func is aten.unsafe_split.Tensor else aten.split_with_sizes.default
    return twin(*args, **kwargs)


@register_aten_handler(aten.view_as_real.default, aten.view_as_complex.default)
def _complex_view(func, args, kwargs):
    """``view_as_real`` / ``view_as_complex`` (``.real``, ``.imag``) keep every dim's sharding:
    they add or drop a trailing dim of two reals, which is never sharded."""
    x = bind(func, args, kwargs).self
    spec = x._spec
    to_real = func is aten.view_as_real.default
    if not accepts(x, whole=[] if to_real else [-1], partial=True):
        return NotImplemented
    local = x._local
    if not to_real and not _pairs_adjacent(local.stride(), local.storage_offset()):
        local = local.contiguous()  # a moved or sliced shard: pairs not adjacent in memory
    local = func(local)
    if to_real:
        shape, stride = (*spec.shape, 2), (*(2 * s for s in spec.stride), 1)
    elif _pairs_adjacent(spec.stride, 0):
        shape, stride = tuple(spec.shape[:-1]), tuple(s // 2 for s in spec.stride[:-1])
    else:
        shape, stride = tuple(spec.shape[:-1]), None
    out_spec = ShardTensorSpec.build(
        spec.mesh,
        spec.placements,
        shape,
        local.dtype,
        {s.dim: s.sizes for s in spec.shardings},
        stride=stride,
        order={s.dim: s.axes for s in spec.shardings},
        hints=spec.hints,
    )
    return ShardTensor(local, out_spec)


def _pairs_adjacent(stride: tuple[int, ...], offset: int) -> bool:
    """Whether a view as complex numbers is possible: (real, imaginary) pairs adjacent."""
    return stride[-1] == 1 and offset % 2 == 0 and all(s % 2 == 0 for s in stride[:-1])
