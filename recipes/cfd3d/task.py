"""The 3-D CFD recipe's task: predict the velocity one record interval ahead, domain-parallel
over D, H and W (``shardsci.training.NextStepProblem``: the batches of this rank's block, the
mean squared error, the held-out one-step error against persistence, a rollout and its PNG of
the mid-plane x = 1/2)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from omegaconf import DictConfig

from shardsci.recipes.cfd3d.data import TRAJECTORIES
from shardsci.training import NextStepProblem, NextStepTask, PredictTask, RunContext

__all__ = ["VELOCITY", "next_step", "predict", "prepare", "random_next_step"]


def _mid_plane(fields: torch.Tensor) -> torch.Tensor:
    """``(N, 3, D, H, W) -> (N, H, W)``: u_x on the plane x = 1/2 (D is x). A select of one
    plane: on a field split along D only the ranks holding it contribute, and the plane keeps
    the H and W split."""
    return fields[:, 0, fields.shape[2] // 2]


VELOCITY = NextStepProblem(TRAJECTORIES, _mid_plane, "u_x on the plane x = 1/2")
"""The recipe's next-step problem."""


def next_step(cfg: DictConfig, run: RunContext) -> NextStepTask:
    """The task on this rank's part of the data (``Recipe.task``)."""
    return VELOCITY.task(cfg, run)


def random_next_step(cfg: DictConfig, run: RunContext) -> NextStepTask:
    """The task on random fields of the data's shapes and layouts (``Recipe.dry_run_task``)."""
    return VELOCITY.random_task(cfg, run)


def prepare(cfg: DictConfig) -> None:
    """Generate the run's data file if it must (``Recipe.prepare``, on rank 0)."""
    VELOCITY.prepare(cfg)


def predict(cfg: DictConfig, run: RunContext, state: Mapping[str, Any]) -> PredictTask:
    """The prediction's task (``Recipe.predict_task``), its truth generated first if need be."""
    return VELOCITY.predict_task(cfg, run, state)
