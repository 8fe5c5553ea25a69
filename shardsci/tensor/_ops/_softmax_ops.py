"""softmax and log_softmax along a sharded dim, forward and backward.

DTensor gathers the whole dim. Here the max and the sum of exponentials are reduced across
shards (an all-reduce of one value per softmax row each), composed from ShardTensor ops so
that placements and uneven sizes follow the default rules:
softmax = exp(x - max) / sum(exp(x - max)), log_softmax = x - max - log(sum(exp(x - max))),
and the backward passes need one more reduction each: dx = y (g - sum(g y)) for softmax and
dx = g - exp(y) sum(g) for log_softmax.
"""

from __future__ import annotations

import torch

from shardsci.tensor._binding import bind
from shardsci.tensor._ops._common import accepts, reduced_now
from shardsci.tensor._registry import register_aten_handler

aten = torch.ops.aten


@register_aten_handler(aten._softmax.default, aten._log_softmax.default)
def _softmax(func, args, kwargs):
    a = bind(func, args, kwargs)
    x, dim = a.self, a.dim
    if not accepts(x, sharded=[dim]):
        return NotImplemented
    if a.half_to_float:
        x = aten._to_copy.default(x, dtype=torch.float32)
    shifted = aten.sub.Tensor(x, reduced_now(aten.amax.default(x, [dim], True)))
    exponentials = aten.exp.default(shifted)
    total = reduced_now(aten.sum.dim_IntList(exponentials, [dim], True))
    if func is aten._softmax.default:
        return aten.div.Tensor(exponentials, total)
    return aten.sub.Tensor(shifted, aten.log.default(total))


@register_aten_handler(aten._safe_softmax.default)
def _safe_softmax(func, args, kwargs):
    """softmax whose rows of only ``-inf`` give zeros, not NaN (SDPA's math path with a
    boolean mask): the softmax above (or the local one, along a whole dim) and a row test
    ``all(x == -inf)`` reduced along ``dim`` like any ``all``, every piece in ``x``'s layout
    (DTensor has no rule for it and gathered). Its backward is softmax's."""
    a = bind(func, args, kwargs)
    x, dim = a.self, a.dim
    if not accepts(x):
        return NotImplemented
    if a.dtype is not None:
        x = aten._to_copy.default(x, dtype=a.dtype)
    out = aten._softmax.default(x, dim, False)
    empty_rows = aten.all.dim(aten.eq.Scalar(x, float("-inf")), dim, True)
    return aten.where.self(empty_rows, aten.zeros_like.default(out), out)


@register_aten_handler(aten._softmax_backward_data.default)
def _softmax_backward(func, args, kwargs):
    a = bind(func, args, kwargs)
    grad, output, dim = a.grad_output, a.output, a.dim
    if not accepts(grad, output, sharded=[dim]):
        return NotImplemented
    weighted = reduced_now(aten.sum.dim_IntList(aten.mul.Tensor(grad, output), [dim], True))
    result = aten.mul.Tensor(output, aten.sub.Tensor(grad, weighted))
    return aten._to_copy.default(result, dtype=a.input_dtype)


@register_aten_handler(aten._log_softmax_backward_data.default)
def _log_softmax_backward(func, args, kwargs):
    a = bind(func, args, kwargs)
    grad, output, dim = a.grad_output, a.output, a.dim
    if not accepts(grad, output, sharded=[dim]):
        return NotImplemented
    total = reduced_now(aten.sum.dim_IntList(grad, [dim], True))
    result = aten.sub.Tensor(grad, aten.mul.Tensor(aten.exp.default(output), total))
    return aten._to_copy.default(result, dtype=a.input_dtype)
