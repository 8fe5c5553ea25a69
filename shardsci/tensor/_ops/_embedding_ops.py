"""``embedding`` with the indices sharded and the table whole on every rank.

Each rank looks up its own indices: the output is sharded like the indices (plus the
embedding dim, whole), with no communication. The table's gradient is each rank's scatter of
its output gradient, a partial sum over the axes sharding the indices, reduced once where
the gradient is used (NOTE [Autograd interaction between torch.Tensor and ShardTensor]).
Frequency-scaled gradients need counts over all indices, and a table sharded by rows is
looked up in whole: both are gathered (``_gathered_ops``).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate

from shardsci.tensor._api import ShardTensor
from shardsci.tensor._binding import bind, replaced
from shardsci.tensor._ops._common import accepts, sharding_axes
from shardsci.tensor._ops._gathered_ops import gathered
from shardsci.tensor._registry import register_aten_handler
from shardsci.tensor._spec import ShardTensorSpec

aten = torch.ops.aten


def _whole_table(weight: torch.Tensor) -> torch.Tensor | None:
    if not isinstance(weight, ShardTensor):
        return weight
    return None if weight._spec.shardings or weight._spec.partial else weight._local


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
