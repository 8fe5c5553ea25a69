"""Mixed precision of the forward pass (``train.precision``)."""

from __future__ import annotations

import contextlib
import enum

import torch

__all__ = ["Precision", "autocast"]


class Precision(enum.Enum):
    """Precision of the forward pass; parameters, gradients and the optimiser stay float32."""

    fp32 = "fp32"
    """Everything in float32."""
    bf16 = "bf16"
    """``torch.autocast`` to bfloat16 (matmuls, convolutions); losses stay float32."""


def autocast(precision: Precision, device: torch.device) -> contextlib.AbstractContextManager:
    """The context to run a forward pass (and its loss) in at ``precision`` on ``device``."""
    if precision is Precision.fp32:
        return contextlib.nullcontext()
    if precision is Precision.bf16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    raise ValueError(f"precision must be one of {[p.name for p in Precision]}, got {precision!r}")
