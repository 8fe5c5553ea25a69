"""A vision transformer for field-to-field maps on 2-D grids, written for one device.

``(B, C_in, H, W) -> (B, C_out, H, W)``: non-overlapping ``p x p`` patches embedded by a
strided convolution, position features added on the patch grid, ``depth`` pre-norm transformer
blocks (multi-head self-attention over all patches, MLP), and a linear map of each token to its
patch's ``p x p x C_out`` cells. H and W must be multiples of ``patch_size``.

NOTE [ViT op set]
shardsci runs this module domain-parallel, unchanged, on a field split along H (and W), with
the ops that have sharded handlers: ``Conv2d`` with stride = kernel (patches), broadcast
position terms, ``flatten``/``view``/``permute``/``reshape`` between the patch grid and the
token dim, ``LayerNorm`` and ``Linear`` over the feature dim, and
``F.scaled_dot_product_attention`` over the sharded token dim (ring or all-gather of keys and
values). A field split along H at patch boundaries gives tokens split along their dim, in the
same order, and comes back in the input's layout.

NOTE [Tokens of a block decomposition]
Tokens are the patches in row-major order (``p = i W_p + j``). Under a 2x2 block split
(H over mesh axis 0, W over axis 1) no rank holds a contiguous run of that order, so
flattening the patch grid moves W's mesh axes onto H first (one all-to-all of the patch
embeddings, never wrong data: ``shardsci/tensor/_ops/_view_ops.py``): tokens are then split
over both axes in row-major order. The view back to the patch grid returns to the input's
blocks (one all-to-all undoing the first: NOTE [An unflatten returns to the layout before the
flatten]), so the output has the input's layout. Attention is permutation-equivariant, so
keeping each rank's block of tokens in place with a recorded permutation would save both
all-to-alls; it is not done.
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

__all__ = ["ViT", "ViTConfig"]


@dataclass(frozen=True)
class ViTConfig:
    """Architecture of a :class:`ViT`; validated on construction."""

    in_channels: int = 1
    """Channels C_in of the input field."""
    out_channels: int = 1
    """Channels C_out of the output field."""
    patch_size: int = 4
    """Side p of the square patches (tokens); H and W must be multiples of it."""
    width: int = 128
    """Embedding dim D of every token."""
    depth: int = 4
    """Number of transformer blocks."""
    heads: int = 4
    """Attention heads; must divide ``width``."""
    mlp_ratio: int = 4
    """Hidden features of each block's MLP, as a multiple of ``width``."""
    coordinates: Coordinates = "periodic"
    """Position features of the patch grid (``shardsci.models._coordinates``); ``"none"`` leaves the
    model equivariant to patch-sized periodic shifts."""
    residual: bool = False
    """Return the first ``out_channels`` input channels plus the network's output (one-step
    prediction of a correction); needs ``out_channels <= in_channels``."""

    def __post_init__(self) -> None:
        for name in ("in_channels", "out_channels", "patch_size", "width", "depth", "heads"):
            check_positive(name, getattr(self, name))
        check_positive("mlp_ratio", self.mlp_ratio)
        check_choice("coordinates", self.coordinates, Coordinates)
        if self.width % self.heads:
            raise ValueError(f"heads={self.heads} must divide width={self.width}")
        if self.residual and self.out_channels > self.in_channels:
            raise ValueError(
                f"residual=True needs out_channels <= in_channels, got out_channels="
                f"{self.out_channels} and in_channels={self.in_channels}"
            )


class SelfAttention(nn.Module):
    """Multi-head self-attention over the token dim: ``(B, N, D) -> (B, N, D)``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        q, k, v = (
            t.reshape(batch, tokens, self.heads, width // self.heads).transpose(1, 2)
            for t in self.qkv(x).chunk(3, dim=-1)
        )
        out = F.scaled_dot_product_attention(q, k, v)  # (B, heads, N, D / heads)
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, width))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``; ``(B, N, D)``."""

    def __init__(self, width: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(width)
        self.attention = SelfAttention(width, heads)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = mlp(width, mlp_ratio * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class ViT(nn.Module):
    """Vision transformer ``(B, C_{in}, H, W) -> (B, C_{out}, H, W)``; see NOTE [ViT op set].

    Parameters
    ----------
    config
        Architecture; ``None`` for the defaults of :class:`ViTConfig`.
    **overrides
        Fields of :class:`ViTConfig` replacing those of ``config``, e.g. ``ViT(patch_size=8)``.

    Examples
    --------
    >>> model = ViT(patch_size=4, width=64, depth=2, heads=4)
    >>> model(torch.randn(2, 1, 32, 32)).shape
    torch.Size([2, 1, 32, 32])
    """

    def __init__(self, config: ViTConfig | None = None, **overrides: object) -> None:
        super().__init__()
        self.config = dataclasses.replace(config or ViTConfig(), **overrides)
        c = self.config
        p = c.patch_size
        self.embed = nn.Conv2d(c.in_channels, c.width, p, stride=p)
        self.coordinates = CoordinateEmbedding(2, c.width, c.coordinates)
        self.blocks = nn.ModuleList(
            TransformerBlock(c.width, c.heads, c.mlp_ratio) for _ in range(c.depth)
        )
        self.norm = nn.LayerNorm(c.width)
        self.unembed = nn.Linear(c.width, p * p * c.out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the network.

        Parameters
        ----------
        x
            Input field ``(B, C_{in}, H, W)``, H and W multiples of ``patch_size``.

        Returns
        -------
        torch.Tensor
            Output field ``(B, C_{out}, H, W)``; with ``residual``, ``x[:, :C_{out}]`` plus the
            network's correction.

        Raises
        ------
        ValueError
            If ``x`` is not ``(B, C_in, H, W)`` with H and W multiples of ``patch_size``.
        """
        self._check_input(x.shape)
        patches = self.coordinates(self.embed(x))  # (B, D, H / p, W / p)
        batch, _, rows, cols = patches.shape
        tokens = patches.flatten(2).transpose(1, 2)  # (B, N, D), N = H W / p²
        for block in self.blocks:
            tokens = block(tokens)
        y = self._unpatchify(self.unembed(self.norm(tokens)), batch, rows, cols)
        c = self.config
        return x[:, : c.out_channels] + y if c.residual else y

    def _unpatchify(self, tokens: torch.Tensor, batch: int, rows: int, cols: int) -> torch.Tensor:
        """``(B, N, p² C_out)`` token outputs -> the ``(B, C_out, H, W)`` field."""
        p, channels = self.config.patch_size, self.config.out_channels
        cells = tokens.reshape(batch, rows, cols, p, p, channels)
        return cells.permute(0, 5, 1, 3, 2, 4).reshape(batch, channels, rows * p, cols * p)

    def num_parameters(self) -> int:
        """Number of trainable scalars."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def _check_input(self, shape: torch.Size) -> None:
        c = self.config
        if len(shape) != 4 or shape[1] != c.in_channels:
            raise ValueError(
                f"ViT expects input (B, {c.in_channels}, H, W), got shape {tuple(shape)}"
            )
        if any(n % c.patch_size or n == 0 for n in shape[2:]):
            raise ValueError(
                f"ViT with patch_size={c.patch_size} needs H and W positive multiples of "
                f"{c.patch_size}, got input shape {tuple(shape)}"
            )
