"""Losses on shards of any size: a mean is a sum over the true element count.

DTensor's rules average local means (``Partial("avg")``), wrong for unequal shards, and have
no rule at all for huber, smooth-L1, soft-margin and binary cross-entropy losses. Here the
elementwise terms are computed on the shards (``_elementwise_ops``) and reduced by the sum
and mean handlers; the backward kernels run on the shards with ``reduction="sum"`` (the
incoming gradient is one number) and a mean is divided by the global element count.
``l1_loss`` and friends decompose above dispatch into ops that are already right (``abs``,
``mean``). ``nll_loss`` (and ``cross_entropy``, its log-softmax then ``nll_loss``) picks on
the shards (NOTE [A loss over split classes is a pending sum])."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Partial, Placement, Replicate

from shardsci.tensor._api import ShardTensor, redistribute
from shardsci.tensor._binding import bind, replaced
from shardsci.tensor._collectives import all_reduce, axis_group
from shardsci.tensor._dispatch import local_of
from shardsci.tensor._ops._common import accepts, reduced_now, sharding_axes
from shardsci.tensor._ops._elementwise_ops import elementwise
from shardsci.tensor._ops._reduction_ops import reduced_spec
from shardsci.tensor._registry import register_aten_handler
from shardsci.tensor._spec import ShardTensorSpec, replicated_spec

aten = torch.ops.aten

_NONE, _MEAN, _SUM = 0, 1, 2


@register_aten_handler(aten.mse_loss.default)
def _mse_loss(func, args, kwargs):
    a = bind(func, args, kwargs)
    difference = aten.sub.Tensor(a.self, a.target)
    squares = aten.mul.Tensor(difference, difference)
    if a.reduction == _NONE:
        return squares
    total = aten.sum.default(squares)
    return total if a.reduction == _SUM else aten.div.Scalar(total, _numel(a.self, a.target))


@register_aten_handler(aten.mse_loss_backward.default)
def _mse_loss_backward(func, args, kwargs):
    a = bind(func, args, kwargs)
    scale = 2.0 if a.reduction != _MEAN else 2.0 / _numel(a.self, a.target)
    difference = aten.sub.Tensor(a.self, a.target)
    return aten.mul.Tensor(aten.mul.Scalar(difference, scale), a.grad_output)


def _numel(x: torch.Tensor, target: torch.Tensor) -> int:
    return math.prod(torch.broadcast_shapes(x.shape, target.shape))


_ELEMENTWISE_LOSSES = (
    aten.huber_loss.default,
    aten.smooth_l1_loss.default,
    aten.soft_margin_loss.default,
    aten.binary_cross_entropy.default,
    aten.binary_cross_entropy_with_logits.default,
)
_ELEMENTWISE_LOSS_BACKWARDS = (
    aten.huber_loss_backward.default,
    aten.smooth_l1_loss_backward.default,
    aten.soft_margin_loss_backward.default,
    aten.binary_cross_entropy_backward.default,
)


@register_aten_handler(*_ELEMENTWISE_LOSSES)
def _elementwise_loss(func, args, kwargs):
    reduction = bind(func, args, kwargs).reduction
    terms = elementwise(func, *replaced(func, args, kwargs, {"reduction": _NONE}))
    if terms is NotImplemented or reduction == _NONE:
        return terms
    total = aten.sum.default(terms)
    return total if reduction == _SUM else aten.div.Scalar(total, terms.numel())


@register_aten_handler(*_ELEMENTWISE_LOSS_BACKWARDS)
def _elementwise_loss_backward(func, args, kwargs):
    reduction = bind(func, args, kwargs).reduction
    summed = _NONE if reduction == _NONE else _SUM
    grad = elementwise(func, *replaced(func, args, kwargs, {"reduction": summed}))
    if grad is NotImplemented or reduction != _MEAN:
        return grad
    return aten.div.Scalar(grad, grad.numel())


# NOTE [A loss over split classes is a pending sum]
# ``nll_loss`` picks one log-probability per target, at the target's class. Where the class dim
# is split, one rank of the class axes holds that cell and the others hold none: each rank
# computes the terms of the targets whose class it holds and 0 for the rest, so the per-target
# output (``reduction="none"``) is a pending sum (Partial) over the class axes. It cannot be
# sharded instead: which rank holds a term depends on the targets' values, which no layout may
# depend on. The targets keep the input's split of its other dims (batch, spatial). A sum or
# mean over the targets is the local sum, Partial over every sharding axis: reading the loss
# is one all-reduce of a scalar. The mean's denominator, the total weight of the targets not
# ignored, is one all-reduce of a scalar over the axes splitting the targets (the ranks of the
# class axes see the same targets). Backward: each rank writes the gradient of its own classes'
# picked cells; nothing moves. Nothing is gathered, for any reduction, weights or
# ``ignore_index``, with the class dim split or not.
_NLL_LOSSES = (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
_NLL_LOSS_BACKWARDS = (aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)


@dataclass(frozen=True)
class _Picked:
    """This rank's targets and where they pick (NOTE [A loss over split classes is a pending
    sum]).

    Attributes
    ----------
    x : ShardTensor
        The log-probabilities ``(N, C, *d)`` or ``(C,)``, no pending sum.
    class_dim : int
        C's dim.
    mine : Tensor
        Per local target ``(N_r, *d_r)``: not ignored and its class on this rank.
    index : Tensor
        The target's class within this rank's classes (0 where not ``mine``), unsqueezed at
        ``class_dim``.
    weights : Tensor
        The target's class weight (0 where ignored).
    """

    x: ShardTensor
    class_dim: int
    mine: torch.Tensor
    index: torch.Tensor
    weights: torch.Tensor

    @classmethod
    def of(cls, x: ShardTensor, target, weight, ignore_index: int) -> _Picked:
        x = reduced_now(x)
        spec, class_dim = x._spec, 0 if x.ndim == 1 else 1
        targets = _per_target(spec, class_dim, target.dtype, Replicate())
        if isinstance(target, ShardTensor):
            target = redistribute(target, targets)._local
        else:
            target = targets.narrow(target)
        first, count = spec.local_offsets()[class_dim], spec.local_shape()[class_dim]
        valid = target != ignore_index
        mine = valid & (target >= first) & (target < first + count)
        index = torch.where(mine, target - first, 0).unsqueeze(class_dim)
        if weight is None:
            weights = valid.to(x.dtype)
        else:
            weights = torch.where(valid, local_of(weight)[torch.where(valid, target, 0)], 0)
        return cls(x, class_dim, mine, index, weights.to(x.dtype))

    def terms(self) -> torch.Tensor:
        """``-w[t] x[t]`` of the targets whose class is on this rank, else 0."""
        local = self.x._local
        if local.shape[self.class_dim] == 0:
            return torch.zeros_like(self.weights)
        picked = local.gather(self.class_dim, self.index).squeeze(self.class_dim)
        return torch.where(self.mine, -picked * self.weights, 0)

    def total_weight(self) -> torch.Tensor:
        """The weight of every target not ignored, over all ranks (replicated)."""
        total = self.weights.sum()
        axes = [a for s in self.x._spec.shardings if s.dim != self.class_dim for a in s.axes]
        return all_reduce(total, axis_group(self.x._spec.mesh, axes), "sum") if axes else total

    def spec(self, reduction: int, dtype: torch.dtype) -> ShardTensorSpec:
        """The loss's layout: per target, Partial over the class axes; a scalar, Partial over
        every sharding axis."""
        spec = self.x._spec
        if reduction == _NONE:
            return _per_target(spec, self.class_dim, dtype, Partial())
        axes = sharding_axes(spec)
        placements = [Partial() if a in axes else Replicate() for a in range(spec.mesh.ndim)]
        return ShardTensorSpec.build(spec.mesh, placements, (), dtype)


def _per_target(
    spec: ShardTensorSpec, class_dim: int, dtype: torch.dtype, placement: Placement
) -> ShardTensorSpec:
    return reduced_spec(spec, class_dim, False, dtype, placement)


@register_aten_handler(*_NLL_LOSSES)
def _nll_loss_forward(func, args, kwargs):
    """NOTE [A loss over split classes is a pending sum]."""
    a = bind(func, args, kwargs)
    if not isinstance(a.self, ShardTensor) or not accepts(
        a.self, a.target, partial=True, replicated=[a.weight]
    ):
        return NotImplemented
    picked = _Picked.of(a.self, a.target, a.weight, a.ignore_index)
    terms = picked.terms()
    dtype = terms.dtype
    scalar = replicated_spec(terms.new_zeros(()), picked.x._spec.mesh)
    if a.reduction == _NONE:
        return ShardTensor(terms, picked.spec(_NONE, dtype)), ShardTensor(
            terms.new_zeros(()), scalar
        )
    total_weight = picked.total_weight()
    loss = terms.sum() if a.reduction == _SUM else terms.sum() / total_weight
    return ShardTensor(loss, picked.spec(a.reduction, dtype)), ShardTensor(total_weight, scalar)


@register_aten_handler(*_NLL_LOSS_BACKWARDS)
def _nll_loss_backward(func, args, kwargs):
    """The input's gradient in its own layout: ``-w[t] dL`` (over the total weight for a
    mean) written at each target's class by the rank holding it."""
    a = bind(func, args, kwargs)
    if not isinstance(a.self, ShardTensor) or not accepts(
        a.self, a.target, a.grad_output, partial=True, replicated=[a.weight]
    ):
        return NotImplemented
    picked = _Picked.of(a.self, a.target, a.weight, a.ignore_index)
    grad = reduced_now(a.grad_output)
    if a.reduction == _NONE:
        targets = _per_target(picked.x._spec, picked.class_dim, grad.dtype, Replicate())
        grad = (
            redistribute(grad, targets)._local
            if isinstance(grad, ShardTensor)
            else targets.narrow(grad)
        )
    else:
        grad = local_of(grad)
    values = torch.where(picked.mine, -picked.weights * grad, 0)
    if a.reduction == _MEAN:
        values = values / local_of(a.total_weight)
    local = torch.zeros_like(picked.x._local)
    if local.shape[picked.class_dim]:
        local.scatter_(
            picked.class_dim, picked.index, values.unsqueeze(picked.class_dim).to(local.dtype)
        )
    return ShardTensor(local, picked.x._spec)
