"""cumsum along a sharded dim: a local scan plus the totals of the shards before.

DTensor gathers the whole dim; here each rank scans its shard and adds the sum of the
preceding shards' totals, which costs one gather of a single slice per rank. cumsum's
backward (a reversed cumsum, built by autograd from flip and cumsum) reuses this and the
flip handler.
"""

from __future__ import annotations

import torch

from shardsci.tensor._api import ShardTensor
from shardsci.tensor._binding import bind
from shardsci.tensor._collectives import exchange
from shardsci.tensor._ops._common import accepts, dim_layout
from shardsci.tensor._registry import register_aten_handler

aten = torch.ops.aten


@register_aten_handler(aten.cumsum.default)
def _cumsum(func, args, kwargs):
    a = bind(func, args, kwargs)
    x = a.self
    dim = a.dim % max(x.ndim, 1)
    if not accepts(x, sharded=[dim], partial=True):
        return NotImplemented
    local = torch.cumsum(x._local, dim, dtype=a.dtype)
    _, group, _ = dim_layout(x._spec, dim)
    if local.shape[dim]:
        total = local.narrow(dim, local.shape[dim] - 1, 1)
    else:
        total = local.new_zeros([1 if d == dim else n for d, n in enumerate(local.shape)])
    totals = exchange(
        group,
        [total] * group.size,
        lambda src, dst: total.shape,
        dtype=total.dtype,
        device=total.device,
        kind="all_gather",
    )
    before = totals[: group.index]
    if before:
        local = local + torch.stack(before).sum(0)
    return ShardTensor(local, x._spec.with_dtype(local.dtype))
