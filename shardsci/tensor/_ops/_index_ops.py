"""Indexing and reordering along a sharded dim, with the least data moved.

DTensor gathers the whole dim first. Here:
- ``slice`` (any start, stop, step) stays local: each rank keeps the selected elements of its
  own interval and the shard sizes shrink, possibly to zero. Its backward writes the gradient
  into the original layout, remembered in the spec's hints. ``split`` is slices.
- ``select`` broadcasts the selected slice from the rank that owns it.
- ``flip``, ``roll``, ``channel_shuffle`` and ``cat`` keep the output aligned with the input
  (``cat``: each rank owns its pieces of every input) and gather only the intervals a rank
  lacks, in one exchange per sharded dim (``_intervals``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch.distributed.tensor import Replicate, Shard

from shardsci.tensor._api import ShardTensor
from shardsci.tensor._binding import bind
from shardsci.tensor._collectives import AxisGroup, axis_group, broadcast
from shardsci.tensor._copies import local_view, select_copy
from shardsci.tensor._held import held_axes
from shardsci.tensor._intervals import gather_intervals
from shardsci.tensor._ops._common import accepts, dim_layout
from shardsci.tensor._redistribute import redistribute_local
from shardsci.tensor._registry import register_aten_handler
from shardsci.tensor._shape_probe import probe_on_meta
from shardsci.tensor._spec import (
    DimSharding,
    ShardTensorSpec,
    merged_hints,
)

aten = torch.ops.aten


# ---------------------------------------------------------------------------- slice
def _selected_count(lo: int, hi: int, start: int, step: int) -> int:
    """How many of start, start + step, ... lie in [lo, hi)."""
    lo = max(lo, start)
    first = start + -(-(lo - start) // step) * step
    return 0 if first >= hi else (hi - 1 - first) // step + 1


def _slice_bounds(extent: int, start: int | None, end: int | None) -> tuple[int, int]:
    start = 0 if start is None else start
    end = extent if end is None else end
    start = min(max(start + extent if start < 0 else start, 0), extent)
    end = min(max(end + extent if end < 0 else end, 0), extent)
    return start, max(start, end)


@register_aten_handler(aten.slice.Tensor)
def _slice(func, args, kwargs):
    a = bind(func, args, kwargs)
    x, step = a.self, a.step
    if not accepts(x, sharded=[a.dim], partial=True):  # a 0-d x: torch's error, default path
        return NotImplemented
    dim = a.dim % x.ndim
    start, end = _slice_bounds(x.shape[dim], a.start, a.end)
    sharding, group, starts = dim_layout(x._spec, dim)
    counts = tuple(
        _selected_count(o, min(o + s, end), start, step) for o, s in zip(starts, sharding.sizes)
    )
    mine = group.index
    lo = max(starts[mine], start)
    first = start + -(-(lo - start) // step) * step - starts[mine]
    local = (
        x._local.narrow(dim, 0, 0)
        if counts[mine] == 0
        else x._local[
            (slice(None),) * dim + (slice(first, first + (counts[mine] - 1) * step + 1, step),)
        ]
    )
    spec = _resized(x._spec, dim, counts, remember=sharding)
    out = ShardTensor(local, spec.with_dtype(local.dtype))
    out._copy_of = local_view(func)  # NOTE [A write into a view that is a copy]
    return out


@register_aten_handler(aten.split.Tensor, aten.split_with_sizes.default)
def _split(func, args, kwargs):
    """``split`` along a sharded dim: each piece is a slice (above), so every rank keeps the
    elements of its own interval and nothing moves (DTensor would gather the dim). The
    pieces' lengths, and torch's errors, come from the op on a meta tensor of the global
    shape, on every rank alike."""
    a = bind(func, args, kwargs)
    x = a.self
    if not accepts(x, sharded=[a.dim], partial=True):
        return NotImplemented
    dim = a.dim % x.ndim
    lengths = [p.shape[dim] for p in probe_on_meta(func, args, kwargs)]
    starts = itertools.accumulate(lengths, initial=0)
    return [aten.slice.Tensor(x, dim, s, s + n) for s, n in zip(starts, lengths)]


@register_aten_handler(aten.slice_backward.default)
def _slice_backward(func, args, kwargs):
    a = bind(func, args, kwargs)
    grad, input_sizes, step = a.grad_output, a.input_sizes, a.step
    dim = a.dim % len(input_sizes)
    if not accepts(grad, sharded=[dim]):
        return NotImplemented
    start, end = _slice_bounds(input_sizes[dim], a.start, a.end)
    grad_sharding, group, grad_starts = dim_layout(grad._spec, dim)
    sizes = _layout_holding(grad._spec, grad_sharding, input_sizes[dim], start, end, step)
    spec = _resized(grad._spec, dim, sizes, extent=input_sizes[dim])
    out = grad._local.new_zeros(spec.local_shape())
    mine = group.index
    if grad._local.shape[dim]:
        offset = sum(sizes[:mine])
        first = start + grad_starts[mine] * step - offset
        count = grad._local.shape[dim]
        out[(slice(None),) * dim + (slice(first, first + (count - 1) * step + 1, step),)] = (
            grad._local
        )
    return ShardTensor(out, spec)


def _layout_holding(
    spec: ShardTensorSpec, grad: DimSharding, extent: int, start: int, end: int, step: int
) -> tuple[int, ...]:
    """Shard sizes of the sliced-from dim in which each rank owns the elements its gradient
    shard selects: the remembered forward layout when it qualifies, else boundaries at the
    first selected element of each rank."""
    for hint in spec.hints:
        if hint.axes == grad.axes and hint.extent == extent:
            offsets = [sum(hint.sizes[:k]) for k in range(len(hint.sizes))]
            counts = [
                _selected_count(o, min(o + s, end), start, step)
                for o, s in zip(offsets, hint.sizes)
            ]
            if tuple(counts) == grad.sizes:
                return hint.sizes
    boundaries = [0]
    before = 0
    for count in grad.sizes[:-1]:
        before += count
        boundaries.append(min(start + before * step, extent) if before else 0)
    boundaries.append(extent)
    return tuple(b - a for a, b in itertools.pairwise(boundaries))


def _resized(
    spec: ShardTensorSpec,
    dim: int,
    sizes: tuple[int, ...],
    *,
    extent: int | None = None,
    remember: DimSharding | None = None,
) -> ShardTensorSpec:
    shape = list(spec.shape)
    shape[dim] = sum(sizes) if extent is None else extent
    hints = merged_hints(spec.hints, (remember,) if remember is not None else ())
    return ShardTensorSpec.build(
        spec.mesh,
        spec.placements,
        shape,
        spec.dtype,
        {**{s.dim: s.sizes for s in spec.shardings}, dim: sizes},
        order={s.dim: s.axes for s in spec.shardings},
        hints=hints,
    )


# ---------------------------------------------------------------------------- select
# NOTE [An in-place op on a select's copy writes through]
# A select along a split dim is a copy: its owner broadcasts the row. On one process it is a
# view, and ``u[:, 0].zero_()``, ``u.select(1, 0).mul_(2)`` or ``u[:, 0] += g`` (an ``add_``
# on it, then ``__setitem__``) write into ``u``; on the copy such a write was silently lost.
# So the copy remembers the owner's row and its own shard (``ShardTensor._copy_of``), and
# dispatch, after any op that mutates the copy or a view of it (``u[:, 0][1:3].zero_()``,
# which shares that shard), copies the shard into that row on the owner: every rank ran the
# op on the same replicated copy, so the owner's row gets what every rank holds, and nothing
# moves (NOTE [A write into a view that is a copy] in ``_copies.py``). Autograd already
# treats the select as a view of ``u``, so gradients see the write.
@register_aten_handler(aten.select.int)
def _select(func, args, kwargs):
    a = bind(func, args, kwargs)
    x = a.self
    if not accepts(x, sharded=[a.dim], partial=True):  # a 0-d x: torch's error, default path
        return NotImplemented
    dim = a.dim % x.ndim
    index = a.index % x.shape[dim]
    sharding, group, starts = dim_layout(x._spec, dim)
    owner = max(k for k in range(group.size) if starts[k] <= index and sharding.sizes[k])
    shape = [n for d, n in enumerate(x._local.shape) if d != dim]
    piece = x._local.select(dim, index - starts[owner]) if group.index == owner else None
    local = broadcast(piece, owner, group, shape=shape, dtype=x.dtype, device=x._local.device)
    out = ShardTensor(local, _without_dim(x._spec, dim, sharding))
    out._copy_of = select_copy(func, local, piece)
    return out


def _without_dim(spec: ShardTensorSpec, dim: int, sharding: DimSharding) -> ShardTensorSpec:
    placements = [
        Replicate()
        if isinstance(p, Shard) and p.dim == dim
        else Shard(p.dim - 1)
        if isinstance(p, Shard) and p.dim > dim
        else p
        for p in spec.placements
    ]
    shape = [n for d, n in enumerate(spec.shape) if d != dim]
    others = [s for s in spec.shardings if s.dim != dim]
    renumber = {s.dim: s.dim - (s.dim > dim) for s in others}
    return ShardTensorSpec.build(
        spec.mesh,
        placements,
        shape,
        spec.dtype,
        {renumber[s.dim]: s.sizes for s in others},
        order={renumber[s.dim]: s.axes for s in others},
        hints=merged_hints(spec.hints, (sharding,)),
    )


@register_aten_handler(aten.select_backward.default)
def _select_backward(func, args, kwargs):
    """The gradient scattered into zeros of the input's shape. Its dims keep the gradient's
    shardings; the selected dim takes the forward's remembered layout when the forward
    selected along a sharded dim (which left the gradient replicated over those axes), else
    stays whole (DTensor's rule misplaces the sharded dims for a negative ``dim``)."""
    a = bind(func, args, kwargs)
    grad, input_sizes = a.grad_output, a.input_sizes
    dim = a.dim % len(input_sizes)
    extent = input_sizes[dim]
    index = a.index % extent
    spec = grad._spec
    placements = [
        Shard(p.dim + (p.dim >= dim)) if isinstance(p, Shard) else p for p in spec.placements
    ]
    sizes = {s.dim + (s.dim >= dim): s.sizes for s in spec.shardings}
    order = {s.dim + (s.dim >= dim): s.axes for s in spec.shardings}
    forward = next(
        (
            h
            for h in reversed(spec.hints)
            if h.extent == extent and all(isinstance(spec.placements[a], Replicate) for a in h.axes)
        ),
        None,
    )
    if forward is not None:
        for axis in forward.axes:
            placements[axis] = Shard(dim)
        sizes[dim], order[dim] = forward.sizes, forward.axes
    out_spec = ShardTensorSpec.build(
        spec.mesh, placements, input_sizes, grad.dtype, sizes, order=order, hints=spec.hints
    )
    out = grad._local.new_zeros(out_spec.local_shape())
    start = out_spec.local_offsets()[dim]
    if start <= index < start + out.shape[dim]:
        out.select(dim, index - start).copy_(grad._local)
    return ShardTensor(out, out_spec)


# ---------------------------------------------------------------------------- flip / roll
@register_aten_handler(aten.flip.default)
def _flip(func, args, kwargs):
    """Each shard flips its cells, then fetches its own mirror image along each split flipped
    dim. A dim held whole flips locally, whatever the other dims' layout (as ``roll``), so a
    flip never gathers."""
    a = bind(func, args, kwargs)
    x = a.self
    if not accepts(x, partial=True):
        return NotImplemented
    dims = [d % x.ndim for d in a.dims]
    local = x._local.flip(dims)
    for dim in [d for d in dims if d in x._spec.sharding_by_dim]:
        local = _unflip_owners(local, x._spec, dim)
    return ShardTensor(local, x._spec)


def _unflip_owners(local: torch.Tensor, spec: ShardTensorSpec, dim: int) -> torch.Tensor:
    """After a local flip, each rank holds the mirror image of its interval: fetch its own."""
    sharding, group, starts = dim_layout(spec, dim)
    extent = spec.shape[dim]
    return gather_intervals(
        [local],
        lambda k: [(extent - starts[k] - sharding.sizes[k], extent - starts[k])],
        lambda k: [(starts[k], starts[k] + sharding.sizes[k])],
        dim,
        group,
    )


@register_aten_handler(aten.roll.default)
def _roll(func, args, kwargs):
    """Each shard fetches the cells that roll into it (only those that cross a boundary move).
    A dim held whole rolls locally, whatever the other dims' layout (the gradient of
    ``fftshift`` along a whole dim of a batch-split spectrum, say), so a roll never gathers.
    Without dims torch rolls the tensor in flat (row-major) order: with the leading dim the
    only sharded one, each shard is a contiguous run of that order, rolled the same way."""
    a = bind(func, args, kwargs)
    x = a.self
    if not accepts(x, partial=True):
        return NotImplemented
    dims = [d % x.ndim for d in a.dims]
    if not dims:
        sharded = set(x._spec.sharding_by_dim)
        if not sharded:
            return ShardTensor(x._local.roll(a.shifts[0]), x._spec)
        if sharded != {0}:
            return NotImplemented
        return ShardTensor(_roll_flattened(x._local, x._spec, a.shifts[0]), x._spec)
    local = x._local
    for shift, dim in zip(a.shifts, dims):
        if dim not in x._spec.sharding_by_dim:
            local = local.roll(shift, dim)
            continue
        sharding = x._spec.sharding_by_dim[dim]
        group = axis_group(x._spec.mesh, sharding.axes)
        local = _roll_sharded(local, sharding.sizes, group, dim, shift)
    return ShardTensor(local, x._spec)


def _roll_flattened(local: torch.Tensor, spec: ShardTensorSpec, shift: int) -> torch.Tensor:
    """``roll`` in flat order of a tensor sharded along its leading dim only: the shards are
    consecutive runs of ``sizes[k] * (cells per row)`` flat cells."""
    sharding = spec.sharding_by_dim[0]
    row = math.prod(spec.shape[1:])
    group = axis_group(spec.mesh, sharding.axes)
    sizes = [n * row for n in sharding.sizes]
    return _roll_sharded(local.reshape(-1), sizes, group, 0, shift).reshape(local.shape)


def _roll_sharded(
    local: torch.Tensor, sizes: Sequence[int], group: AxisGroup, dim: int, shift: int
) -> torch.Tensor:
    """``local`` (this rank's shard of ``dim``, split as ``sizes`` over ``group``) rolled by
    ``shift`` along ``dim``."""
    extent = sum(sizes)
    if extent == 0:
        return local
    starts = list(itertools.accumulate(sizes, initial=0))[:-1]

    def wanted(k: int) -> list[tuple[int, int]]:
        begin, length = (starts[k] - shift) % extent, sizes[k]
        if begin + length <= extent:
            return [(begin, begin + length)]
        return [(begin, extent), (0, begin + length - extent)]

    return gather_intervals(
        [local],
        lambda k: [(starts[k], starts[k] + sizes[k])],
        wanted,
        dim,
        group,
    )


# ---------------------------------------------------------------------------- cat
@register_aten_handler(aten.channel_shuffle.default, aten.native_channel_shuffle.default)
def _channel_shuffle(func, args, kwargs):
    """Output channel ``j`` is input channel ``(j % g) c / g + j // g`` (``g`` groups of
    ``c / g``). Channels keep the input's shard sizes: each rank gathers the input channels
    of its output channels; other sharded dims stay as they are. Its backward is a shuffle
    by ``c / g`` groups, through this handler."""
    a = bind(func, args, kwargs)
    x, groups = a.self, a.groups
    if not accepts(x, partial=True) or x.ndim < 3 or groups <= 0 or x.shape[1] % groups:
        return NotImplemented  # torch's error
    if 1 not in x._spec.sharding_by_dim:
        return ShardTensor(func(x._local, groups), x._spec)
    sharding, group, starts = dim_layout(x._spec, 1)
    per_group = x.shape[1] // groups

    def wanted(k: int) -> list[tuple[int, int]]:
        sources = [
            (j % groups) * per_group + j // groups
            for j in range(starts[k], starts[k] + sharding.sizes[k])
        ]
        runs: list[list[int]] = []
        for i in sources:
            if runs and runs[-1][1] == i:
                runs[-1][1] += 1
            else:
                runs.append([i, i + 1])
        return [(lo, hi) for lo, hi in runs]

    local = gather_intervals(
        [x._local],
        lambda k: [(starts[k], starts[k] + sharding.sizes[k])],
        wanted,
        1,
        group,
    )
    return ShardTensor(local.contiguous(), x._spec)


@register_aten_handler(aten.cat.default)
def _cat(func, args, kwargs):
    """``cat`` along a sharded dim. Operands sharded along it keep their shards; one held
    whole along it (a plain tensor, a replicated ShardTensor) goes to the rank holding the
    cells just before it (when none are, the first rank, or the rank holding all of the first
    sharded operand: NOTE [A dim one rank holds is whole on that rank]), so that when the
    sharded operands come in rank order nothing moves (a boundary strip joins the edge rank;
    a row of ones joins the holder in ``prod``'s backward over a held dim). Each rank then
    owns its pieces of every operand, and gathers only the intervals it lacks (none, then)."""
    a = bind(func, args, kwargs)
    tensors = [t for t in a.tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    first = next((t for t in tensors if _sharded_along(t, a.dim)), None)
    if first is None:
        return NotImplemented
    dim = a.dim % first.ndim
    if not accepts(first, sharded=[dim], partial=True) or any(
        t.dtype != first.dtype for t in tensors
    ):
        return NotImplemented
    sharding = first._spec.sharding_by_dim[dim]
    group = axis_group(first._spec.mesh, sharding.axes)
    held, _ = held_axes(sharding, first._spec.mesh_shape)
    pieces, cursor = [], 0 if held is None or held.axes != sharding.axes else held.holder
    for t in tensors:
        whole = [0] * group.size
        whole[cursor] = t.shape[dim]
        piece = _sharded_like(t, first._spec, dim, tuple(whole))
        if piece is None:
            return NotImplemented
        sizes = piece._spec.sharding_by_dim[dim].sizes
        cursor = max((k for k, n in enumerate(sizes) if n), default=cursor)
        pieces.append(piece)
    layouts = [p._spec.sharding_by_dim[dim] for p in pieces]
    bases = [sum(p.shape[dim] for p in pieces[:i]) for i in range(len(pieces))]
    out_sizes = tuple(sum(layout.sizes[k] for layout in layouts) for k in range(group.size))

    def held(k: int) -> list[tuple[int, int]]:
        result = []
        for base, layout in zip(bases, layouts):
            start = base + sum(layout.sizes[:k])
            result.append((start, start + layout.sizes[k]))
        return result

    def wanted(k: int) -> list[tuple[int, int]]:
        start = sum(out_sizes[:k])
        return [(start, start + out_sizes[k])]

    local = gather_intervals([p._local for p in pieces], held, wanted, dim, group)
    return ShardTensor(local, _resized(first._spec, dim, out_sizes))


def _sharded_along(t: torch.Tensor, dim: int) -> bool:
    return (
        isinstance(t, ShardTensor)
        and -t.ndim <= dim < t.ndim
        and (dim % t.ndim in t._spec.sharding_by_dim)
    )


def _sharded_like(
    t: torch.Tensor, spec: ShardTensorSpec, dim: int, whole_sizes: tuple[int, ...]
) -> ShardTensor | None:
    """``t`` with ``spec``'s layout except along ``dim`` (sharded over the same axes), or None
    when that needs more than slicing. A ShardTensor sharded along ``dim`` stays as it is; one
    held whole along it (and laid out like ``spec`` elsewhere), or a plain tensor, is cut to
    ``whole_sizes``."""
    sharding = spec.sharding_by_dim[dim]
    others = [s for s in spec.shardings if s.dim != dim]
    if isinstance(t, ShardTensor):
        own = t._spec.sharding_by_dim.get(dim)
        rest = [s for s in t._spec.shardings if s.dim != dim]
        if own is not None:
            same = own.axes == sharding.axes and t._spec.placements == spec.placements
            return t if same and rest == others else None
        if t._spec.mesh != spec.mesh or t._spec.partial or any(r not in others for r in rest):
            return None  # else the target only slices what t holds whole
        local, source = t._local, t._spec
    else:
        local = t
        source = ShardTensorSpec.build(
            spec.mesh, [Replicate()] * spec.mesh.ndim, t.shape, t.dtype, stride=t.stride()
        )
    target = ShardTensorSpec.build(
        spec.mesh,
        spec.placements,
        t.shape,
        t.dtype,
        {**{s.dim: s.sizes for s in others}, dim: whole_sizes},
        order={s.dim: s.axes for s in spec.shardings},
    )
    return ShardTensor(redistribute_local(local, source, target), target)
