"""The CFD recipe's data: vorticity pairs (t, t + 1), normalised, in each rank's slab.

The trajectories are read from the user's file, or from ours, generated before (``Recipe.prepare``
on rank 0: ``trajectories.prepare``). Each rank reads only its slab of every sample
(``shardsci.data``); the normalisation statistics come from the training trajectories, combined
without gathering any field. Without a domain decomposition the samples are read whole and used
as plain tensors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig

from shardsci import ShardTensor
from shardsci.data import HeldOutPairs, NextStepPairs, ShardedHDF5Field
from shardsci.recipes.cfd import trajectories
from shardsci.recipes.cfd.generate import DATASET_NAME
from shardsci.training import RunContext

__all__ = ["FIELD_DIMS", "CFDData"]

DATASET_DIMS = ("trajectory", "time", "H", "W")
"""Dims of the ``vorticity`` dataset."""

FIELD_DIMS = ("N", "C", "H", "W")
"""Dims of a batch of vorticity fields, as ``CFDData`` makes them."""


class CFDData:
    """Training, held-out and rollout batches of shape ``(N, 1, H, W)``, normalised, on
    ``run.device``.

    Parameters
    ----------
    cfg : DictConfig
        The run config: ``data`` (``recipes/cfd/config.py``), ``train.global_batch``,
        ``train.seed``, ``eval.samples`` (held-out pairs of ``eval_batch``; None: every one).
    run : RunContext
        This rank's place in the run: which ranks share a batch part (data parallel) and which
        split its cells.
    """

    def __init__(self, cfg: DictConfig, run: RunContext):
        stored = trajectories.read(Path(cfg.data.path))
        parallelism = run.parallelism
        self.device = run.device
        self.train_trajectories = range(stored.n_train)
        self.test_trajectories = list(range(stored.n_train, stored.n_train + stored.n_test))
        self.n_times = stored.n_snapshots
        self.sharded = parallelism.domain_mesh is not None
        self.field = ShardedHDF5Field(
            cfg.data.path,
            DATASET_NAME,
            parallelism.domain_mesh if self.sharded else parallelism.mesh,
            parallelism.split_dims(DATASET_DIMS) if self.sharded else {},
            index_dims=2,
            dtype=torch.float32,
        )
        every_snapshot = [(b, t) for b in self.train_trajectories for t in range(self.n_times)]
        statistics = self.field.statistics(every_snapshot)
        self.mean, self.std = float(statistics.mean), float(statistics.std)
        dp = {"dp_rank": parallelism.dp_rank, "dp_size": parallelism.dp_size}
        self.pairs = NextStepPairs(
            tuple(self.train_trajectories),
            self.n_times,
            cfg.train.global_batch,
            cfg.train.seed,
            **dp,
        )
        self.held_out = HeldOutPairs(tuple(self.test_trajectories), self.n_times, **dp)
        self.eval_samples = cfg.eval.samples
        self.cells_per_sample = stored.height * stored.width

    # ------------------------------------------------------------------ batches
    def train_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.pairs.batch(step).read(self.field)
        return self._prepared(inputs), self._prepared(targets)

    def eval_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This data-parallel rank's share of the held-out pairs (``HeldOutPairs.pairs``)."""
        mine = self.held_out.pairs(self.eval_samples)
        inputs, targets = self.field.read_many(mine, _later(mine, 1))
        return self._prepared(inputs), self._prepared(targets)

    def rollout_batch(self, steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """This rank's share of the test trajectories, from the middle snapshot, and the
        ``steps`` true snapshots that follow it (``HeldOutPairs.rollout_starts``)."""
        starts = self.held_out.rollout_starts(steps)
        fields = self.field.read_many(*(_later(starts, k) for k in range(steps + 1)))
        prepared = [self._prepared(f) for f in fields]
        return prepared[0], prepared[1:]

    # ------------------------------------------------------------------ units
    def denormalize(self, t: torch.Tensor) -> torch.Tensor:
        return t * self.std + self.mean

    def _prepared(self, samples: ShardTensor) -> torch.Tensor:
        """``(N, H, W)`` samples -> normalised ``(N, 1, H, W)`` on the device; plain tensors
        when the fields are not split."""
        fields = ((samples - self.mean) / self.std).unsqueeze(1)
        if not self.sharded:
            fields = fields.to_local()
        return fields.to(self.device)


def _later(pairs: np.ndarray, steps: int) -> np.ndarray:
    """(trajectory, time) pairs ``(S, 2)`` moved ``steps`` snapshots later."""
    return pairs + np.array([0, steps])
