"""The mesh CFD recipe's task: predict the velocity of flow past cylinders one record ahead,
on a triangle mesh whose graph is split over the DeviceMesh's domain axis.

``shardsci.training`` runs it (``train_recipe``: the DeviceMesh, the model ``cfg.model``, the
loop); this file says what a batch, the loss and an evaluation are: the held-out one-step
relative L2 error of the velocity beside the persistence baseline (predicting no change), a
rollout, and a PNG of the predicted cross-stream velocity drawn on the triangle mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from shardsci.recipes.mesh_cfd.data import SAMPLE_DIM, Batch, MeshData
from shardsci.recipes.mesh_cfd.plots import save_mesh_comparison
from shardsci.training import (
    RolloutConfig,
    RunContext,
    describe_forecast,
    dp_sample_mean,
    relative_l2,
    rollout,
    unrolled_loss,
)

__all__ = ["NextVelocity", "next_velocity"]


def next_velocity(cfg: DictConfig, run: RunContext) -> NextVelocity:
    """The task on this rank's part of the graph (``Recipe.task``)."""
    training = RolloutConfig(cfg.train.rollout.steps, cfg.train.rollout.gradient)
    return NextVelocity(MeshData(cfg, run), run, cfg.eval.samples, cfg.eval.rollout_steps, training)


class NextVelocity:
    """The task: predict the velocity one record interval ahead (see ``Task``); trained on
    the mean squared error of the velocity in units of the one-record change's standard
    deviation (per component), after one step or over a ``train.rollout`` (NOTE [Unrolled
    training]): after one step, the error of the model's normalised change itself."""

    def __init__(
        self,
        data: MeshData,
        run: RunContext,
        samples: int,
        rollout_steps: int,
        training: RolloutConfig,
    ):
        self.data = data
        self.run = run
        self.samples = samples
        self.rollout_steps = rollout_steps
        self.training = training
        self.cells_per_sample = data.cells_per_sample

    def batch(self, step: int) -> Batch:
        return self.data.train_batch(step)

    def losses(self, model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
        start, *truths = batch
        scale = self.data.change_std

        def loss(prediction: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
            return F.mse_loss((prediction.float() - truth) / scale, torch.zeros_like(truth))

        advance = self._advance(model)
        return {"velocity": unrolled_loss(advance, start, truths, loss, self.training.gradient)}

    def _advance(self, model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """The model as one step of node velocities ``(N, B, 2)`` in physical units."""
        data = self.data
        return lambda velocity: data.advanced(velocity, model(*data.inputs(velocity)))

    def evaluate(self, model: nn.Module, step: int) -> dict[str, float]:
        data, parallelism = self.data, self.run.parallelism
        advance = self._advance(model)

        now, after = data.velocities(data.held_out.pairs(self.samples), 1)
        prediction = advance(now)
        errors = relative_l2(prediction, after, SAMPLE_DIM)
        persistence = relative_l2(now, after, SAMPLE_DIM)
        truths = data.velocities(
            data.held_out.rollout_starts(self.rollout_steps), self.rollout_steps
        )
        states = rollout(advance, truths[0], self.rollout_steps)
        self._plot(prediction, after, step, float(errors[0]) if errors.numel() else float("nan"))
        return {
            "eval_relative_l2": dp_sample_mean(errors, parallelism),
            "persistence_relative_l2": dp_sample_mean(persistence, parallelism),
            **{
                f"rollout_relative_l2_step{k + 1}": dp_sample_mean(
                    relative_l2(state, truth, SAMPLE_DIM), parallelism
                )
                for k, (state, truth) in enumerate(zip(states, truths[1:]))
            },
        }

    def describe(self, metrics: Mapping[str, Any]) -> str:
        return describe_forecast(metrics)

    def _plot(self, prediction: torch.Tensor, truth: torch.Tensor, step: int, error: float) -> None:
        """The cross-stream velocity v of this replica's first held-out sample."""
        if prediction.shape[SAMPLE_DIM] == 0:
            return
        predicted_v = self.data.in_original_order(prediction[:, 0, 1])
        true_v = self.data.in_original_order(truth[:, 0, 1])
        if self.run.leader:
            save_mesh_comparison(
                self.run.run_dir / f"eval_step{step:06d}.png",
                self.data.positions,
                self.data.triangles,
                predicted_v,
                true_v,
                f"step {step}: held-out cross-stream velocity v, relative L2 of (u, v) {error:.3g}",
            )
