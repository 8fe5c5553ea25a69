"""Scans along a sharded dim (cumsum, logcumsumexp): a local scan combined with the total of
the shards before.

DTensor gathers the whole dim; here each rank scans its shard and combines it with the total
of the preceding shards (their sum or log-sum-exp), which costs one gather of a single slice
per rank. Their backwards (a reversed cumsum, built by autograd from flip and cumsum; and
logcumsumexp's, from flips, this scan and pointwise ops) reuse these handlers and the flip
handler. Not cumprod: its forward would fit here, but autograd's backward for a tensor
subclass takes its composite path (``max`` of a zero mask along the dim, then ``scatter``),
which gathers the dim anyway, so cumprod keeps DTensor's gather (``tests/op_db_unsupported.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardsci.tensor._api import ShardTensor
from shardsci.tensor._binding import bind, replaced
from shardsci.tensor._collectives import exchange
from shardsci.tensor._ops._common import accepts, dim_layout
from shardsci.tensor._registry import register_aten_handler

aten = torch.ops.aten


@dataclass(frozen=True)
class _Scan:
    """How the shards of one scan combine.

    Attributes
    ----------
    total : callable
        The scan's total over stacked shard totals ``(n, ...)``, along dim 0: ``(...)``.
    combine : callable
        ``combine(local scan, total of the shards before)``, broadcasting the total.
    identity : float
        The total of an empty shard.
    linear : bool
        Whether the scan is linear in its input (it may then take a pending sum).
    """

    total: Callable[[torch.Tensor], torch.Tensor]
    combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    identity: float
    linear: bool = False


_SCANS = {
    aten.cumsum.default: _Scan(lambda t: t.sum(0), torch.add, 0.0, linear=True),
    aten.logcumsumexp.default: _Scan(lambda t: t.logsumexp(0), torch.logaddexp, -math.inf),
}


@register_aten_handler(*_SCANS)
def _scan(func, args, kwargs):
    scan = _SCANS[func]
    a = bind(func, args, kwargs)
    x = a.self
    dim = a.dim % max(x.ndim, 1)
    if not accepts(x, sharded=[dim], partial=scan.linear):
        return NotImplemented
    local_args, local_kwargs = replaced(func, args, kwargs, {"self": x._local})
    local = func(*local_args, **local_kwargs)
    _, group, _ = dim_layout(x._spec, dim)
    if local.shape[dim]:
        total = local.narrow(dim, local.shape[dim] - 1, 1)
    else:
        total = local.new_full(
            [1 if d == dim else n for d, n in enumerate(local.shape)], scan.identity
        )
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
        local = scan.combine(local, scan.total(torch.stack(before)))
    return ShardTensor(local, x._spec.with_dtype(local.dtype))
