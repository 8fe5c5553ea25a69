"""One training step's tensor work, the same in a run and in a dry run.

NOTE [One training step]
``training_step`` is all a training step does to tensors: this rank's batch, the forward pass
under autocast, the loss terms as whole scalars, ``zero_grad``, the backward pass and, when the
caller's ``decide(terms)`` allows it, gradient clipping and the optimiser step. ``Trainer`` calls
it with a ``decide`` that agrees on the mean loss and on stop signals over all ranks (one
all-reduce of a few scalars) and refuses the update of a non-finite loss; the dry run
(``shardsci.planning``) calls it with none. So the step a dry run plans is the step a run takes,
and ``tests/test_training_step.py`` checks that the two are the same function and give the same
parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from shardsci.training._precision import Precision, autocast
from shardsci.training._whole import whole_tensor

__all__ = ["Task", "training_step"]


class Task(Protocol):
    """What a recipe gives the ``Trainer``: batches, a loss, an evaluation."""

    cells_per_sample: int
    """Grid cells (or mesh nodes) of one sample, for the throughput figure."""

    def batch(self, step: int) -> Any:
        """This rank's part of global batch ``step`` (a pure function of the step, so that a
        resumed run sees the batches an uninterrupted one would)."""

    def losses(self, model: nn.Module, batch: Any) -> Mapping[str, torch.Tensor]:
        """The loss of ``model`` on ``batch``, one scalar term per named output field; the
        trainer minimises their sum. ShardTensor terms are fine."""

    def evaluate(self, model: nn.Module, step: int) -> dict[str, float]:
        """Metrics of ``model`` (unwrapped, in eval mode, without gradients), equal on every
        rank; may write files (plots) on the leader."""

    def describe(self, metrics: Mapping[str, Any]) -> str:
        """One line for people about ``metrics`` (from ``evaluate``)."""


def training_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    task: Task,
    step: int,
    precision: Precision,
    grad_clip: float | None,
    device: torch.device,
    decide: Callable[[Mapping[str, torch.Tensor]], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """One optimiser step of ``model`` on ``task``'s batch ``step`` (NOTE [One training step]).

    Parameters
    ----------
    precision : Precision
        Autocast of the forward pass.
    grad_clip : float or None
        Clip the global gradient norm to this value.
    device : torch.device
        The device autocast acts on.
    decide : callable, optional
        ``decide(terms)``, called after the backward pass: whether to apply the update.

    Returns
    -------
    dict
        The loss terms, whole float32 scalars (the same on every rank of a replica).
    """
    batch = task.batch(step)
    with autocast(precision, device):
        terms = task.losses(model, batch)
    terms = {name: whole_tensor(term).float() for name, term in terms.items()}
    optimizer.zero_grad(set_to_none=True)
    sum(terms.values()).backward()
    if decide is None or decide(terms):
        if grad_clip:
            nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
    return terms
