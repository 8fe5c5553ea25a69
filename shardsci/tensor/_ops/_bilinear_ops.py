"""``F.bilinear`` (``nn.Bilinear``) on ShardTensors, as the einsum it is.

``y[..., o] = sum_ij x1[..., i] W[o, i, j] x2[..., j] + b[o]``. aten's ``_trilinear``, which
``bilinear`` decomposes into below autograd, has no sharding rule and was gathered whole
(``_gathered_ops``). Written as ``torch.einsum("...i,oij,...j->...o")`` it takes the
product's rule (``_matmul_ops``): the batch dims (``...``) keep their split, each rank
reading its rows of the other input; a split feature dim (``i`` or ``j``) is contracted
where it lies, the output a pending sum over its axes. Nothing is gathered; autograd
differentiates the einsum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardsci.tensor._binding import bind
from shardsci.tensor._ops._common import accepts
from shardsci.tensor._registry import register_function_handler


def _bilinear_parameters(input1, input2, weight, bias=None):
    """``F.bilinear``'s parameters (a builtin: its signature cannot be read)."""


@register_function_handler(F.bilinear)
def _bilinear(func, args, kwargs):
    a = bind(func, args, kwargs, signature=_bilinear_parameters)
    x1, x2, weight, bias = a.input1, a.input2, a.weight, a.bias
    if not accepts(x1, x2, replicated=(weight, bias)) or x1.ndim != x2.ndim or weight.ndim != 3:
        return NotImplemented  # torch's own error, or the default path
    out = torch.einsum("...i,oij,...j->...o", x1, weight, x2)
    return out if bias is None else out + bias
