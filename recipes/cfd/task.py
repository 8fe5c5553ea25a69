"""The CFD recipe's task: predict the vorticity one record interval ahead, domain-parallel
(``shardsci.training.NextStepProblem``: the batches of this rank's slab, the mean squared error,
the held-out one-step error against persistence, a rollout and its PNG)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from omegaconf import DictConfig

from shardsci.recipes.cfd.data import TRAJECTORIES
from shardsci.training import NextStepProblem, NextStepTask, PredictTask, RunContext

__all__ = ["VORTICITY", "next_step", "predict", "prepare", "random_next_step"]


def _vorticity(fields: torch.Tensor) -> torch.Tensor:
    """``(N, 1, H, W) -> (N, H, W)``."""
    return fields[:, 0]


VORTICITY = NextStepProblem(TRAJECTORIES, _vorticity, "vorticity")
"""The recipe's next-step problem."""


def next_step(cfg: DictConfig, run: RunContext) -> NextStepTask:
    """The task on this rank's part of the data (``Recipe.task``)."""
    return VORTICITY.task(cfg, run)


def random_next_step(cfg: DictConfig, run: RunContext) -> NextStepTask:
    """The task on random fields of the data's shapes and layouts (``Recipe.dry_run_task``)."""
    return VORTICITY.random_task(cfg, run)


def prepare(cfg: DictConfig) -> None:
    """Generate the run's data file if it must (``Recipe.prepare``, on rank 0)."""
    VORTICITY.prepare(cfg)


def predict(cfg: DictConfig, run: RunContext, state: Mapping[str, Any]) -> PredictTask:
    """The prediction's task (``Recipe.predict_task``), its truth generated first if need be."""
    return VORTICITY.predict_task(cfg, run, state)
