"""A ShardTensor written into a plain tensor: ``buffer.copy_(x)``, ``buffer[key] = x``.

# NOTE [A ShardTensor written into a plain tensor]
A plain tensor is whole on every rank, and an in-place write leaves it plain: the Python object
the user holds cannot become a ShardTensor, and the plain ops that read it next (an inverse FFT
of a spectrum written into ``torch.zeros(...)``, as neuraloperator's ``SpectralConv`` does)
need all of it on every rank, as on one process. So the value written is the user's request for
the whole tensor, like ``full_tensor()``: it is gathered inside ``asked_for`` (no
``GatherWarning``; it is no larger than the buffer the user already holds whole) and written
by torch's own kernel, and its gradient, a plain slice of the buffer's (whole on every rank
like the buffer), goes back through ``full_tensor``'s backward, cut to the value's layout with
no communication. Below autograd, torch's ``copy_`` of a ShardTensor into a plain tensor
gathered the same value, but its backward handed the value's producer a plain gradient of the
global shape, which ``from_local``'s backward reported as a gradient built whole.
Handled at ``__torch_function__`` (before autograd records the write): ``Tensor.copy_`` here
and ``Tensor.__setitem__`` in ``_gather_scatter_ops``; other in-place ops into a plain tensor
(``buffer.add_(x)``) keep the default path.
"""

from __future__ import annotations

import torch

from shardsci.tensor._api import ShardTensor
from shardsci.tensor._binding import bind
from shardsci.tensor._gather_guard import asked_for
from shardsci.tensor._registry import register_function_handler

__all__ = ["whole_value"]


def whole_value(value: object) -> object:
    """``value`` as a plain tensor writes it: a ShardTensor's ``full_tensor()``, asked for
    (NOTE [A ShardTensor written into a plain tensor]); anything else as it is."""
    if not isinstance(value, ShardTensor):
        return value
    with asked_for():
        return value.full_tensor()


def _copy_signature(self, src, non_blocking=False):
    """``Tensor.copy_``'s parameters (a builtin without an inspectable signature)."""


@register_function_handler(torch.Tensor.copy_)
def _copy_into_plain(func, args, kwargs):
    """``buffer.copy_(x)`` with ``buffer`` plain and ``x`` a ShardTensor: ``x`` whole."""
    a = bind(func, args, kwargs, signature=_copy_signature)
    if isinstance(a.self, ShardTensor) or not isinstance(a.src, ShardTensor):
        return NotImplemented
    return func(a.self, whole_value(a.src), a.non_blocking)
