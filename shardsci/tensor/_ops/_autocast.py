"""What autocast asks of shardsci's own products.

NOTE [A product Function computes in autocast's dtype]
Autocast casts the operands of torch's products (``mm``, ``bmm``, ``einsum``'s, attention) to
its lower-precision dtype at dispatch, and torch's autograd nodes save the cast copies. A
shardsci autograd Function that computes a product runs its forward under autocast but its
backward outside it, on what it saved: float32 operands against a bfloat16 gradient, which
raised (``_RingProduct``'s adjoint einsum: ``expected scalar type BFloat16 but found Float``),
and float32 copies saved where torch keeps bfloat16 ones. So such a Function is applied as
torch applies its own products: its floating operands cast first (float64 stays, as autocast
leaves it), the Function run with autocast off, its gradients cast back to each operand's
dtype by ``.to``'s own backward. Applied by ``ring_product`` and ``attend``; a linear layer
under autocast runs as torch's nodes instead (NOTE [A linear layer is one autograd node]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from shardsci.tensor._torch_compat import _is_any_autocast_enabled

__all__ = ["autocast_dtype", "cast_for_autocast"]


def autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """Autocast's lower-precision dtype on ``t``'s device, or None where autocast is off.

    Asked by every linear layer (``_matmul_ops``): where no device's autocast is on, one
    check answers (0.3 us, where reading ``t.device`` alone costs 1 us)."""
    if not _is_any_autocast_enabled():
        return None
    device = t.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return None


@contextlib.contextmanager
def cast_for_autocast(
    *tensors: torch.Tensor | None,
) -> Iterator[tuple[torch.Tensor | None, ...]]:
    """``tensors`` cast to autocast's dtype (floating ones other than float64), with autocast
    off inside: a product Function is applied here as torch applies its products (NOTE
    above). Outside autocast, the tensors as they are. The dtype and the device are the
    first tensor's that is not None."""
    first = next(t for t in tensors if t is not None)
    dtype = autocast_dtype(first)
    if dtype is None:
        yield tensors
        return

    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or not t.is_floating_point() or t.dtype == torch.float64:
            return t
        return t.to(dtype)

    with torch.autocast(first.device.type, enabled=False):
        yield tuple(cast(t) for t in tensors)
