"""A Fourier neural operator (Li et al., 2021) for 2-D and 3-D fields, written for one device.

``(B, C_in, N_1, ..., N_k) -> (B, C_out, N_1, ..., N_k)`` with k = ``len(config.modes)``: a
1x1 lifting to ``width`` channels, ``layers`` Fourier layers ``act(K x + W x)`` (K a spectral
convolution on the lowest modes, W a 1x1 convolution), and a two-layer 1x1 projection.

NOTE [FNO op set]
shardsci runs this module domain-parallel, unchanged, when its input is a ``ShardTensor`` split
along spatial dims, so it uses only ops with sharded handlers: 1x1 ``Conv2d``/``Conv3d``,
GELU/SiLU, ``torch.fft.rfft``/``fft``/``ifft``/``irfft`` along one dim per call, slicing and
``torch.cat`` along a dim, ``F.pad`` (zeros), ``torch.einsum`` with a complex weight, and
broadcast additions of plain position terms (``_coordinates``). Add an op only together with
its sharded handler.

NOTE [Spectral truncation before each transform]
``rfftn`` over the spatial dims followed by keeping the lowest modes equals: ``rfft`` along the
last dim and keep its ``m_k`` lowest modes, then, for each other dim from the last to the
first, ``fft`` and keep its ``m_i`` lowest non-negative and ``m_i`` highest (negative)
frequencies. :class:`SpectralConv` works in that order, and its inverse in the reverse order
(re-insert zeros, ``ifft``; then ``irfft`` with the grid's length, which zero-fills the
dropped modes). On a field split along a dim other than the last, shardsci's distributed FFT
transposes the data when it transforms the sharded dim, by then already truncated along every
dim transformed before: the bytes moved scale with the kept modes, not the grid. A field split
along its last dim (W, alone or in a block) is transposed whole before ``rfft`` (which needs W
whole) and back after ``irfft``, to the input's layout: two moves of the field per layer on top
of the kept modes' two, so prefer splitting the leading spatial dims.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from shardsci.models._checks import check_choice, check_non_negative, check_positive
from shardsci.models._coordinates import CoordinateEmbedding, Coordinates

__all__ = ["FNO", "FNOConfig", "SpectralConv"]

Activation = Literal["gelu", "silu"]

_ACTIVATIONS: dict[str, type[nn.Module]] = {"gelu": nn.GELU, "silu": nn.SiLU}
_CONVS: dict[int, type[nn.Module]] = {2: nn.Conv2d, 3: nn.Conv3d}


@dataclass(frozen=True)
class FNOConfig:
    """Architecture of an :class:`FNO`; validated on construction."""

    in_channels: int = 1
    """Channels C_in of the input field."""
    out_channels: int = 1
    """Channels C_out of the output field."""
    modes: tuple[int, ...] = (12, 12)
    """Fourier modes kept per spatial dim; its length (2 or 3) is the number of spatial dims.
    The last dim keeps its ``m`` lowest ``rfft`` modes, every other dim its ``m`` lowest
    non-negative and ``m`` highest negative frequencies; so ``m <= N // 2 + 1`` for the last
    dim and ``2 m <= N`` for the others (N after domain padding)."""
    width: int = 32
    """Channels of every Fourier layer."""
    layers: int = 4
    """Number of Fourier layers."""
    projection_channels: int = 128
    """Hidden channels of the two-layer 1x1 projection to ``out_channels``."""
    activation: Activation = "gelu"
    """Nonlinearity after every Fourier layer but the last, and inside the projection."""
    coordinates: Coordinates = "none"
    """Position features added after the lifting (see ``shardsci.models._coordinates``): ``"periodic"``
    for periodic domains with a position-dependent forcing, ``"linear"`` as in the FNO paper."""
    padding: int = 0
    """Zero cells appended at the end of every spatial dim before the Fourier layers and cut
    after them, so a non-periodic field is not treated as periodic; 0 for periodic data."""
    residual: bool = False
    """Return the first ``out_channels`` input channels plus the network's output (one-step
    prediction of a correction); needs ``out_channels <= in_channels``."""

    def __post_init__(self) -> None:
        for name in ("in_channels", "out_channels", "width", "layers", "projection_channels"):
            check_positive(name, getattr(self, name))
        check_non_negative("padding", self.padding)
        check_choice("activation", self.activation, Activation)
        check_choice("coordinates", self.coordinates, Coordinates)
        object.__setattr__(self, "modes", tuple(self.modes))
        if len(self.modes) not in _CONVS:
            raise ValueError(
                f"modes={self.modes} must have one entry per spatial dim, 2 or 3 entries"
            )
        for m in self.modes:
            check_positive("every entry of modes", m)
        if self.residual and self.out_channels > self.in_channels:
            raise ValueError(
                f"residual=True needs out_channels <= in_channels, got out_channels="
                f"{self.out_channels} and in_channels={self.in_channels}"
            )

    @property
    def spatial_dims(self) -> int:
        """Number of spatial dims k of the fields."""
        return len(self.modes)


class SpectralConv(nn.Module):
    """Per-mode channel mixing of the lowest Fourier modes; see NOTE [Spectral truncation
    before each transform]. ``(B, C_in, N_1, ..., N_k) -> (B, C_out, N_1, ..., N_k)``.

    The weight is stored as real ``(C_in, C_out, 2 m_1, ..., 2 m_{k-1}, m_k, 2)`` (real and
    imaginary parts), so optimisers, gradient reductions and checkpoints see a real tensor.
    """

    def __init__(self, in_channels: int, out_channels: int, modes: tuple[int, ...]) -> None:
        super().__init__()
        self.modes = modes
        kept = [2 * m for m in modes[:-1]] + [modes[-1]]
        scale = 1.0 / (in_channels * out_channels)
        self.weight = nn.Parameter(scale * torch.rand(in_channels, out_channels, *kept, 2))
        letters = "xyz"[: len(modes)]
        self._equation = f"bi{letters},io{letters}->bo{letters}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # FFTs take no half precision on CPU (and powers of two only on CUDA): under bf16/fp16
        # autocast the spectral path runs in float32 and returns the input's dtype.
        dtype = x.dtype
        if dtype in (torch.float16, torch.bfloat16):
            x = x.float()
        k = len(self.modes)
        spatial = x.shape[-k:]
        spectrum = torch.fft.rfft(x, dim=-1, norm="ortho")[..., : self.modes[-1]]
        for i in reversed(range(k - 1)):
            dim = i - k
            spectrum = torch.fft.fft(spectrum, dim=dim, norm="ortho")
            m = self.modes[i]
            spectrum = torch.cat(
                [spectrum.narrow(dim, 0, m), spectrum.narrow(dim, spatial[i] - m, m)], dim=dim
            )
        mixed = torch.einsum(self._equation, spectrum, torch.view_as_complex(self.weight))
        for i in range(k - 1):
            dim = i - k
            m = self.modes[i]
            high = F.pad(mixed.narrow(dim, m, m), _pad_front(dim, spatial[i] - 2 * m))
            mixed = torch.fft.ifft(
                torch.cat([mixed.narrow(dim, 0, m), high], dim=dim), dim=dim, norm="ortho"
            )
        return torch.fft.irfft(mixed, n=spatial[-1], dim=-1, norm="ortho").to(dtype)


def _pad_front(dim: int, amount: int) -> tuple[int, ...]:
    """``F.pad`` argument adding ``amount`` zeros at the start of the negative ``dim``."""
    return (0, 0) * (-dim - 1) + (amount, 0)


class FNO(nn.Module):
    """Fourier neural operator ``(B, C_{in}, *spatial) -> (B, C_{out}, *spatial)``; see NOTE
    [FNO op set].

    Parameters
    ----------
    config
        Architecture; ``None`` for the defaults of :class:`FNOConfig`.
    **overrides
        Fields of :class:`FNOConfig` replacing those of ``config``,
        e.g. ``FNO(width=16, modes=(8, 8, 8))``.

    Examples
    --------
    >>> model = FNO(modes=(8, 8), width=16, coordinates="periodic")
    >>> model(torch.randn(4, 1, 64, 64)).shape
    torch.Size([4, 1, 64, 64])
    """

    def __init__(self, config: FNOConfig | None = None, **overrides: object) -> None:
        super().__init__()
        self.config = dataclasses.replace(config or FNOConfig(), **overrides)
        c = self.config
        conv = _CONVS[c.spatial_dims]
        self.lifting = conv(c.in_channels, c.width, 1)
        self.coordinates = CoordinateEmbedding(c.spatial_dims, c.width, c.coordinates)
        self.spectral = nn.ModuleList(
            SpectralConv(c.width, c.width, c.modes) for _ in range(c.layers)
        )
        self.pointwise = nn.ModuleList(conv(c.width, c.width, 1) for _ in range(c.layers))
        self.act = _ACTIVATIONS[c.activation]()
        self.projection = nn.Sequential(
            conv(c.width, c.projection_channels, 1),
            _ACTIVATIONS[c.activation](),
            conv(c.projection_channels, c.out_channels, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the operator.

        Parameters
        ----------
        x
            Input field ``(B, C_{in}, N_1, ..., N_k)``.

        Returns
        -------
        torch.Tensor
            Output field ``(B, C_{out}, N_1, ..., N_k)``; with ``residual``,
            ``x[:, :C_{out}]`` plus the network's correction.

        Raises
        ------
        ValueError
            If ``x`` has the wrong rank or channels, or a spatial dim (after padding) is too
            short for the modes kept along it.
        """
        self._check_input(x.shape)
        c = self.config
        spatial = x.shape[2:]
        y = self.coordinates(self.lifting(x))
        if c.padding:
            y = F.pad(y, (0, c.padding) * c.spatial_dims)
        for i, (spectral, pointwise) in enumerate(zip(self.spectral, self.pointwise)):
            y = spectral(y) + pointwise(y)
            if i < c.layers - 1:
                y = self.act(y)
        if c.padding:
            for d, n in enumerate(spatial):
                y = y.narrow(2 + d, 0, n)
        y = self.projection(y)
        return x[:, : c.out_channels] + y if c.residual else y

    def num_parameters(self) -> int:
        """Number of trainable scalars (a complex spectral weight counts twice)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def _check_input(self, shape: torch.Size) -> None:
        c = self.config
        if len(shape) != 2 + c.spatial_dims or shape[1] != c.in_channels:
            names = ", ".join(f"N_{i + 1}" for i in range(c.spatial_dims))
            raise ValueError(
                f"FNO expects input (B, {c.in_channels}, {names}), got shape {tuple(shape)}"
            )
        padded = [n + c.padding for n in shape[2:]]
        limits = [n // 2 for n in padded[:-1]] + [padded[-1] // 2 + 1]
        if any(m > limit for m, limit in zip(c.modes, limits)):
            raise ValueError(
                f"FNO with modes={c.modes} and padding={c.padding} needs at most {tuple(limits)} "
                f"modes for input shape {tuple(shape)} (2 m <= N per dim, m <= N // 2 + 1 for the "
                f"last)"
            )
