"""Scans along a sharded dim (cumsum, logcumsumexp, cumprod): a local scan combined with the
total of the shards before.

DTensor gathers the whole dim; here each rank scans its shard and combines it with the total
of the preceding shards (their sum, log-sum-exp or product), which costs one gather of a
single slice per rank; along a dim one rank holds whole, the holder's local scan is the scan
and nothing moves. The backwards of cumsum and logcumsumexp (a reversed cumsum, built by
autograd from flip and cumsum; and flips, this scan and pointwise ops) reuse these handlers
and the flip handler. cumprod's backward does not: for a tensor subclass autograd takes its
composite path (``max`` of a zero mask along the dim, then ``scatter``), which gathers the
dim, so ``torch.cumprod`` has a function handler with a backward of its own (NOTE [cumprod's
gradient by shards]).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardsci.tensor._api import ShardTensor, from_local_spec
from shardsci.tensor._binding import bind, replaced
from shardsci.tensor._collectives import AxisGroup, all_gather
from shardsci.tensor._first_order import first_order_only
from shardsci.tensor._held import held_axes
from shardsci.tensor._ops._common import accepts, dim_layout
from shardsci.tensor._registry import register_aten_handler, register_function_handler
from shardsci.tensor._spec import ShardTensorSpec

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
    aten.cumprod.default: _Scan(lambda t: t.prod(0), torch.mul, 1.0),
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
    if _held_whole(x._spec, dim):
        return ShardTensor(local, x._spec.with_dtype(local.dtype))
    _, group, _ = dim_layout(x._spec, dim)
    totals = _shard_totals(local, dim, group, scan.identity)
    before = totals[: group.index]
    if before:
        local = scan.combine(local, scan.total(torch.stack(before)))
    return ShardTensor(local, x._spec.with_dtype(local.dtype))


def _held_whole(spec: ShardTensorSpec, dim: int) -> bool:
    """Whether one rank holds ``dim`` whole along all its axes (NOTE [A dim one rank holds is
    whole on that rank]): the holder's local scan is the scan, no shard comes before it (the
    backward of ``prod`` over such a dim scans it so)."""
    sharding = spec.sharding_by_dim[dim]
    held, _ = held_axes(sharding, spec.mesh_shape)
    return held is not None and held.axes == sharding.axes


def _shard_totals(
    local: torch.Tensor, dim: int, group: AxisGroup, identity: float
) -> list[torch.Tensor]:
    """Every shard's total along ``dim`` (the last slice of its local scan ``local``; the
    scan's identity for an empty shard), in the order of ``group``: one slice from each rank.

    Returns
    -------
    list of Tensor
        ``group.size`` slices shaped as ``local`` with ``dim`` of size 1.
    """
    if local.shape[dim]:
        total = local.narrow(dim, local.shape[dim] - 1, 1)
    else:
        total = local.new_full([1 if d == dim else n for d, n in enumerate(local.shape)], identity)
    return _gathered_slices(total, group)


def _gathered_slices(piece: torch.Tensor, group: AxisGroup) -> list[torch.Tensor]:
    """``piece`` (a slice, the same shape on every rank of ``group``) from every rank."""
    return list(all_gather(piece, group).unbind(0))


def _scan_along_a_sharded_dim(func, args, kwargs) -> tuple[Any, ShardTensor, int] | None:
    """A torch-level scan's bound arguments, its ShardTensor input and the scanned dim, when
    that dim is sharded and nothing else stops the handler (no ``out``); else None."""
    a = bind(func, args, kwargs)
    x = a.input
    if a.out is not None or not isinstance(x, ShardTensor):
        return None
    dim = a.dim % max(x.ndim, 1)
    if not accepts(x, sharded=[dim]):
        return None
    return a, x, dim


# NOTE [cumprod's gradient by shards]
# For shard r of the dim (its local cumprod z, the totals Q_m of the shards m, and the
# incoming gradient g), the gradient of x_k in shard r is
#     P_r * (vjp of the local cumprod at x, with cotangent c)_k,
# where P_r = prod_{m<r} Q_m is the product of the shards before, and c is g with
#     T_r = sum_{q>r} (prod_{r<m<q} Q_m) * U_q,    U_q = sum_{i in q} g_i z_i,
# added to its last slice: the sum over the later shards' outputs, each a product through
# the end of shard r. T_r = U_{r+1} + Q_{r+1} T_{r+1} is a reversed scan over one slice per
# shard, so the backward gathers one slice (U) from each rank, never the dim, and the local
# vjp is torch's own cumprod backward on a plain tensor, right where x has zeros.
class _CumProd(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, dim: int, group: AxisGroup) -> torch.Tensor:  # type: ignore[override]
        scanned = local.cumprod(dim)
        totals = _shard_totals(scanned, dim, group, 1.0)
        before = torch.stack(totals[: group.index]).prod(0) if group.index else None
        ctx.save_for_backward(local, scanned, before, *totals)
        ctx.dim, ctx.group = dim, group
        return scanned if before is None else scanned * before

    @staticmethod
    @first_order_only("cumprod along a split dim")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        local, scanned, before, *totals = ctx.saved_tensors
        dim, group = ctx.dim, ctx.group
        mine = (grad * scanned).sum(dim, keepdim=True)
        later = _gathered_slices(mine, group)
        after = torch.zeros_like(mine)
        for q in range(group.size - 1, group.index, -1):
            after = later[q] + totals[q] * after
        cotangent = grad.clone()
        if local.shape[dim]:
            cotangent.narrow(dim, local.shape[dim] - 1, 1).add_(after)
        with torch.enable_grad():
            leaf = local.detach().requires_grad_()
            (out,) = torch.autograd.grad(leaf.cumprod(dim), leaf, cotangent)
        return (out if before is None else out * before), None, None


@register_function_handler(torch.cumprod, torch.Tensor.cumprod)
def _cumprod(func, args, kwargs):
    call = _scan_along_a_sharded_dim(func, args, kwargs)
    if call is None:
        return NotImplemented
    a, x, dim = call
    if a.dtype is not None:
        x = x.to(a.dtype)
    _, group, _ = dim_layout(x._spec, dim)
    out = _CumProd.apply(x.to_local(), dim, group)
    return from_local_spec(out, x._spec.with_dtype(out.dtype))


# NOTE [cummax and cummin by shards]
# Each rank scans its shard and shifts the indices by its shard's start, so they are global.
# The extremum of the shards before (folded from each one's last value and index, one slice
# of each from every rank) replaces the local result where it wins: where the local value is
# not NaN and does not reach it (torch's rule: a NaN always wins, a tie goes to the later
# index). In the backward, an output cell's gradient goes to the input cell its index names:
# in this shard (a local scatter_add), or, where the prior extremum won, to one cell per
# slice position in an earlier shard: each rank sends the sum of those gradients and the
# index they go to (two slices), and the owner adds what falls in its range.
class _CumulativeExtremum(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, local: torch.Tensor, dim: int, group: AxisGroup, sizes: tuple, name: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start = sum(sizes[: group.index])
        values, indices = getattr(torch, name)(local, dim)
        indices = indices + start
        last_values = _shard_totals(values, dim, group, 0)
        last_indices = _shard_totals(indices, dim, group, -1)
        wins = torch.ge if name == "cummax" else torch.le
        prior_value, prior_index = None, torch.full_like(last_indices[0], -1)
        for q in range(group.index):
            if not sizes[q]:
                continue
            if prior_value is None:
                prior_value, prior_index = last_values[q], last_indices[q]
                continue
            later = _wins(last_values[q], prior_value, wins)
            prior_value = torch.where(later, last_values[q], prior_value)
            prior_index = torch.where(later, last_indices[q], prior_index)
        if prior_value is not None:
            mine = _wins(values, prior_value, wins)
            values = torch.where(mine, values, prior_value)
            indices = torch.where(mine, indices, prior_index)
        ctx.save_for_backward(indices, prior_index)
        ctx.dim, ctx.group, ctx.start, ctx.size = dim, group, start, local.shape[dim]
        ctx.mark_non_differentiable(indices)
        return values, indices

    @staticmethod
    @first_order_only("cummax/cummin along a split dim")
    def backward(ctx: Any, grad: torch.Tensor, _: torch.Tensor) -> tuple:  # type: ignore[override]
        indices, prior_index = ctx.saved_tensors
        dim, start, size = ctx.dim, ctx.start, ctx.size
        here = indices >= start
        out = torch.zeros_like(grad).scatter_add_(
            dim, torch.where(here, indices - start, 0), torch.where(here, grad, 0)
        )
        sent = torch.where(here, 0, grad).sum(dim, keepdim=True)
        for piece, target in zip(
            _gathered_slices(sent, ctx.group),
            _gathered_slices(prior_index, ctx.group),
            strict=True,
        ):
            ours = (target >= start) & (target < start + size)
            if size:
                out.scatter_add_(dim, torch.where(ours, target - start, 0), piece * ours)
        return out, None, None, None, None


def _wins(later: torch.Tensor, earlier: torch.Tensor, wins: Callable) -> torch.Tensor:
    """Where the scan's later value replaces the earlier one: a NaN, or one that wins."""
    return later.isnan() | (~earlier.isnan() & wins(later, earlier))


@register_function_handler(torch.cummax, torch.Tensor.cummax, torch.cummin, torch.Tensor.cummin)
def _cumulative_extremum(func, args, kwargs):
    call = _scan_along_a_sharded_dim(func, args, kwargs)
    if call is None:
        return NotImplemented
    _, x, dim = call
    sharding, group, _ = dim_layout(x._spec, dim)
    values, indices = _CumulativeExtremum.apply(
        x.to_local(), dim, group, sharding.sizes, func.__name__
    )
    result = getattr(torch.return_types, func.__name__)
    return result(
        (
            from_local_spec(values, x._spec),
            from_local_spec(indices, x._spec.with_dtype(torch.int64)),
        )
    )
