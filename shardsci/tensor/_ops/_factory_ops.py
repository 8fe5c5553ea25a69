"""New tensors made from a sharded one (``x.new_zeros(shape)`` and its kin), laid out like it.

DTensor keeps the source's layout only when the shape is the same, and otherwise makes every
rank hold the whole new tensor. Backward formulas make such tensors of the input's shape from
the gradient of a smaller output (``x[idx]``'s and ``gather``'s ``grad.new_zeros(x.shape)``,
then a scatter into it): every rank would allocate the whole field it did not ask for.
"""

from __future__ import annotations

import torch

from shardsci.tensor._api import ShardTensor
from shardsci.tensor._binding import bind, replaced
from shardsci.tensor._ops._common import accepts, sizes_at_extent
from shardsci.tensor._registry import register_aten_handler
from shardsci.tensor._spec import DimSharding, ShardTensorSpec

aten = torch.ops.aten


@register_aten_handler(
    aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default
)
def _new_like(func, args, kwargs):
    """A new tensor with as many dims as the source is sharded like it: along a sharded dim of
    the same extent with the same sizes, along one of another extent with the sizes cut there
    or with the extra cells on the last rank (the layout from which a ``gather`` with a
    smaller index reads its output's layout), unless the source remembers sizes for that
    extent (NOTE [Shard-size hints]: ``max``'s gradient, kept by the rank holding the
    reduced dim, makes zeros of the input's layout). The values do not depend on the layout, so no
    byte moves, and no rank holds more of a sharded dim than its shard."""
    a = bind(func, args, kwargs)
    x, size = a.self, tuple(a.size)
    if not accepts(x) or len(size) != x.ndim:
        return NotImplemented
    spec = x._spec
    sizes = {s.dim: _sizes_at(spec, s, size[s.dim]) for s in spec.shardings}
    out_spec = ShardTensorSpec.build(
        spec.mesh,
        spec.placements,
        size,
        spec.dtype,
        sizes,
        order={s.dim: s.axes for s in spec.shardings},
    )
    args, kwargs = replaced(
        func, args, kwargs, {"self": x._local, "size": list(out_spec.local_shape())}
    )
    local = func(*args, **kwargs)
    return ShardTensor(local, out_spec.with_dtype(local.dtype))


def _sizes_at(spec: ShardTensorSpec, sharding: DimSharding, extent: int) -> tuple[int, ...]:
    """The sizes of ``sharding``'s dim at ``extent``: its own at its extent, else the newest
    hint's for that dim, axes and extent, else cut or grown on the last rank."""
    if extent != sharding.extent:
        for hint in reversed(spec.hints):
            if (hint.dim, hint.axes, hint.extent) == (sharding.dim, sharding.axes, extent):
                return hint.sizes
    return sizes_at_extent(sharding.sizes, extent)
