"""The CFD recipe's run: learn the next vorticity field of 2-D Navier-Stokes, domain-parallel.

Every rank runs ``run(cfg)``. The mesh (``cfg.mesh``) puts data parallelism on one axis and
splits the fields' H (and W) over the others: each rank reads only its slab of every sample
from HDF5 and the model (``cfg.model``, a plain module of ``models/``) runs on ShardTensors.
``shardsci.training.Trainer`` runs the loop; this file says what a batch, the loss and an
evaluation are: the held-out one-step relative L2 error beside the persistence baseline
(predicting no change), a rollout, and a PNG of prediction, truth and error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from recipes.cfd.data import CFDData
from recipes.cfd.evaluate import relative_l2, rollout_errors
from recipes.cfd.plots import save_comparison
from shardsci import ShardTensor
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
        prediction = model(inputs)
        errors = relative_l2(data.denormalize(prediction), data.denormalize(targets))
        persistence = relative_l2(data.denormalize(inputs), data.denormalize(targets))
        start, truths = data.rollout_batch(self.rollout_steps)
        rollout = rollout_errors(model, start, truths, data.denormalize)
        self._plot(prediction, targets, step, float(errors[0]) if errors.numel() else math.nan)
        return {
            "eval_relative_l2": dp_sample_mean(errors, layout),
            "persistence_relative_l2": dp_sample_mean(persistence, layout),
            **{
                f"rollout_relative_l2_step{k + 1}": dp_sample_mean(e, layout)
                for k, e in enumerate(rollout)
            },
        }

    def describe(self, metrics: Mapping[str, Any]) -> str:
        rollout = [v for k, v in metrics.items() if k.startswith("rollout")]
        return (
            f"step {metrics['step']}: held-out relative L2 {metrics['eval_relative_l2']:.4f} "
            f"(persistence {metrics['persistence_relative_l2']:.4f}), "
            f"rollout {' '.join(f'{v:.3f}' for v in rollout)}"
        )

    def _plot(
        self, prediction: torch.Tensor, targets: torch.Tensor, step: int, error: float
    ) -> None:
        first_prediction = self.data.denormalize(prediction[:1])
        first_truth = self.data.denormalize(targets[:1])
        if isinstance(first_prediction, ShardTensor):
            first_prediction = first_prediction.full_tensor()
            first_truth = first_truth.full_tensor()
        if self.context.leader:
            save_comparison(
                self.context.run_dir / f"eval_step{step:06d}.png",
                first_prediction[0, 0],
                first_truth[0, 0],
                f"step {step}: held-out sample, relative L2 {error:.3g}",
            )
