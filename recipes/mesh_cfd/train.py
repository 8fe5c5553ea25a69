"""The mesh CFD recipe's run: learn the next velocity of flow past cylinders on a triangle mesh.

Every rank runs ``run(cfg)``. The graph is split over the mesh's domain axis (``mesh=N``, or
``mesh=DxN parallel=auto`` with data parallelism on the other axis): each rank reads only its
nodes' rows of the fields, and the model (``cfg.model``, a plain module of ``models/``) runs on
the partitioned graph's ShardTensors unchanged. ``shardsci.training.Trainer`` runs the loop;
this file says what a batch, the loss and an evaluation are: the held-out one-step relative L2
error of the velocity beside the persistence baseline (predicting no change), a rollout, and a
PNG of the predicted cross-stream velocity drawn on the mesh.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from recipes.mesh_cfd.data import Batch, MeshData
from recipes.mesh_cfd.plots import save_mesh_comparison
from shardsci import ShardTensor
from shardsci.training import RunContext, Trainer, dp_sample_mean, instantiate, start_run

__all__ = ["run"]


def run(cfg: DictConfig) -> dict[str, float]:
    """Train on this rank's part of the mesh; returns the final metrics (on every rank)."""
    with start_run(cfg) as context:
        data = MeshData(cfg.data, context.layout, cfg.train, context.device)
        model = instantiate(cfg.model).to(context.device)
        task = NextVelocity(data, context, cfg.eval.samples, cfg.eval.rollout_steps)
        return Trainer(context, cfg, model, task).fit()


def relative_l2(prediction: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """Per-sample ``||prediction - truth|| / ||truth||`` of node fields ``(N, B, C)`` over
    nodes and components: ``(B,)``, the same on every rank."""
    error = (prediction - truth).square().sum((0, 2))
    norm = truth.square().sum((0, 2))
    ratio = (error / norm).sqrt()
    return ratio.full_tensor() if isinstance(ratio, ShardTensor) else ratio


class NextVelocity:
    """The task: predict the velocity one record interval ahead (see ``Task``)."""

    def __init__(self, data: MeshData, context: RunContext, samples: int, rollout_steps: int):
        self.data = data
        self.context = context
        self.samples = samples
        self.rollout_steps = rollout_steps
        self.cells_per_sample = data.cells_per_sample

    def batch(self, step: int) -> Batch:
        return self.data.train_batch(step)

    def losses(self, model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
        inputs, change = batch
        return {"velocity": F.mse_loss(model(*inputs).float(), change)}

    def evaluate(self, model: nn.Module, step: int) -> dict[str, float]:
        data, layout = self.data, self.context.layout
        pairs = data.eval_pairs(self.samples)
        now, after = data.velocities(pairs, 1)
        prediction = data.advanced(now, model(*data.inputs(now)))
        errors = relative_l2(prediction, after)
        persistence = relative_l2(now, after)
        middle = min(data.n_times // 2, data.n_times - 1 - self.rollout_steps)
        starts = [(b, middle) for b in data.test_trajectories[layout.dp_rank :: layout.dp_size]]
        truths = data.velocities(starts, self.rollout_steps)
        state, rollout = truths[0], []
        for truth in truths[1:]:
            state = data.advanced(state, model(*data.inputs(state)))
            rollout.append(relative_l2(state, truth))
        self._plot(prediction, after, step, float(errors[0]) if errors.numel() else float("nan"))
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

    def _plot(self, prediction: torch.Tensor, truth: torch.Tensor, step: int, error: float) -> None:
        """The cross-stream velocity v of this replica's first held-out sample."""
        if prediction.shape[1] == 0:
            return
        predicted_v = self.data.in_original_order(prediction[:, 0, 1])
        true_v = self.data.in_original_order(truth[:, 0, 1])
        if self.context.leader:
            save_mesh_comparison(
                self.context.run_dir / f"eval_step{step:06d}.png",
                self.data.positions,
                self.data.triangles,
                predicted_v,
                true_v,
                f"step {step}: held-out cross-stream velocity v, relative L2 of (u, v) {error:.3g}",
            )
