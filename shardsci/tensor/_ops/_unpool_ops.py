"""Max unpooling of spatially sharded tensors: each value written where its index lands.

``F.max_unpoolNd(x, indices, kernel_size, stride, padding, output_size)`` writes each value of
``x`` at the position ``indices`` gives it, flat over the output's last ``N`` dims: the
inverse of max pooling. Sharded batch and channel dims keep their sizes (each rank unpools
its planes). Along a sharded spatial dim the output keeps the placements, with
the sizes of a transposed window (NOTE [Which rank owns an output of a windowed op] in
``_windows``): output cell ``i`` goes to the owner of the pooled cell whose window is the last
to start at or before it, ``(i + p) // s``, so that with windows that do not overlap
(``kernel <= stride``) every cell is on the rank holding the value it can receive; a layout
remembered for the output's extent (the one before the pooling) is used instead.

Each rank writes its values into the block of output cells its pooled cells' windows cover,
and the adjoint of the halo exchange adds the cells of a neighbour's shard to that
neighbour: only cells of windows that cross a shard boundary move. A cell that two ranks
write (an index shared by overlapping windows on both sides of a boundary, as max pooling
gives when a window's maximum lies in the overlap) is the mean of what they wrote, the value
itself when they wrote the same one, as max pooling's indices make them. The gradient of a
value is the output gradient at its cell: the halo exchange of the output gradient, then a
local gather.

torch allows any index of the plane; one outside the block of its shard's windows cannot be
written this way. Every rank finds out (one all-reduce of a flag over the mesh) and the op
takes the default path, whose gather the gather guard governs (NOTE [Gathers an op was not
asked to make] in ``shardsci/tensor/_gather_guard.py``); so does an index tensor laid out
otherwise than ``x``.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
import torch.nn.functional as F

from shardsci.tensor._api import ShardTensor, from_local_spec
from shardsci.tensor._binding import bind
from shardsci.tensor._collectives import all_reduce, axis_group
from shardsci.tensor._first_order import first_order_only
from shardsci.tensor._halo import Extension, added_to_owners, extend, extension
from shardsci.tensor._ops._common import accepts
from shardsci.tensor._ops._pool_ops import _per_dim, _ravel, _stride, _unravel
from shardsci.tensor._ops._windows import TransposedWindow, Window, output_spec, owned_sizes
from shardsci.tensor._registry import register_function_handler
from shardsci.tensor._shape_probe import probe_on_meta
from shardsci.tensor._spec import ShardTensorSpec, mesh_coordinate

_UNPOOL = {F.max_unpool1d: 1, F.max_unpool2d: 2, F.max_unpool3d: 3}


@register_function_handler(*_UNPOOL)
def _max_unpool(func, args, kwargs):
    a = bind(func, args, kwargs)
    x, n = a.input, _UNPOOL[func]
    if not accepts(x, sharded=range(-x.ndim, 0)):
        return NotImplemented
    indices = _local_indices(a.indices, x._spec)
    if indices is None:
        return NotImplemented
    out_shape = tuple(probe_on_meta(func, args, kwargs).shape)
    kernel = _per_dim(a.kernel_size, n)
    stride = _stride(a.stride, kernel)
    padding = _per_dim(a.padding, n)
    spec, first = x._spec, x.ndim - n
    out_sizes, requests, block = {}, [], []
    for i, dim in enumerate(range(first, x.ndim)):
        sharding = spec.sharding_by_dim.get(dim)
        if sharding is None:
            block.append((0, out_shape[dim]))
            continue
        upsampling = TransposedWindow(1, stride[i], padding=padding[i])
        out_sizes[dim] = owned_sizes(upsampling, sharding, out_shape[dim], spec.hints)
        ranges = _window_blocks(Window(kernel[i], stride[i], 1, padding[i], padding[i]),
                                sharding.sizes, out_shape[dim])  # fmt: skip
        requests.append((dim, ranges, "zeros"))
        block.append(ranges[sharding.flat_index(spec.mesh_shape, mesh_coordinate(spec.mesh))])
    out_spec = output_spec(spec, out_shape, out_sizes, x.dtype)
    flat, inside = _block_positions(indices, out_shape[first:], block)
    outside = torch.tensor([int(not inside)], dtype=torch.int64, device=indices.device)
    if all_reduce(outside, axis_group(spec.mesh, range(spec.mesh.ndim)), "max").item():
        return NotImplemented
    ext = extension(out_spec, tuple(requests))
    overlapping = any(_overlap(ranges) for _, ranges, _ in requests)
    local = _Unpool.apply(x.to_local(), flat, n, ext, out_spec.local_shape(), overlapping)
    return from_local_spec(local, out_spec)


def _local_indices(indices: object, spec: ShardTensorSpec) -> torch.Tensor | None:
    """This rank's block of ``indices``: a ShardTensor laid out as the values, or one whole
    on every rank (replicated or a plain tensor) of their global shape; else None."""
    if isinstance(indices, ShardTensor):
        if indices._spec.same_layout(spec):
            return indices.to_local()
        if indices._spec.shardings or indices._spec.partial:
            return None
        indices = indices.to_local()
    if not isinstance(indices, torch.Tensor) or tuple(indices.shape) != tuple(spec.shape):
        return None
    return spec.narrow(indices)


def _window_blocks(window: Window, sizes: tuple[int, ...], extent: int) -> tuple:
    """Per shard of the pooled dim: the output cells (global, within the domain) its pooled
    cells' windows cover."""
    ranges, start = [], 0
    for size in sizes:
        lo, hi = window.input_range(start, start + size, extent)
        lo, hi = max(lo, 0), min(hi, extent)
        ranges.append((lo, hi) if hi > lo else (0, 0))
        start += size
    return tuple(ranges)


def _overlap(ranges: tuple[tuple[int, int], ...]) -> bool:
    """Whether two shards' blocks share a cell."""
    spans = sorted(r for r in ranges if r[1] > r[0])
    return any(a[1] > b[0] for a, b in itertools.pairwise(spans))


def _block_positions(
    indices: torch.Tensor, extents: tuple[int, ...], block: list[tuple[int, int]]
) -> tuple[torch.Tensor, bool]:
    """The positions of ``indices`` (flat over the output's spatial ``extents``) flat over
    this rank's ``block`` (per spatial dim, the global range it spans), and whether every
    index lies in the block."""
    total = math.prod(extents)
    inside = bool(((indices >= 0) & (indices < total)).all())
    coordinates = _unravel(indices.clamp(0, max(total - 1, 0)), torch.Size(extents))
    local = [c - lo for c, (lo, _) in zip(coordinates, block)]
    for c, (lo, hi) in zip(local, block):
        inside = inside and bool(((c >= 0) & (c < hi - lo)).all())
    lengths = torch.Size(hi - lo for lo, hi in block)
    return _ravel([c.clamp(min=0) for c in local], lengths), inside


class _Unpool(torch.autograd.Function):
    """This rank's output shard: its values written at their positions, flat over the last
    ``n`` dims of its block, the block's cells added to their owners (the mean where
    ``overlapping`` blocks both wrote a cell). Backward: the output gradient gathered into
    the block, read at the positions."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        values: torch.Tensor,
        positions: torch.Tensor,
        n: int,
        ext: Extension,
        shape: torch.Size,
        overlapping: bool,
    ) -> torch.Tensor:
        ctx.n, ctx.ext = n, ext
        ctx.save_for_backward(positions)
        block = list(shape)
        for dim, _, length in ext.wanted:
            block[dim] = length
        written = added_to_owners(_written(values, positions, n, block), ext)
        if overlapping:
            counts = _written(torch.ones_like(values), positions, n, block)
            counts = added_to_owners(counts, ext).clamp(min=1)
            written = written.div(
                counts, rounding_mode=None if values.is_floating_point() else "trunc"
            )
        return written

    @staticmethod
    @first_order_only("max_unpool")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        (positions,) = ctx.saved_tensors
        cells = extend(grad.contiguous(), ctx.ext)
        read = cells.flatten(-ctx.n).gather(-1, positions.flatten(-ctx.n))
        return read.view(positions.shape), None, None, None, None, None


def _written(values: torch.Tensor, positions: torch.Tensor, n: int, block: list[int]):
    """A block of zeros with ``values`` written at ``positions``."""
    cells = values.new_zeros(block)
    cells.flatten(-n).scatter_(-1, positions.flatten(-n), values.flatten(-n))
    return cells
