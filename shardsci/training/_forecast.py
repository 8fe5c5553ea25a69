"""How good a next-step model is: per-sample relative L2 errors and autoregressive rollouts.

Written with plain torch ops, so they run unchanged on ShardTensors (sums over sharded dims
become cross-rank reductions) and on plain tensors. The per-sample errors are small and whole
on every rank; ``dp_sample_mean`` averages them over the global batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from shardsci.training._whole import whole_tensor

__all__ = ["describe_forecast", "relative_l2", "rollout"]


def relative_l2(prediction: torch.Tensor, truth: torch.Tensor, sample_dim: int = 0) -> torch.Tensor:
    """Per-sample ``||prediction - truth||_2 / ||truth||_2`` over every dim but ``sample_dim``.

    Parameters
    ----------
    prediction, truth : Tensor
        The same shape, e.g. fields ``(N, C, H, W)`` (``sample_dim=0``) or node values
        ``(nodes, N, C)`` (``sample_dim=1``).

    Returns
    -------
    Tensor
        ``(N,)``, a plain tensor, the same on every rank.
    """
    dims = tuple(d for d in range(prediction.ndim) if d != sample_dim)
    error = (prediction - truth).square().sum(dims)
    norm = truth.square().sum(dims)
    return whole_tensor((error / norm).sqrt())


@torch.no_grad()
def rollout(
    advance: Callable[[torch.Tensor], torch.Tensor], start: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """The states ``advance(start)``, ``advance(advance(start))``, ...: ``steps`` of them, each
    laid out as ``start``."""
    states = [start]
    for _ in range(steps):
        states.append(advance(states[-1]))
    return states[1:]


def describe_forecast(metrics: Mapping[str, Any]) -> str:
    """One line about an evaluation's ``eval_relative_l2``, ``persistence_relative_l2`` and
    ``rollout_relative_l2_step<k>`` figures."""
    steps = [v for k, v in metrics.items() if k.startswith("rollout_relative_l2")]
    return (
        f"step {metrics['step']}: held-out relative L2 {metrics['eval_relative_l2']:.4f} "
        f"(persistence {metrics['persistence_relative_l2']:.4f}), "
        f"rollout {' '.join(f'{v:.3f}' for v in steps)}"
    )
