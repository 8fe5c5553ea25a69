"""Tensor metadata as integers, for the small int64 headers ranks exchange (shapes, dtypes)."""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "MAX_DIMS"]

#: Dtypes a header can name, by index.
DTYPES = (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
    torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
)  # fmt: skip

#: Most dims a header describes.
MAX_DIMS = 64
