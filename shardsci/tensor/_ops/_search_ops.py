"""Search ops with the sharded tensor as the one searched in: ``searchsorted`` and ``isin``.

``searchsorted(sorted_sequence, values)`` sharded along the searched (last) dim: the index of
a value in the whole sequence is the number of elements before it, which is the sum over the
shards of its index in each shard (each shard is sorted). So every rank searches its shard
and the result is a partial sum over the axes sharding that dim: no gather of the sequence,
one reduction of an index per value when the result is read. Sharded along the leading
(batch) dims instead, each rank searches its rows for its slice of the values; values
sharded against a whole 1-D sequence are searched where they lie. Anything else (a sorter,
values and sequence both sharded) is gathered.
``isin(elements, test_elements)`` keeps the layout of ``elements``; sharded test elements are
gathered whole (each element's answer needs all of them).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardsci.tensor._api import ShardTensor, redistribute
from shardsci.tensor._binding import bind, replaced
from shardsci.tensor._ops._common import accepts
from shardsci.tensor._ops._gathered_ops import gathered
from shardsci.tensor._redistribute import target_spec
from shardsci.tensor._registry import register_aten_handler
from shardsci.tensor._spec import ShardTensorSpec

aten = torch.ops.aten


@register_aten_handler(aten.searchsorted.Tensor, aten.searchsorted.Scalar)
def _searchsorted(func, args, kwargs):
    a = bind(func, args, kwargs)
    sequence, values = a.sorted_sequence, a.self
    if a.sorter is None and not _partial(sequence) and not _partial(values):
        if isinstance(sequence, ShardTensor) and not isinstance(values, ShardTensor):
            found = _search_sharded_sequence(func, sequence, values, kwargs)
            if found is not None:
                return found
        elif not isinstance(sequence, ShardTensor) and sequence.ndim == 1:
            out = func(sequence, values._local, **kwargs)
            return ShardTensor(out, values._spec.with_dtype(out.dtype))
    return gathered(func, args, kwargs)


def _search_sharded_sequence(func, sequence: ShardTensor, values, kwargs) -> ShardTensor | None:
    spec = sequence._spec
    along = spec.sharding_by_dim.get(sequence.ndim - 1)
    if along is not None and len(spec.shardings) == 1:
        out = func(sequence._local, values, **kwargs)
        placements = [Partial() if a in along.axes else Replicate() for a in range(spec.mesh.ndim)]
        return ShardTensor(out, ShardTensorSpec.build(spec.mesh, placements, out.shape, out.dtype))
    if along is None and func is aten.searchsorted.Tensor and values.ndim == sequence.ndim:
        values_spec = _like(spec, list(values.shape), values.dtype)
        out = func(sequence._local, values_spec.narrow(values), **kwargs)
        return ShardTensor(out, values_spec.with_dtype(out.dtype))
    return None


def _partial(t: object) -> bool:
    return isinstance(t, ShardTensor) and t._spec.partial


@register_aten_handler(aten.isin.Tensor_Tensor)
def _isin(func, args, kwargs):
    a = bind(func, args, kwargs)
    elements, test = a.elements, a.test_elements
    if not accepts(elements):
        return NotImplemented
    if isinstance(test, ShardTensor):
        whole = [Replicate()] * test._spec.mesh.ndim
        test = redistribute(test, target_spec(test._spec, whole))._local
    args, kwargs = replaced(
        func, args, kwargs, {"elements": elements._local, "test_elements": test}
    )
    out = func(*args, **kwargs)
    return ShardTensor(out, elements._spec.with_dtype(out.dtype))


def _like(spec: ShardTensorSpec, shape: list[int], dtype: torch.dtype) -> ShardTensorSpec:
    """``spec``'s shardings (of leading dims) on a tensor of ``shape``."""
    return ShardTensorSpec.build(
        spec.mesh,
        [Shard(p.dim) if isinstance(p, Shard) else p for p in spec.placements],
        shape,
        dtype,
        {s.dim: s.sizes for s in spec.shardings},
        order={s.dim: s.axes for s in spec.shardings},
    )
