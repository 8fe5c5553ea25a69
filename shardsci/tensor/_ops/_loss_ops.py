"""Losses on shards of any size: a mean is a sum over the true element count.

DTensor's rules average local means (``Partial("avg")``), wrong for unequal shards, and have
no rule at all for huber, smooth-L1, soft-margin and binary cross-entropy losses. Here the
elementwise terms are computed on the shards (``_elementwise_ops``) and reduced by the sum
and mean handlers; the backward kernels run on the shards with ``reduction="sum"`` (the
incoming gradient is one number) and a mean is divided by the global element count.
``l1_loss`` and friends decompose above dispatch into ops that are already right (``abs``,
``mean``)."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Replicate

from shardsci.tensor._api import ShardTensor, redistribute
from shardsci.tensor._binding import bind, replaced
from shardsci.tensor._ops._common import accepts
from shardsci.tensor._ops._elementwise_ops import elementwise
from shardsci.tensor._redistribute import target_spec
from shardsci.tensor._registry import register_aten_handler

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


@register_aten_handler(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def _nll_loss_forward(func, args, kwargs):
    """A mean over shards of any size: the sum of the picked log-probabilities and the total
    weight, each summed over the shards, then divided (DTensor averages local means)."""
    a = bind(func, args, kwargs)
    if a.reduction != _MEAN or not accepts(a.self, sharded=range(a.self.ndim), partial=True):
        return NotImplemented
    args, kwargs = replaced(func, args, kwargs, {"reduction": _SUM})
    summed, total_weight = func(*args, **kwargs)
    total_weight = _replicated(total_weight)
    return aten.div.Tensor(summed, total_weight), total_weight


def _replicated(t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, ShardTensor) or not t._spec.partial:
        return t
    placements = [Replicate() if p.is_partial() else p for p in t._spec.placements]
    return redistribute(t, target_spec(t._spec, placements))
