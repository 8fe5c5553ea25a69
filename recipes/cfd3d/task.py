"""The 3-D CFD recipe's task: predict the velocity one record interval ahead, domain-parallel
over D, H and W (``shardsci.training.NextStepProblem``: the batches of this rank's block, the
mean squared error, the held-out one-step error against persistence, a rollout and its PNG of
the mid-plane x = 1/2), each training batch mapped by a random symmetry of the box
(``data.augment``, ``symmetry.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from omegaconf import DictConfig

from shardsci.recipes.cfd3d.data import TRAJECTORIES
from shardsci.recipes.cfd3d.symmetry import BoxSymmetry, box_symmetries
from shardsci.training import NextStepFields, NextStepProblem, NextStepTask, PredictTask, RunContext

__all__ = ["VELOCITY", "next_step", "predict", "prepare", "random_next_step"]


def _mid_plane(fields: torch.Tensor) -> torch.Tensor:
    """``(N, 3, D, H, W) -> (N, H, W)``: u_x on the plane x = 1/2 (D is x). A select of one
    plane: on a field split along D only the ranks holding it contribute, and the plane keeps
    the H and W split."""
    return fields[:, 0, fields.shape[2] // 2]


VELOCITY = NextStepProblem(TRAJECTORIES, _mid_plane, "u_x on the plane x = 1/2")
"""The recipe's next-step problem."""


class AugmentedNextStepTask(NextStepTask):
    """``NextStepTask`` whose training batch ``step`` is mapped, inputs and targets alike, by
    one of the box's symmetries, drawn from ``(train.seed, step)``: the same on every rank and
    on a resumed run. The symmetry acts on the fields in the data's units (a reflection
    negates a component, so it must not see a normalised field with a nonzero mean)."""

    def __init__(self, task: NextStepTask, seed: int) -> None:
        super().__init__(task.problem, task.data, task.run, task.rollout_steps, task.training)
        if not isinstance(task.data, NextStepFields):
            raise TypeError(f"augmentation needs the data's fields, got {type(task.data)}")
        self.seed = seed
        self.symmetries = box_symmetries(task.data.field.shape[-3:])

    def symmetry(self, step: int) -> BoxSymmetry:
        """The symmetry of training batch ``step``."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return self.symmetries[int(torch.randint(len(self.symmetries), (), generator=generator))]

    def batch(self, step: int) -> tuple[torch.Tensor, ...]:
        symmetry, normalization = self.symmetry(step), self.data.normalization
        return tuple(
            normalization.normalize(symmetry(normalization.denormalize(fields)))
            for fields in super().batch(step)
        )


def next_step(cfg: DictConfig, run: RunContext) -> NextStepTask:
    """The task on this rank's part of the data (``Recipe.task``), augmented by the box's
    symmetries unless ``data.augment=false``."""
    task = VELOCITY.task(cfg, run)
    return AugmentedNextStepTask(task, cfg.train.seed) if cfg.data.augment else task


def random_next_step(cfg: DictConfig, run: RunContext) -> NextStepTask:
    """The task on random fields of the data's shapes and layouts (``Recipe.dry_run_task``)."""
    return VELOCITY.random_task(cfg, run)


def prepare(cfg: DictConfig) -> None:
    """Generate the run's data file if it must (``Recipe.prepare``, on rank 0)."""
    VELOCITY.prepare(cfg)


def predict(cfg: DictConfig, run: RunContext, state: Mapping[str, Any]) -> PredictTask:
    """The prediction's task (``Recipe.predict_task``), its truth generated first if need be."""
    return VELOCITY.predict_task(cfg, run, state)
