"""A UNet for 2-D fields ``(B, C, H, W)`` and 3-D fields ``(B, C, D, H, W)``, written for one
device.

NOTE [UNet op set]
shardsci runs this module domain-parallel, unchanged, when its input is a ``ShardTensor`` split
along its spatial dims, so the module holds no distributed code and uses only the ops that have
sharded handlers: 3x3 (3x3x3) stride-1 ``Conv2d`` (``Conv3d``) with ``padding=1`` in any
``padding_mode``, ``GroupNorm``, ``SiLU``/``GELU``, 2x2 (2x2x2) average or max pooling,
``F.interpolate`` with ``scale_factor=2`` in ``"nearest"`` or ``"bilinear"`` (``"trilinear"``)
mode, ``torch.cat`` along channels, a final 1x1 convolution, and broadcast additions of plain position terms (``coordinates``). There is no BatchNorm (batch statistics would make data-parallel and
single-device runs differ), no dropout and no transposed convolution. Add an op here only
together with its sharded handler.

With ``padding_mode="circular"``, ``up="nearest"`` and no ``coordinates`` the network commutes
with periodic translations by multiples of ``2**depth`` pixels. ``"bilinear"`` upsampling clamps
at the borders (``align_corners=False``), so it is not exactly periodic at the edges.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from shardsci.models._checks import check_choice, check_positive
from shardsci.models._coordinates import CoordinateEmbedding, Coordinates

PaddingMode = Literal["zeros", "circular", "reflect", "replicate"]
Activation = Literal["silu", "gelu"]
Downsample = Literal["avg", "max"]
Upsample = Literal["nearest", "bilinear"]

_ACTIVATIONS: dict[str, type[nn.Module]] = {"silu": nn.SiLU, "gelu": nn.GELU}
_CONVS: dict[int, type[nn.Module]] = {2: nn.Conv2d, 3: nn.Conv3d}
_POOLS: dict[tuple[str, int], type[nn.Module]] = {
    ("avg", 2): nn.AvgPool2d,
    ("max", 2): nn.MaxPool2d,
    ("avg", 3): nn.AvgPool3d,
    ("max", 3): nn.MaxPool3d,
}
_MULTILINEAR = {2: "bilinear", 3: "trilinear"}
_POSITIVE_FIELDS = (
    "in_channels",
    "out_channels",
    "width",
    "depth",
    "blocks_per_level",
    "norm_groups",
)
_CHOICE_FIELDS = {
    "padding_mode": PaddingMode,
    "activation": Activation,
    "down": Downsample,
    "up": Upsample,
    "coordinates": Coordinates,
}


@dataclass(frozen=True)
class UNetConfig:
    """Architecture of a :class:`UNet`; validated on construction."""

    in_channels: int = 1
    """Channels C_in of the input field."""
    out_channels: int = 1
    """Channels C_out of the output field."""
    width: int = 32
    """Channels at the top (full-resolution) level."""
    depth: int = 3
    """Number of down/up levels; every spatial dim of the input must be divisible by
    ``2**depth``."""
    channel_multipliers: tuple[int, ...] | None = None
    """Channels of level ``l`` (0 = top, ``depth`` = bottom) as a multiple of ``width``, one per
    level (``depth + 1`` entries); ``None`` doubles at every level: ``(1, 2, 4, ...)``."""
    blocks_per_level: int = 2
    """Conv → GroupNorm → activation blocks at each level, on the way down and on the way up."""
    padding_mode: PaddingMode = "zeros"
    """Padding of every 3x3 convolution; ``"circular"`` for periodic domains."""
    norm_groups: int = 8
    """Groups of every GroupNorm; must divide the channels of every level."""
    activation: Activation = "silu"
    """Nonlinearity after every GroupNorm."""
    down: Downsample = "avg"
    """2x pooling between levels (2x2 or 2x2x2): ``"avg"`` or ``"max"``."""
    up: Upsample = "nearest"
    """Interpolation mode of the 2x upsampling that precedes each up-convolution
    (``"bilinear"`` is trilinear in 3-D)."""
    residual: bool = False
    """Return the first ``out_channels`` input channels plus the network's output, so the
    network learns a correction (one-step prediction); needs ``out_channels <= in_channels``."""
    coordinates: Coordinates = "none"
    """Position features added to the top level's features (``shardsci.models._coordinates``):
    ``"periodic"`` for periodic domains with a position-dependent forcing."""
    spatial_dims: int = 2
    """Number of spatial dims of the fields: 2 (``(B, C, H, W)``) or 3 (``(B, C, D, H, W)``)."""

    def __post_init__(self) -> None:
        for name in _POSITIVE_FIELDS:
            check_positive(name, getattr(self, name))
        for name, choices in _CHOICE_FIELDS.items():
            check_choice(name, getattr(self, name), choices)
        if self.spatial_dims not in _CONVS:
            raise ValueError(f"spatial_dims must be 2 or 3, got {self.spatial_dims!r}")
        if self.channel_multipliers is not None:
            object.__setattr__(self, "channel_multipliers", tuple(self.channel_multipliers))
            self._check_multipliers(self.channel_multipliers)
        self._check_channels()

    @property
    def level_channels(self) -> tuple[int, ...]:
        """Channels of each level, top (full resolution) to bottom; ``depth + 1`` entries."""
        multipliers = self.channel_multipliers or tuple(2**level for level in range(self.depth + 1))
        return tuple(self.width * m for m in multipliers)

    def _check_multipliers(self, multipliers: tuple[int, ...]) -> None:
        if len(multipliers) != self.depth + 1:
            raise ValueError(
                f"channel_multipliers={multipliers} has {len(multipliers)} entries, expected "
                f"depth + 1 = {self.depth + 1}"
            )
        for multiplier in multipliers:
            check_positive("every entry of channel_multipliers", multiplier)

    def _check_channels(self) -> None:
        bad = [c for c in self.level_channels if c % self.norm_groups]
        if bad:
            raise ValueError(
                f"norm_groups={self.norm_groups} must divide the channels of every level "
                f"{self.level_channels}; it does not divide {bad}"
            )
        if self.residual and self.out_channels > self.in_channels:
            raise ValueError(
                f"residual=True needs out_channels <= in_channels, got out_channels="
                f"{self.out_channels} and in_channels={self.in_channels}"
            )


def _conv3x3(in_channels: int, out_channels: int, config: UNetConfig) -> nn.Module:
    conv = _CONVS[config.spatial_dims]
    return conv(in_channels, out_channels, 3, padding=1, padding_mode=config.padding_mode)


class ConvBlock(nn.Module):
    """3x3 convolution → GroupNorm → activation; ``(B, C_in, H, W) -> (B, C_out, H, W)``."""

    def __init__(self, in_channels: int, out_channels: int, config: UNetConfig) -> None:
        super().__init__()
        self.conv = _conv3x3(in_channels, out_channels, config)
        self.norm = nn.GroupNorm(config.norm_groups, out_channels)
        self.act = _ACTIVATIONS[config.activation]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(self.conv(x)))


def conv_stack(in_channels: int, out_channels: int, config: UNetConfig) -> nn.Sequential:
    """``config.blocks_per_level`` ConvBlocks; the first maps ``in_channels`` to ``out_channels``."""
    channels = [in_channels] + [out_channels] * config.blocks_per_level
    return nn.Sequential(
        *(ConvBlock(c_in, c_out, config) for c_in, c_out in itertools.pairwise(channels))
    )


class Down(nn.Module):
    """2x pooling, then a conv stack; ``(B, C_in, *S) -> (B, C_out, *S/2)``."""

    def __init__(self, in_channels: int, out_channels: int, config: UNetConfig) -> None:
        super().__init__()
        self.pool = _POOLS[config.down, config.spatial_dims](2)
        self.convs = conv_stack(in_channels, out_channels, config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.convs(self.pool(x))


class Up(nn.Module):
    """2x upsampling and a 3x3 conv, concatenation with the skip, then a conv stack.

    ``(B, C_in, H/2, W/2)`` and skip ``(B, C_out, H, W)`` ``-> (B, C_out, H, W)``.
    """

    def __init__(self, in_channels: int, out_channels: int, config: UNetConfig) -> None:
        super().__init__()
        self.mode = _MULTILINEAR[config.spatial_dims] if config.up == "bilinear" else config.up
        self.conv = _conv3x3(in_channels, out_channels, config)
        self.convs = conv_stack(2 * out_channels, out_channels, config)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = self.conv(F.interpolate(x, scale_factor=2, mode=self.mode))
        return self.convs(torch.cat([x, skip], dim=1))


class UNet(nn.Module):
    """UNet mapping ``(B, C_{in}, *S)`` to ``(B, C_{out}, *S)``, ``S = (H, W)`` or ``(D, H,
    W)`` (``spatial_dims``); see NOTE [UNet op set].

    Parameters
    ----------
    config
        Architecture; ``None`` for the defaults of :class:`UNetConfig`.
    **overrides
        Fields of :class:`UNetConfig` replacing those of ``config``,
        e.g. ``UNet(width=16, padding_mode="circular")``.
    """

    def __init__(self, config: UNetConfig | None = None, **overrides: object) -> None:
        super().__init__()
        self.config = dataclasses.replace(config or UNetConfig(), **overrides)
        channels = self.config.level_channels
        self.encoder = conv_stack(self.config.in_channels, channels[0], self.config)
        dims = self.config.spatial_dims
        self.coordinates = CoordinateEmbedding(dims, channels[0], self.config.coordinates)
        self.downs = nn.ModuleList(
            Down(c_in, c_out, self.config) for c_in, c_out in itertools.pairwise(channels)
        )
        self.ups = nn.ModuleList(
            Up(c_in, c_out, self.config) for c_in, c_out in itertools.pairwise(reversed(channels))
        )
        self.head = _CONVS[dims](channels[0], self.config.out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the network.

        Parameters
        ----------
        x
            Input field ``(B, C_{in}, *S)``; every spatial dim divisible by ``2**depth``.

        Returns
        -------
        torch.Tensor
            Output field ``(B, C_{out}, *S)``; with ``residual``, ``x[:, :C_{out}]`` plus the
            network's correction.

        Raises
        ------
        ValueError
            If ``x`` does not have ``2 + spatial_dims`` dims, has the wrong channel count, or a
            spatial dim is not divisible by ``2**depth`` (or, with reflect padding, smaller
            than ``2**(depth + 1)``).
        """
        self._check_input(x.shape)
        skips = [self.coordinates(self.encoder(x))]
        for down in self.downs:
            skips.append(down(skips[-1]))
        y = skips.pop()
        for up in self.ups:
            y = up(y, skips.pop())
        y = self.head(y)
        return x[:, : self.config.out_channels] + y if self.config.residual else y

    def num_parameters(self) -> int:
        """Number of trainable scalars."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def _check_input(self, shape: torch.Size) -> None:
        config = self.config
        dims = ("D", "H", "W")[-config.spatial_dims :]
        if len(shape) != 2 + config.spatial_dims or shape[1] != config.in_channels:
            raise ValueError(
                f"UNet expects input (B, {config.in_channels}, {', '.join(dims)}), got shape "
                f"{tuple(shape)}"
            )
        divisor = 2**config.depth
        # Reflect padding needs at least 2 pixels per dim at the bottom level.
        minimum = 2 * divisor if config.padding_mode == "reflect" else divisor
        if any(n % divisor or n < minimum for n in shape[2:]):
            raise ValueError(
                f"UNet with depth={config.depth} needs {', '.join(dims[:-1])} and {dims[-1]} "
                f"divisible by {divisor} and at least {minimum}, got input shape {tuple(shape)}"
            )
