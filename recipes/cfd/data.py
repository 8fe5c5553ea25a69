"""The CFD recipe's data: the vorticity file's trajectories as next-step pairs (t, t + 1),
normalised, in each rank's slab (``shardsci.training.NextStepFields``).

The trajectories are read from the user's file, or from ours, generated before (``Recipe.prepare``
on rank 0: ``trajectories.prepare``); the file's attributes say which are held out.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from shardsci.recipes.cfd import trajectories
from shardsci.recipes.cfd.generate import DATASET_NAME
from shardsci.training import NextStepFields, RandomFields, RunContext

__all__ = ["DATASET_DIMS", "FIELD_DIMS", "random_vorticity", "vorticity"]

DATASET_DIMS = ("trajectory", "time", "H", "W")
"""Dims of the ``vorticity`` dataset."""

FIELD_DIMS = ("N", "C", "H", "W")
"""Dims of a batch of vorticity fields."""


def vorticity(cfg: DictConfig, run: RunContext) -> NextStepFields:
    """Batches of shape ``(N, 1, H, W)`` of the run's data file, on ``run.device``."""
    stored = trajectories.read(Path(cfg.data.path))
    return NextStepFields(
        run,
        cfg.data.path,
        DATASET_NAME,
        DATASET_DIMS,
        train=range(stored.n_train),
        test=range(stored.n_train, stored.n_train + stored.n_test),
        global_batch=cfg.train.global_batch,
        seed=cfg.train.seed,
        eval_samples=cfg.eval.samples,
    )


def random_vorticity(cfg: DictConfig, run: RunContext) -> RandomFields:
    """Random batches of the shapes and layouts ``vorticity`` makes, for a dry run."""
    n = cfg.data.dataset.solver.resolution
    return RandomFields(run, (1, n, n), FIELD_DIMS, int(cfg.train.global_batch))
