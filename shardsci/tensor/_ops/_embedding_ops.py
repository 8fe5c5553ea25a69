"""``embedding`` with the indices sharded and the table whole on every rank.

Each rank looks up its own indices: the output is sharded like the indices (plus the
embedding dim, whole), with no communication. The table's gradient is each rank's scatter of
its output gradient, a partial sum over the axes sharding the indices, reduced once where
the gradient is used (NOTE [Autograd interaction between torch.Tensor and ShardTensor]).
Frequency-scaled gradients need counts over all indices: gathered (``_gathered_ops``).

NOTE [A split table is looked up where it lies]
A table split along its embedding dim (columns) gives each rank its columns of every lookup:
the output's last dim is split like the table's. A table split along the vocabulary (rows,
as Megatron's vocabulary-parallel embedding) gives each index's row to the one rank holding
it: each rank looks up the indices in its rows and writes 0 for the others, so the output is a
pending sum (Partial) over the vocabulary axes, which rank holds a row being data. Indices
sharded over other axes keep their split. No row moves; but where a rank looks up at least as
many indices as the table has rows, its part of the pending lookup holds as much as the table
gathered along the vocabulary, and the gather guard counts it as a pending sum held whole
(NOTE [Gathers an op was not asked to make]). The table's gradient is each rank's scatter
into its own rows and columns (a partial sum over the indices' axes). Handled by
``F.embedding`` (``_split_table``), above autograd, where the table's layout is known to the
backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate

from shardsci.tensor._api import ShardTensor, from_local_spec
from shardsci.tensor._binding import bind, replaced
from shardsci.tensor._ops._common import accepts, sharding_axes
from shardsci.tensor._ops._gathered_ops import gathered
from shardsci.tensor._registry import register_aten_handler, register_function_handler
from shardsci.tensor._spec import DimSharding, ShardTensorSpec

aten = torch.ops.aten


def _whole_table(weight: torch.Tensor) -> torch.Tensor | None:
    if not isinstance(weight, ShardTensor):
        return weight
    return None if weight._spec.shardings or weight._spec.partial else weight._local


def _embedding_parameters(
    input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
    sparse=False,
):  # fmt: skip
    """``F.embedding``'s parameters."""


@register_function_handler(F.embedding)
def _split_table(func, args, kwargs):
    """NOTE [A split table is looked up where it lies]."""
    a = bind(func, args, kwargs, signature=_embedding_parameters)
    weight, indices = a.weight, a.input
    if not isinstance(weight, ShardTensor) or not weight._spec.shardings:
        return NotImplemented
    index_axes = sharding_axes(indices._spec) if isinstance(indices, ShardTensor) else set()
    if (
        a.max_norm is not None  # renormalises the table in place
        or a.scale_grad_by_freq
        or a.sparse
        or index_axes & sharding_axes(weight._spec)
        or not accepts(weight, indices)
    ):
        return NotImplemented
    spec = weight._spec
    grad_placements = [Partial() if i in index_axes else p for i, p in enumerate(spec.placements)]
    table = weight.to_local(grad_placements=grad_placements)
    local = indices._local if isinstance(indices, ShardTensor) else indices
    first, rows = spec.local_offsets()[0], spec.local_shape()[0]
    mine = (local >= first) & (local < first + rows)
    if rows == 0:  # no row to look up; kept connected to the table for its gradient
        out = table.sum() * 0 + table.new_zeros((*local.shape, table.shape[1]))
    else:
        padding = a.padding_idx
        if padding is not None:
            padding = padding % spec.shape[0] - first
        out = torch.embedding(
            table,
            torch.where(mine, local - first, 0),
            padding if padding is not None and 0 <= padding < rows else -1,
        )
        out = torch.where(mine.unsqueeze(-1), out, 0)
    return from_local_spec(out, _looked_up(spec, indices, out.dtype))


def _looked_up(table: ShardTensorSpec, indices: torch.Tensor, dtype: torch.dtype):
    """The lookup's layout: the indices' split, the table's columns' on the last dim, a
    pending sum over the axes splitting its rows."""
    shape = [*indices.shape, table.shape[1]]
    shardings = list(indices._spec.shardings) if isinstance(indices, ShardTensor) else []
    shardings += [
        DimSharding(len(shape) - 1, s.axes, s.sizes) for s in table.shardings if s.dim == 1
    ]
    rows = [axis for s in table.shardings if s.dim == 0 for axis in s.axes]
    return ShardTensorSpec.from_shardings(table.mesh, shardings, shape, dtype, pending=rows)


@register_aten_handler(aten.embedding.default)
def _embedding(func, args, kwargs):
    a = bind(func, args, kwargs)
    weight, indices = a.weight, a.indices
    table = _whole_table(weight)
    if table is None:
        return gathered(func, args, kwargs)
    if not accepts(indices):
        return NotImplemented
    args, kwargs = replaced(func, args, kwargs, {"weight": table, "indices": indices._local})
    out = func(*args, **kwargs)
    spec = indices._spec
    return ShardTensor(out, _extended(spec, [*spec.shape, weight.shape[-1]], out.dtype))


@register_aten_handler(aten.embedding_dense_backward.default)
def _embedding_backward(func, args, kwargs):
    a = bind(func, args, kwargs)
    grad, indices = a.grad_output, a.indices
    if a.scale_grad_by_freq:
        return gathered(func, args, kwargs)
    if not accepts(indices):
        return NotImplemented
    spec = indices._spec
    local_grad = grad._local if isinstance(grad, ShardTensor) else _narrowed(spec, grad)
    args, kwargs = replaced(
        func, args, kwargs, {"grad_output": local_grad, "indices": indices._local}
    )
    out = func(*args, **kwargs)
    axes = sharding_axes(spec)
    placements = [Partial() if a in axes else Replicate() for a in range(spec.mesh.ndim)]
    return ShardTensor(out, ShardTensorSpec.build(spec.mesh, placements, out.shape, out.dtype))


def _narrowed(spec: ShardTensorSpec, grad: torch.Tensor) -> torch.Tensor:
    """This rank's block of a whole gradient of shape ``(*indices, dim)``."""
    return _extended(spec, list(grad.shape), grad.dtype).narrow(grad)


def _extended(spec: ShardTensorSpec, shape: list[int], dtype: torch.dtype) -> ShardTensorSpec:
    """The indices' layout on their lookup, one trailing dim more."""
    return ShardTensorSpec.build(
        spec.mesh,
        spec.placements,
        shape,
        dtype,
        {s.dim: s.sizes for s in spec.shardings},
        order={s.dim: s.axes for s in spec.shardings},
        hints=spec.hints,
    )
