"""Small building blocks shared by the zoo's transformers."""

from __future__ import annotations

from torch import nn

__all__ = ["mlp"]


def mlp(features: int, hidden: int, out_features: int | None = None) -> nn.Sequential:
    """``Linear -> GELU -> Linear`` over the last dim: ``features -> hidden -> out_features``
    (default ``features``)."""
    return nn.Sequential(
        nn.Linear(features, hidden), nn.GELU(), nn.Linear(hidden, out_features or features)
    )
