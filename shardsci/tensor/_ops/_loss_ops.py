"""Losses whose DTensor rules average local means (``Partial("avg")``), wrong for unequal
shards: here a mean is a sum over the true element count. ``l1_loss`` and friends decompose
above dispatch into ops that are already right (``abs``, ``mean``)."""

from __future__ import annotations

import math

import torch

from shardsci.tensor._ops._common import arg
from shardsci.tensor._registry import register_aten_handler

aten = torch.ops.aten

_NONE, _MEAN, _SUM = 0, 1, 2


@register_aten_handler(aten.mse_loss.default)
def _mse_loss(func, args, kwargs):
    x, target = args[0], args[1]
    reduction = arg(args, kwargs, 2, "reduction", _MEAN)
    difference = aten.sub.Tensor(x, target)
    squares = aten.mul.Tensor(difference, difference)
    if reduction == _NONE:
        return squares
    total = aten.sum.default(squares)
    return total if reduction == _SUM else aten.div.Scalar(total, _numel(x, target))


@register_aten_handler(aten.mse_loss_backward.default)
def _mse_loss_backward(func, args, kwargs):
    grad, x, target = args[0], args[1], args[2]
    reduction = arg(args, kwargs, 3, "reduction", _MEAN)
    scale = 2.0 if reduction != _MEAN else 2.0 / _numel(x, target)
    return aten.mul.Tensor(aten.mul.Scalar(aten.sub.Tensor(x, target), scale), grad)


def _numel(x: torch.Tensor, target: torch.Tensor) -> int:
    return math.prod(torch.broadcast_shapes(x.shape, target.shape))
