"""The CFD recipe's task: predict the vorticity one record interval ahead, domain-parallel.

``shardsci.training`` runs it (``train_recipe``: the mesh, the model ``cfg.model``, the loop);
this file says what a batch, the loss and an evaluation are: the held-out one-step relative L2
error beside the persistence baseline (predicting no change), a rollout, and a PNG of a held-out
rollout: prediction, truth, error and the error at every step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from shardsci.recipes.cfd.data import random_vorticity, vorticity
from shardsci.recipes.cfd.plots import save_rollout
from shardsci.training import (
    NextStepFields,
    RandomFields,
    RunContext,
    describe_forecast,
    dp_sample_mean,
    relative_l2,
    rollout,
    whole_tensor,
)

__all__ = ["NextStep", "next_step", "random_next_step"]

FIELD = "vorticity"


def next_step(cfg: DictConfig, run: RunContext) -> NextStep:
    """The task on this rank's part of the data (``Recipe.task``)."""
    return NextStep(vorticity(cfg, run), run, cfg.eval.rollout_steps)


def random_next_step(cfg: DictConfig, run: RunContext) -> NextStep:
    """The task on random fields of the data's shapes and layouts (``Recipe.dry_run_task``)."""
    return NextStep(random_vorticity(cfg, run), run, cfg.eval.rollout_steps)


class NextStep:
    """The task: predict the vorticity one record interval ahead (see ``Task``)."""

    def __init__(self, data: NextStepFields | RandomFields, run: RunContext, rollout_steps: int):
        self.data = data
        self.run = run
        self.rollout_steps = rollout_steps
        self.cells_per_sample = data.cells_per_sample

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data.train_batch(step)

    def losses(
        self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        inputs, targets = batch
        return {FIELD: F.mse_loss(model(inputs).float(), targets)}

    def evaluate(self, model: nn.Module, step: int) -> dict[str, float]:
        data, parallelism = self.data, self.run.parallelism
        inputs, targets = data.eval_batch()
        errors = relative_l2(data.denormalize(model(inputs)), data.denormalize(targets))
        persistence = relative_l2(data.denormalize(inputs), data.denormalize(targets))
        start, truths = data.rollout_batch(self.rollout_steps)
        states = rollout(model, start, len(truths))
        physical = [(data.denormalize(s), data.denormalize(t)) for s, t in zip(states, truths)]
        rollout_errors = [relative_l2(s, t) for s, t in physical]
        rollout_mean = [dp_sample_mean(e, parallelism) for e in rollout_errors]
        held_still = [
            dp_sample_mean(relative_l2(data.denormalize(start), t), parallelism)
            for _, t in physical
        ]
        self._plot(physical, rollout_errors, rollout_mean, held_still, step)
        return {
            "eval_relative_l2": dp_sample_mean(errors, parallelism),
            "persistence_relative_l2": dp_sample_mean(persistence, parallelism),
            **{f"rollout_relative_l2_step{k + 1}": e for k, e in enumerate(rollout_mean)},
            f"persistence_rollout_relative_l2_step{len(truths)}": held_still[-1],
        }

    def describe(self, metrics: Mapping[str, Any]) -> str:
        return describe_forecast(metrics)

    def _plot(
        self,
        physical: list[tuple[torch.Tensor, torch.Tensor]],
        rollout_errors: list[torch.Tensor],
        rollout_mean: list[float],
        held_still: list[float],
        step: int,
    ) -> None:
        """The rollout of the first held-out trajectory (this run's first PNG shows it)."""
        fields = [(whole_tensor(s[:1, 0]), whole_tensor(t[:1, 0])) for s, t in physical]
        if not self.run.leader or not fields:
            return
        steps = len(fields)
        sample = [float(e[0]) for e in rollout_errors]
        save_rollout(
            self.run.run_dir / f"eval_step{step:06d}.png",
            torch.cat([s for s, _ in fields]),
            torch.cat([t for _, t in fields]),
            {
                "this trajectory": sample,
                "held-out mean": rollout_mean,
                "persistence (held-out mean)": held_still,
            },
            f"training step {step}: a {steps}-step rollout of held-out trajectory "
            f"{self.data.test_trajectories[0]} (relative L2 {sample[0]:.3g} after 1 step, "
            f"{sample[-1]:.3g} after {steps})",
        )
