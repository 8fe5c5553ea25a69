"""The recipe's model: a plain ``nn.Module`` for one device, run unchanged on ShardTensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import nn


@dataclass(frozen=True)
class StencilNetConfig:
    """Attributes
    ----------
    width : int
        Hidden channels.
    kernel_size : int
        Odd kernel size of the first convolution.
    padding_mode : {"circular", "zeros"}
        Boundary of the first convolution.
    """

    width: int = 4
    kernel_size: int = 3
    padding_mode: Literal["circular", "zeros"] = "circular"

    def __post_init__(self) -> None:
        if self.kernel_size % 2 != 1:
            raise ValueError(f"kernel_size={self.kernel_size}: expected an odd size")


class StencilNet(nn.Module):
    """A convolution and a pointwise projection: ``(B, 1, H, W) -> (B, 1, H, W)``."""

    def __init__(self, **config: object):
        super().__init__()
        self.config = StencilNetConfig(**config)  # type: ignore[arg-type]
        c = self.config
        self.conv = nn.Conv2d(
            1, c.width, c.kernel_size, padding=c.kernel_size // 2, padding_mode=c.padding_mode
        )
        self.project = nn.Conv2d(c.width, 1, 1)

    def forward(self, x):
        return self.project(self.conv(x))
