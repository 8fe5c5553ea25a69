"""Triangles and diagonals of sharded matrices, on the shards: ``tril``, ``triu``,
``diagonal`` and its backward.

A cell ``(i, j)`` of the two matrix dims is on diagonal ``j - i``. A shard starting at rows
``r0`` and columns ``c0`` holds global cell ``(i, j)`` at local ``(i - r0, j - c0)``, on local
diagonal ``j - i - (r0 - c0)``: so each rank keeps its triangle with the diagonal shifted by
``r0 - c0``, and takes its part of a diagonal with the offset shifted alike. DTensor
replicates the matrix dims first; here nothing moves:

- ``tril`` and ``triu`` keep the input's layout (their backward is the same op).
- ``diagonal`` gives diagonal cell ``k`` to the rank holding the matrix cell it reads
  (NOTE [An output cell belongs to the shard it depends on]): the new last dim is sharded
  over the axes of both matrix dims, row axes outermost, with sizes counted from the shards'
  row and column ranges; the other dims keep their shardings, renumbered. Both matrix dims'
  shardings are remembered in the output's hints (NOTE [Shard-size hints]), from which
  ``diagonal_backward`` lays the gradient out as the forward's input, also without moving a
  cell.
"""

from __future__ import annotations

import itertools

import torch
from torch.distributed.tensor import Shard

from shardsci.tensor._api import ShardTensor, redistribute
from shardsci.tensor._binding import bind
from shardsci.tensor._ops._common import accepts
from shardsci.tensor._registry import register_aten_handler
from shardsci.tensor._shape_probe import probe_on_meta
from shardsci.tensor._spec import (
    DimSharding,
    ShardTensorSpec,
    coordinate_over_axes,
    index_over_axes,
    merged_hints,
)

aten = torch.ops.aten


# ---------------------------------------------------------------------------- triangles
@register_aten_handler(aten.tril.default, aten.triu.default)
def _triangle(func, args, kwargs):
    a = bind(func, args, kwargs)
    x = a.self
    if not accepts(x, partial=True) or x.ndim < 2:  # below 2-D: torch's error
        return NotImplemented
    offsets = x._spec.local_offsets()
    shift = offsets[x.ndim - 2] - offsets[x.ndim - 1]
    return ShardTensor(func(x._local, a.diagonal + shift), x._spec)


# ---------------------------------------------------------------------------- diagonal
def _diagonal_extent(rows: int, cols: int, offset: int) -> int:
    return max(min(rows + min(offset, 0), cols - max(offset, 0)), 0)


def _sharding_or_whole(spec: ShardTensorSpec, dim: int) -> DimSharding:
    """``dim``'s sharding, or a sharding over no axes (one shard, the whole extent)."""
    return spec.sharding_by_dim.get(dim) or DimSharding(dim, (), (spec.shape[dim],))


def _diagonal_layout(
    rows: DimSharding, cols: DimSharding, offset: int, extent: int, mesh_shape: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The diagonal's axes and sizes: cell ``k`` reads row ``k - min(offset, 0)`` and column
    ``k + max(offset, 0)``, so it belongs to the block of both. Both owners only grow with
    ``k``, so the cells are in order over the axes in increasing order, the order DTensor's
    placements imply; over rows' then columns' axes where a matrix dim is nested otherwise."""
    axes = rows.axes + cols.axes
    if list(rows.axes) == sorted(rows.axes) and list(cols.axes) == sorted(cols.axes):
        axes = tuple(sorted(axes))
    row_starts = list(itertools.accumulate(rows.sizes, initial=0))
    col_starts = list(itertools.accumulate(cols.sizes, initial=0))
    sizes = [0] * len(rows.sizes) * len(cols.sizes)
    for r, c in itertools.product(range(len(rows.sizes)), range(len(cols.sizes))):
        first = max(row_starts[r] + min(offset, 0), col_starts[c] - max(offset, 0), 0)
        stop = min(row_starts[r + 1] + min(offset, 0), col_starts[c + 1] - max(offset, 0), extent)
        coordinate = {
            **coordinate_over_axes(r, rows.axes, mesh_shape),
            **coordinate_over_axes(c, cols.axes, mesh_shape),
        }
        sizes[index_over_axes(coordinate, axes, mesh_shape)] = max(stop - first, 0)
    return axes, tuple(sizes)


@register_aten_handler(aten.diagonal.default)
def _diagonal(func, args, kwargs):
    a = bind(func, args, kwargs)
    x = a.self
    if not accepts(x, partial=True) or x.ndim < 2:
        return NotImplemented
    spec = x._spec
    dim1, dim2 = a.dim1 % x.ndim, a.dim2 % x.ndim
    if dim1 == dim2:
        return NotImplemented  # torch's error
    offsets = spec.local_offsets()
    local = x._local.diagonal(a.offset + offsets[dim1] - offsets[dim2], dim1, dim2)
    return ShardTensor(local, _diagonal_spec(spec, a.offset, dim1, dim2))


def _diagonal_spec(spec: ShardTensorSpec, offset: int, dim1: int, dim2: int) -> ShardTensorSpec:
    rows, cols = _sharding_or_whole(spec, dim1), _sharding_or_whole(spec, dim2)
    extent = _diagonal_extent(spec.shape[dim1], spec.shape[dim2], offset)
    kept = [d for d in range(spec.ndim) if d not in (dim1, dim2)]
    number = {d: kept.index(d) for d in kept}
    last = len(kept)
    axes = rows.axes + cols.axes
    placements = [
        Shard(last) if a in axes else Shard(number[p.dim]) if isinstance(p, Shard) else p
        for a, p in enumerate(spec.placements)
    ]
    sizes = {number[s.dim]: s.sizes for s in spec.shardings if s.dim in number}
    order = {number[s.dim]: s.axes for s in spec.shardings if s.dim in number}
    if axes:
        order[last], sizes[last] = _diagonal_layout(rows, cols, offset, extent, spec.mesh_shape)
    matrix = tuple(s for s in (rows, cols) if s.axes)
    return ShardTensorSpec.build(
        spec.mesh,
        placements,
        [spec.shape[d] for d in kept] + [extent],
        spec.dtype,
        sizes,
        order=order,
        hints=merged_hints(spec.hints, matrix),
    )


@register_aten_handler(aten.diagonal_backward.default)
def _diagonal_backward(func, args, kwargs):
    """The gradient written into zeros laid out as the forward's input: the diagonal's axes
    return to the matrix dims they came from, with the sizes the hints remember."""
    a = bind(func, args, kwargs)
    grad = a.grad_output
    if not accepts(grad, partial=True):
        return NotImplemented
    shape = list(a.input_sizes)
    dim1, dim2 = a.dim1 % len(shape), a.dim2 % len(shape)
    out_spec = _input_spec(grad._spec, shape, a.offset, dim1, dim2)
    if out_spec is None:
        return NotImplemented
    out = grad._local.new_zeros(out_spec.local_shape())
    offsets = out_spec.local_offsets()
    out.diagonal(a.offset + offsets[dim1] - offsets[dim2], dim1, dim2).copy_(grad._local)
    return ShardTensor(out, out_spec)


def _input_spec(
    spec: ShardTensorSpec, shape: list[int], offset: int, dim1: int, dim2: int
) -> ShardTensorSpec | None:
    """The layout of the diagonal's input, read off the gradient's layout and hints; None
    where the hints do not say how the diagonal's axes split between the matrix dims."""
    ndim = len(shape)
    kept = [d for d in range(ndim) if d not in (dim1, dim2)]
    last = len(kept)
    diag = spec.sharding_by_dim.get(last)
    matrix: dict[int, DimSharding] = {}
    if diag is not None:
        split = _matrix_split(spec, diag, shape, offset, dim1, dim2)
        if split is None:
            return None
        matrix = {d: s for d, s in zip((dim1, dim2), split) if s.axes}
    placements = []
    for a, p in enumerate(spec.placements):
        owner = next((d for d, s in matrix.items() if a in s.axes), None)
        if owner is not None:
            placements.append(Shard(owner))
        elif isinstance(p, Shard):
            placements.append(Shard(kept[p.dim]))
        else:
            placements.append(p)
    sizes = {kept[s.dim]: s.sizes for s in spec.shardings if s.dim != last}
    order = {kept[s.dim]: s.axes for s in spec.shardings if s.dim != last}
    for d, s in matrix.items():
        sizes[d], order[d] = s.sizes, s.axes
    return ShardTensorSpec.build(
        spec.mesh, placements, shape, spec.dtype, sizes, order=order, hints=spec.hints
    )


def _matrix_split(
    spec: ShardTensorSpec, diag: DimSharding, shape: list[int], offset: int, dim1: int, dim2: int
) -> tuple[DimSharding, DimSharding] | None:
    """The shardings of the matrix dims that gave the diagonal ``diag``: the newest hints of
    the rows' and columns' extents over a split of ``diag.axes`` whose diagonal is ``diag``."""
    rows_extent, cols_extent = shape[dim1], shape[dim2]
    extent = _diagonal_extent(rows_extent, cols_extent, offset)
    for mask in itertools.product((True, False), repeat=len(diag.axes)):
        row_axes = tuple(a for a, is_row in zip(diag.axes, mask) if is_row)
        col_axes = tuple(a for a, is_row in zip(diag.axes, mask) if not is_row)
        rows = _remembered(spec, row_axes, rows_extent, dim1)
        cols = _remembered(spec, col_axes, cols_extent, dim2)
        if rows is None or cols is None:
            continue
        layout = _diagonal_layout(rows, cols, offset, extent, spec.mesh_shape)
        if layout == (diag.axes, diag.sizes):
            return rows, cols
    return None


def _remembered(
    spec: ShardTensorSpec, axes: tuple[int, ...], extent: int, dim: int
) -> DimSharding | None:
    if not axes:
        return DimSharding(dim, (), (extent,))
    hint = next((h for h in reversed(spec.hints) if h.axes == axes and h.extent == extent), None)
    return None if hint is None else DimSharding(dim, axes, hint.sizes)


@register_aten_handler(aten.diagonal_scatter.default)
def _diagonal_scatter(func, args, kwargs):
    """``x`` with its diagonal replaced by ``src``, laid out as ``x``: ``src`` is taken in the
    layout of ``x``'s diagonal (a plain ``src`` is sliced, a ShardTensor moved there)."""
    a = bind(func, args, kwargs)
    x, src = a.self, a.src
    if not accepts(x, partial=True) or x.ndim < 2 or x._spec.partial:
        return NotImplemented
    spec = x._spec
    dim1, dim2 = a.dim1 % x.ndim, a.dim2 % x.ndim
    if dim1 == dim2:
        return NotImplemented  # torch's error
    diagonal = _diagonal_spec(spec, a.offset, dim1, dim2)
    if tuple(src.shape) != tuple(diagonal.shape):
        return NotImplemented  # torch's error
    if isinstance(src, ShardTensor):
        local_src = redistribute(src, diagonal.with_dtype(src.dtype))._local
    else:
        local_src = diagonal.narrow(src)
    offsets = spec.local_offsets()
    out = x._local.clone()
    out.diagonal(a.offset + offsets[dim1] - offsets[dim2], dim1, dim2).copy_(local_src)
    return ShardTensor(out, spec)


@register_aten_handler(aten.diag_embed.default)
def _diag_embed(func, args, kwargs):
    """Each vector along the last dim written on a diagonal of a new (dim1, dim2) matrix. The
    other dims keep their shardings; a sharded last dim shards the matrix's rows (dim1):
    each rank holds the rows of its own elements, the rows without one going to the first
    (negative offset) or last (positive) shard that holds elements, so that ``diagonal``
    (the backward) gives every element back to where it was."""
    a = bind(func, args, kwargs)
    x = a.self
    if not accepts(x, partial=True) or x.ndim < 1:
        return NotImplemented
    spec = x._spec
    ndim = x.ndim + 1
    dim1, dim2 = a.dim1 % ndim, a.dim2 % ndim
    if dim1 == dim2:
        return NotImplemented  # torch's error
    offset = a.offset
    shape = list(probe_on_meta(func, (x, offset, dim1, dim2)).shape)
    kept = [d for d in range(ndim) if d not in (dim1, dim2)]
    vector = spec.sharding_by_dim.get(x.ndim - 1)
    placements = []
    for p in spec.placements:
        if isinstance(p, Shard):
            p = Shard(dim1 if p.dim == x.ndim - 1 else kept[p.dim])
        placements.append(p)
    sizes = {kept[s.dim]: s.sizes for s in spec.shardings if s.dim != x.ndim - 1}
    order = {kept[s.dim]: s.axes for s in spec.shardings if s.dim != x.ndim - 1}
    if vector is not None:
        sizes[dim1], order[dim1] = _embedded_rows(vector.sizes, offset), vector.axes
    out_spec = ShardTensorSpec.build(
        spec.mesh, placements, shape, x.dtype, sizes, order=order, hints=spec.hints
    )
    out = x._local.new_zeros(out_spec.local_shape())
    offsets = out_spec.local_offsets()
    out.diagonal(offset + offsets[dim1] - offsets[dim2], dim1, dim2).copy_(x._local)
    return ShardTensor(out, out_spec)


def _embedded_rows(sizes: tuple[int, ...], offset: int) -> tuple[int, ...]:
    """Rows per shard of an embedding of elements split as ``sizes``: element ``k`` is on row
    ``k - min(offset, 0)``; the ``|offset|`` rows without one join the nearest holder."""
    rows = list(sizes)
    holders = [k for k, n in enumerate(sizes) if n]
    if holders:
        rows[holders[0] if offset < 0 else holders[-1]] += abs(offset)
    else:
        rows[0 if offset < 0 else -1] += abs(offset)
    return tuple(rows)
