"""Array functions for libraries that pick them by the top-level module of a tensor's class.

# NOTE [Libraries that pick functions by a tensor's module]
Some array libraries look up the functions to apply to an array in the top-level module of its
class: ``opt_einsum.contract`` (and through it tensorly's contractions) calls
``{module}.tensordot``, ``{module}.transpose`` and ``{module}.einsum`` with numpy's signatures,
where ``module = type(x).__module__.split(".")[0]``, and sends arrays whose module lacks them to
numpy (which fails on a tensor that requires grad). A ShardTensor's module is ``shardsci``, so
the package provides them: numpy's signatures over torch's functions, which dispatch on
ShardTensors like any torch call (``tests/test_interop.py``). They are for such libraries,
not for users, who call torch. The other common idioms hold without help: a ShardTensor is an
instance of ``torch.Tensor`` (``isinstance``, ``torch.is_tensor``), which is also how
``array_api_compat.array_namespace`` finds torch's namespace for it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["einsum", "tensordot", "transpose"]


def tensordot(
    a: torch.Tensor, b: torch.Tensor, axes: int | Sequence[Sequence[int]] = 2
) -> torch.Tensor:
    """``numpy.tensordot``: contract the last ``axes`` dims of ``a`` with the first of ``b``,
    or the dims listed in ``axes = (dims of a, dims of b)``."""
    return torch.tensordot(a, b, dims=axes)


def transpose(a: torch.Tensor, axes: Sequence[int] | None = None) -> torch.Tensor:
    """``numpy.transpose``: permute the dims (reverse them without ``axes``)."""
    return a.permute(*(range(a.ndim - 1, -1, -1) if axes is None else axes))


def einsum(equation: str, *operands: torch.Tensor, **kwargs: object) -> torch.Tensor:
    """``numpy.einsum`` with operands as separate arguments; ``out`` is not supported."""
    if kwargs:
        raise TypeError(
            f"shardsci.einsum takes no keyword arguments (got {sorted(kwargs)}); it returns a "
            f"new tensor"
        )
    return torch.einsum(equation, *operands)
