"""The CFD recipe's run: learn the next vorticity field of 2-D Navier-Stokes, domain-parallel.

Every rank runs ``run(cfg)``. The mesh (``cfg.mesh``) puts data parallelism on one axis and
splits the fields' H (and W) over the others: each rank reads only its slab of every sample
from HDF5 and the model (``cfg.model``, a plain module of ``models/``) runs on ShardTensors.
``shardsci.training.Trainer`` runs the loop; this file says what a batch, the loss and an
evaluation are: the held-out one-step relative L2 error beside the persistence baseline
(predicting no change), a rollout, and a PNG of a held-out rollout: prediction, truth, error
and the error at every step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from shardsci import ShardTensor
from shardsci.recipes.cfd.data import CFDData
from shardsci.recipes.cfd.evaluate import relative_l2, rollout
from shardsci.recipes.cfd.plots import save_rollout
from shardsci.training import RunContext, Trainer, dp_sample_mean, instantiate, start_run

__all__ = ["run"]

FIELD = "vorticity"


def run(cfg: DictConfig) -> dict[str, float]:
    """Train on this rank's part of the mesh; returns the final metrics (on every rank)."""
    with start_run(cfg) as context:
        data = CFDData(cfg.data, context.layout, cfg.train, cfg.eval.samples, context.device)
        model = instantiate(cfg.model).to(context.device)
        task = NextStep(data, context, cfg.eval.rollout_steps)
        return Trainer(context, cfg, model, task).fit()


class NextStep:
    """The task: predict the vorticity one record interval ahead (see ``Task``)."""

    def __init__(self, data: CFDData, context: RunContext, rollout_steps: int):
        self.data = data
        self.context = context
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
        data, layout = self.data, self.context.layout
        inputs, targets = data.eval_batch()
        errors = relative_l2(data.denormalize(model(inputs)), data.denormalize(targets))
        persistence = relative_l2(data.denormalize(inputs), data.denormalize(targets))
        start, truths = data.rollout_batch(self.rollout_steps)
        states = rollout(model, start, len(truths))
        physical = [(data.denormalize(s), data.denormalize(t)) for s, t in zip(states, truths)]
        rollout_errors = [relative_l2(s, t) for s, t in physical]
        rollout_mean = [dp_sample_mean(e, layout) for e in rollout_errors]
        held_still = [
            dp_sample_mean(relative_l2(data.denormalize(start), t), layout) for _, t in physical
        ]
        self._plot(physical, rollout_errors, rollout_mean, held_still, step)
        return {
            "eval_relative_l2": dp_sample_mean(errors, layout),
            "persistence_relative_l2": dp_sample_mean(persistence, layout),
            **{f"rollout_relative_l2_step{k + 1}": e for k, e in enumerate(rollout_mean)},
            f"persistence_rollout_relative_l2_step{len(truths)}": held_still[-1],
        }

    def describe(self, metrics: Mapping[str, Any]) -> str:
        rollout = [v for k, v in metrics.items() if k.startswith("rollout")]
        return (
            f"step {metrics['step']}: held-out relative L2 {metrics['eval_relative_l2']:.4f} "
            f"(persistence {metrics['persistence_relative_l2']:.4f}), "
            f"rollout {' '.join(f'{v:.3f}' for v in rollout)}"
        )

    def _plot(
        self,
        physical: list[tuple[torch.Tensor, torch.Tensor]],
        rollout_errors: list[torch.Tensor],
        rollout_mean: list[float],
        held_still: list[float],
        step: int,
    ) -> None:
        """The rollout of the first held-out trajectory (this run's first PNG shows it)."""
        fields = [(s[:1, 0], t[:1, 0]) for s, t in physical]
        if fields and isinstance(fields[0][0], ShardTensor):
            fields = [(s.full_tensor(), t.full_tensor()) for s, t in fields]
        if not self.context.leader or not fields:
            return
        steps = len(fields)
        sample = [float(e[0]) for e in rollout_errors]
        save_rollout(
            self.context.run_dir / f"eval_step{step:06d}.png",
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
