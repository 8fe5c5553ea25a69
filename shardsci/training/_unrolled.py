"""Training on rollouts: the loss of a model unrolled over several records (``train.rollout``).

NOTE [Unrolled training]
A next-step model trained on one-step pairs only ever sees true fields as inputs; rolled out,
it is fed its own predictions, whose errors it was never trained on, and they grow. Training
on a k-step rollout from a true field ``x_t`` to the true ``x_{t+1} ... x_{t+k}`` shows the
model its own errors. ``train.rollout.gradient`` says how:

- ``all``: the mean of the k one-step losses, ``mean_j loss(f^j(x_t), x_{t+j})``, with the
  gradient through every step (backpropagation through the k forward passes: k times a
  step's activations are held);
- ``last`` (the pushforward trick of Brandstetter, Worrall and Welling, "Message passing
  neural PDE solvers", 2022): the first k - 1 steps run without gradient, and the loss is
  the last step's, ``loss(f(stop_grad(f^{k-1}(x_t))), x_{t+k})``; one step's activations, and
  the model learns to correct the distribution of inputs its own rollout produces.

``steps=1`` is one-step training, either way. The loss is the recipe's (its units and its
normalisation); only the unrolling is here, so every recipe gets the same two modes.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["RolloutConfig", "RolloutGradient", "unrolled_loss"]


class RolloutGradient(enum.Enum):
    """Which steps of a training rollout carry gradient (NOTE [Unrolled training])."""

    all = "all"
    """Every step; the loss is the mean of the steps' losses."""
    last = "last"
    """Only the last (pushforward); the loss is the last step's."""


@dataclass
class RolloutConfig:
    """Training on rollouts (``train.rollout``, NOTE [Unrolled training]).

    Attributes
    ----------
    steps : int
        Records each training sample is unrolled over (1: one-step training). The recipe
        checks that its trajectories are long enough.
    gradient : RolloutGradient
        ``all`` (backpropagation through every step) or ``last`` (pushforward).
    """

    steps: int = 1
    gradient: RolloutGradient = RolloutGradient.all

    def check(self) -> None:
        """Raise ``ValueError`` naming a setting out of range."""
        if self.steps < 1:
            raise ValueError(f"train.rollout.steps={self.steps}: expected an integer >= 1")


def unrolled_loss(
    advance: Callable[[torch.Tensor], torch.Tensor],
    start: torch.Tensor,
    truths: Sequence[torch.Tensor],
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    gradient: RolloutGradient,
) -> torch.Tensor:
    """The loss of ``advance`` rolled out from ``start`` over ``truths`` (NOTE [Unrolled
    training]).

    Parameters
    ----------
    advance : callable
        One step of the model: a state to the next, ``(N, ...) -> (N, ...)``.
    start : Tensor
        The true state at t.
    truths : sequence of Tensor
        The true states at t + 1, ..., t + k (k >= 1), each as ``advance``'s output.
    loss : callable
        ``loss(prediction, truth)``, a scalar.
    gradient : RolloutGradient

    Returns
    -------
    Tensor
        A scalar: the mean of the k steps' losses (``all``) or the last step's (``last``),
        laid out as ``loss``'s (a ShardTensor's pending sum over ranks stays pending).
    """
    if not truths:
        raise ValueError("unrolled_loss needs at least one true state after the start")
    state = start
    if gradient is RolloutGradient.last:
        with torch.no_grad():
            for _ in truths[:-1]:
                state = advance(state)
        return loss(advance(state), truths[-1])
    total = None
    for truth in truths:
        state = advance(state)
        step_loss = loss(state, truth)
        # Not sum(): 0 + a pending sum over ranks (Partial) would all-reduce it at every step.
        total = step_loss if total is None else total + step_loss
    return total / len(truths)
