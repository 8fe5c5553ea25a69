"""Held-out errors: one-step relative L2 and a multi-step rollout.

Written with plain torch ops, so they run unchanged on ShardTensors (sums over sharded dims
become cross-rank reductions) and on whole tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from shardsci import ShardTensor

__all__ = ["relative_l2", "rollout"]


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, ShardTensor) else t


def relative_l2(prediction: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """Per-sample ``||prediction - truth||_2 / ||truth||_2`` over all but the first dim.

    Returns
    -------
    Tensor
        ``(N,)``, the same on every rank.
    """
    dims = tuple(range(1, prediction.ndim))
    error = ((prediction - truth) ** 2).sum(dims)
    norm = (truth**2).sum(dims)
    return _whole((error / norm).sqrt())


@torch.no_grad()
def rollout(model: nn.Module, start: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Feed the model its own predictions for ``steps`` steps from ``start``.

    Parameters
    ----------
    start : Tensor
        ``(N, C, H, W)`` normalised fields at the first time.

    Returns
    -------
    list of Tensor
        The ``steps`` predicted ``(N, C, H, W)`` fields, laid out as ``start``.
    """
    states = [start]
    for _ in range(steps):
        states.append(model(states[-1]))
    return states[1:]
