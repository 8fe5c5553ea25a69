"""A Transolver (Wu et al., 2024) for fields on 1-, 2- or 3-D grids, written for one device.

``(B, C_in, *S) -> (B, C_out, *S)``: every cell is a token. Physics attention replaces
attention among the cells: each block softly assigns every cell to ``slices`` learned slices
(per head, a softmax over slices), forms one token per slice as the assignment-weighted mean of
the cells' features, runs self-attention among the few slice tokens, and broadcasts the slice
tokens back to the cells with the same weights. Cost is linear in the number of cells.

NOTE [Transolver op set]
shardsci runs this module domain-parallel, unchanged, on a field split along any spatial dims
(slabs and blocks alike: the cells are never flattened into one token dim). Cells stay in a
channels-last grid ``(B, *S, D)``: ``Linear``, ``LayerNorm``, GELU and softmax act on the last
dim (local); the slice tokens are sums over the spatial dims (``torch.einsum`` contracting the
sharded dims gives a Partial sum, reduced once: one all-reduce of ``(B, heads, slices, D /
heads)`` per block, and one of the weights' totals); the attention among slices runs on
replicated tokens, redundantly on every rank (slices are few); broadcasting back is an einsum
with the sharded dims as batch dims (local). Lifting and position features run channels-first
like the FNO's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardsci.models._checks import check_choice, check_positive
from shardsci.models._coordinates import CoordinateEmbedding, Coordinates
from shardsci.models._layers import mlp

__all__ = ["PhysicsAttention", "Transolver", "TransolverConfig"]

_CONVS: dict[int, type[nn.Module]] = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_SPATIAL = "xyz"


@dataclass(frozen=True)
class TransolverConfig:
    """Architecture of a :class:`Transolver`; validated on construction."""

    in_channels: int = 1
    """Channels C_in of the input field."""
    out_channels: int = 1
    """Channels C_out of the output field."""
    spatial_dims: int = 2
    """Number k of spatial dims of the fields (1, 2 or 3)."""
    width: int = 128
    """Features D of every cell token."""
    layers: int = 4
    """Number of Transolver blocks."""
    heads: int = 4
    """Attention heads; must divide ``width``."""
    slices: int = 32
    """Learned slices M per head that the cells are softly assigned to."""
    mlp_ratio: int = 2
    """Hidden features of each block's MLP, as a multiple of ``width``."""
    coordinates: Coordinates = "periodic"
    """Position features added after the lifting (``shardsci.models._coordinates``)."""
    residual: bool = False
    """Return the first ``out_channels`` input channels plus the network's output (one-step
    prediction of a correction); needs ``out_channels <= in_channels``."""

    def __post_init__(self) -> None:
        names = ("in_channels", "out_channels", "width", "layers", "heads", "slices", "mlp_ratio")
        for name in names:
            check_positive(name, getattr(self, name))
        check_choice("coordinates", self.coordinates, Coordinates)
        if self.spatial_dims not in _CONVS:
            raise ValueError(f"spatial_dims must be 1, 2 or 3, got {self.spatial_dims!r}")
        if self.width % self.heads:
            raise ValueError(f"heads={self.heads} must divide width={self.width}")
        if self.residual and self.out_channels > self.in_channels:
            raise ValueError(
                f"residual=True needs out_channels <= in_channels, got out_channels="
                f"{self.out_channels} and in_channels={self.in_channels}"
            )


class PhysicsAttention(nn.Module):
    """Slice, attend among slices, deslice: ``(B, *S, D) -> (B, *S, D)`` over k spatial dims.

    Parameters
    ----------
    width, heads, slices, spatial_dims
        D, the heads h (each of D / h features), the slices M per head, and k.
    """

    def __init__(self, width: int, heads: int, slices: int, spatial_dims: int) -> None:
        super().__init__()
        self.heads = heads
        head_width = width // heads
        self.features = nn.Linear(width, width)
        self.assignment_features = nn.Linear(width, width)
        self.assignment = nn.Linear(head_width, slices)
        self.temperature = nn.Parameter(torch.full((heads, 1), 0.5))
        self.q, self.k, self.v = (nn.Linear(head_width, head_width, bias=False) for _ in range(3))
        self.proj = nn.Linear(width, width)
        cells = _SPATIAL[:spatial_dims]
        self._slice = f"b{cells}hm,b{cells}hc->bhmc"
        self._count = f"b{cells}hm->bhm"
        self._deslice = f"bhmc,b{cells}hm->b{cells}hc"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        split = (*x.shape[:-1], self.heads, x.shape[-1] // self.heads)
        features = self.features(x).reshape(split)  # (B, *S, h, c)
        logits = self.assignment(self.assignment_features(x).reshape(split))  # (B, *S, h, M)
        weights = torch.softmax(logits / self.temperature, dim=-1)
        totals = torch.einsum(self._count, weights)  # (B, h, M)
        tokens = torch.einsum(self._slice, weights, features) / (totals[..., None] + 1e-5)
        attended = F.scaled_dot_product_attention(self.q(tokens), self.k(tokens), self.v(tokens))
        cells = torch.einsum(self._deslice, attended, weights)  # (B, *S, h, c)
        return self.proj(cells.flatten(-2))


class TransolverBlock(nn.Module):
    """``x + attention(norm(x))``, then ``x + mlp(norm(x))`` on ``(B, *S, D)``."""

    def __init__(self, config: TransolverConfig) -> None:
        super().__init__()
        c = config
        self.attention_norm = nn.LayerNorm(c.width)
        self.attention = PhysicsAttention(c.width, c.heads, c.slices, c.spatial_dims)
        self.mlp_norm = nn.LayerNorm(c.width)
        self.mlp = mlp(c.width, c.mlp_ratio * c.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transolver(nn.Module):
    """Transolver ``(B, C_{in}, *S) -> (B, C_{out}, *S)``; see NOTE [Transolver op set].

    Parameters
    ----------
    config
        Architecture; ``None`` for the defaults of :class:`TransolverConfig`.
    **overrides
        Fields of :class:`TransolverConfig` replacing those of ``config``,
        e.g. ``Transolver(slices=16, spatial_dims=3)``.

    Examples
    --------
    >>> model = Transolver(width=64, layers=2, heads=4, slices=16)
    >>> model(torch.randn(2, 1, 32, 32)).shape
    torch.Size([2, 1, 32, 32])
    """

    def __init__(self, config: TransolverConfig | None = None, **overrides: object) -> None:
        super().__init__()
        self.config = dataclasses.replace(config or TransolverConfig(), **overrides)
        c = self.config
        conv = _CONVS[c.spatial_dims]
        self.lifting = nn.Sequential(
            conv(c.in_channels, 2 * c.width, 1), nn.GELU(), conv(2 * c.width, c.width, 1)
        )
        self.coordinates = CoordinateEmbedding(c.spatial_dims, c.width, c.coordinates)
        self.blocks = nn.ModuleList(TransolverBlock(c) for _ in range(c.layers))
        self.norm = nn.LayerNorm(c.width)
        self.head = nn.Linear(c.width, c.out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the network.

        Parameters
        ----------
        x
            Input field ``(B, C_{in}, *S)`` with ``spatial_dims`` spatial dims.

        Returns
        -------
        torch.Tensor
            Output field ``(B, C_{out}, *S)``; with ``residual``, ``x[:, :C_{out}]`` plus the
            network's correction.

        Raises
        ------
        ValueError
            If ``x`` has the wrong rank or channels.
        """
        c = self.config
        if x.ndim != 2 + c.spatial_dims or x.shape[1] != c.in_channels:
            cells = ", ".join(f"N_{i + 1}" for i in range(c.spatial_dims))
            raise ValueError(
                f"Transolver expects input (B, {c.in_channels}, {cells}), got shape "
                f"{tuple(x.shape)}"
            )
        cells = self.coordinates(self.lifting(x)).movedim(1, -1)  # (B, *S, D)
        for block in self.blocks:
            cells = block(cells)
        y = self.head(self.norm(cells)).movedim(-1, 1)
        return x[:, : c.out_channels] + y if c.residual else y

    def num_parameters(self) -> int:
        """Number of trainable scalars."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
