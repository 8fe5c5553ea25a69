"""Where a cell is, as features a translation-equivariant model can add to its channels.

A model of fields driven by a fixed forcing (the CFD recipe's ``sin 2π(x + y)``) must know
where each cell is; convolutions and spectral layers alone cannot tell. Concatenating
coordinate channels to the input and lifting them with a 1x1 convolution is the same linear map
as adding, per spatial dim, a learned projection of that dim's coordinate features: the latter
is what :class:`CoordinateEmbedding` does, so no full-size coordinate field is ever built (a
domain-parallel rank adds ``(1, C, H, 1)`` and ``(1, C, 1, W)`` terms that broadcast over its
shard).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn

__all__ = ["CoordinateEmbedding", "Coordinates"]

Coordinates = Literal["none", "linear", "periodic"]
"""``"none"``: no position features; ``"linear"``: ``x_i = i / N`` per dim (cell position in
[0, 1), as in the FNO paper); ``"periodic"``: ``sin 2πx, cos 2πx`` per dim, continuous across a
periodic boundary."""

_FEATURES = {"none": 0, "linear": 1, "periodic": 2}


class CoordinateEmbedding(nn.Module):
    """Adds ``sum_d W_d φ(x_d)`` to a field ``(B, C, N_1, ..., N_k)``.

    Parameters
    ----------
    spatial_dims : int
        k, the number of trailing spatial dims.
    channels : int
        C, the channels of the field it is added to.
    kind : Coordinates
        The features φ of each coordinate.
    """

    def __init__(self, spatial_dims: int, channels: int, kind: Coordinates) -> None:
        super().__init__()
        self.spatial_dims = spatial_dims
        self.kind = kind
        features = _FEATURES[kind]
        self.projections = nn.ModuleList(
            nn.Linear(features, channels, bias=False)
            for _ in range(spatial_dims if features else 0)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` plus its cells' position features; ``x`` unchanged for ``kind="none"``."""
        spatial = x.shape[-self.spatial_dims :]
        for i, projection in enumerate(self.projections):
            n = spatial[i]
            position = torch.arange(n, dtype=x.dtype, device=x.device) / n
            features = self._features(position)  # (N_i, F)
            term = projection(features).transpose(0, 1)  # (C, N_i)
            shape = [1, term.shape[0]] + [1] * self.spatial_dims
            shape[2 + i] = n
            x = x + term.reshape(shape)
        return x

    def _features(self, position: torch.Tensor) -> torch.Tensor:
        if self.kind == "linear":
            return position[:, None]
        angle = 2 * math.pi * position
        return torch.stack([torch.sin(angle), torch.cos(angle)], dim=1)
