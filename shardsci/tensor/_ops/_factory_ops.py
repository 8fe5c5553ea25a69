"""New tensors made from a sharded one (``x.new_zeros(shape)`` and its kin), laid out like it.

DTensor keeps the source's layout only when the shape is the same, and otherwise makes every
rank hold the whole new tensor. Backward formulas make such tensors of the input's shape from
the gradient of a smaller output (``x[idx]``'s and ``gather``'s ``grad.new_zeros(x.shape)``,
then a scatter into it): every rank would allocate the whole field it did not ask for.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate

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
    """A new tensor laid out as ``_new_layout`` says (NOTE [New tensors of a backward take the
    forward's layout]). The values do not depend on the layout, so no byte moves, and no rank
    holds more of a sharded dim than its shard."""
    a = bind(func, args, kwargs)
    x, size = a.self, tuple(a.size)
    if not accepts(x):
        return NotImplemented
    out_spec = _new_layout(x._spec, size)
    if out_spec is None:
        return NotImplemented
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


# NOTE [New tensors of a backward take the forward's layout]
# A backward formula makes zeros of the input's shape from the gradient of its output and
# scatters into them (``x[idx]``'s ``grad.new_zeros(x.shape)``, ``gather``'s). The gradient's
# layout is the output's, which may have dropped how the input's dim was split: a read through
# an index split over other mesh axes leaves the output replicated over the read dim's axes,
# and one through an index of several dims has more dims than the input. The read's output
# remembers the input's shardings (NOTE [Shard-size hints]), so a new tensor takes, for a dim
# whose extent differs from the source's (every dim, when the dims differ in number), the
# newest hint for that dim at the new extent whose axes the source leaves replicated: the
# forward's layout, into which the scatter then adds where each entry lands. The source's
# shardings carry over: with as many dims, at the sizes the newest hint remembers for that
# dim, axes and extent (``max``'s gradient, kept by the rank holding the reduced dim, makes
# zeros of the input's layout), else cut at the new extent or with the extra cells on the last
# rank (the layout from which a ``gather`` with a smaller index reads its output's layout); with another number of dims, to the one dim of the same extent aligned with it
# from the left or from the right (a dim before or after the index's dims). With another
# number of dims and nothing split, it declines (DTensor's default path replicates it).
def _new_layout(spec: ShardTensorSpec, size: tuple[int, ...]) -> ShardTensorSpec | None:
    """The layout of a new tensor of shape ``size`` made from one laid out as ``spec`` (NOTE
    [New tensors of a backward take the forward's layout]); None where not stated."""
    same, shift = len(size) == spec.ndim, spec.ndim - len(size)
    shardings: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for s in spec.shardings:
        if same:
            shardings[s.dim] = (s.axes, _sizes_at(spec, s, size[s.dim]))
            continue
        aligned = {d for d in (s.dim, s.dim - shift) if 0 <= d < len(size) and size[d] == s.extent}
        if len(aligned) == 1:  # a leading or trailing dim, of one extent
            shardings[aligned.pop()] = (s.axes, s.sizes)
    replicated = {a for a, p in enumerate(spec.placements) if isinstance(p, Replicate)}
    for d, n in enumerate(size):
        if (same and n == spec.shape[d]) or (not same and d in shardings):
            continue
        for hint in reversed(spec.hints):
            used = {a for e, (axes, _) in shardings.items() if e != d for a in axes}
            if hint.dim == d and hint.extent == n and set(hint.axes) <= replicated - used:
                shardings[d] = (hint.axes, hint.sizes)
                break
    if not same and not shardings:
        return None
    return ShardTensorSpec.from_shardings(
        spec.mesh,
        [DimSharding(d, axes, sizes) for d, (axes, sizes) in shardings.items()],
        size,
        spec.dtype,
        hints=spec.hints,
    )
