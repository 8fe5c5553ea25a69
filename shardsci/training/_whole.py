"""A small result of a sharded computation as a plain tensor, the same on every rank."""

from __future__ import annotations

import torch

from shardsci.tensor import ShardTensor

__all__ = ["whole_tensor"]


def whole_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if it is a plain tensor; a ShardTensor's global value otherwise.

    Gathers every shard onto every rank: for small results only (a loss term, per-sample
    errors ``(N,)``, a slice to plot), never for a field.
    """
    return t.full_tensor() if isinstance(t, ShardTensor) else t
