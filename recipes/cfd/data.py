"""The CFD recipe's data: vorticity pairs (t, t + 1), normalised, in each rank's slab.

The trajectories are read from the user's file, or generated on first use (rank 0, then every
rank waits; ``trajectories.py``). Each rank reads
only its slab of every sample (``shardsci.data``); the normalisation statistics come from the
training trajectories, combined without gathering any field. Without a domain decomposition
the samples are read whole and used as plain tensors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig

from shardsci import ShardTensor
from shardsci.data import NextStepPairs, ShardedHDF5Field
from shardsci.recipes.cfd import trajectories
from shardsci.training import ParallelLayout

__all__ = ["CFDData"]

_DATASET_DIMS = {"H": 2, "W": 3}  # vorticity is (trajectory, time, H, W)


class CFDData:
    """Training, held-out and rollout batches of shape ``(N, 1, H, W)``, normalised.

    Parameters
    ----------
    config : DictConfig
        The ``data`` group (``recipes/cfd/config.py``).
    layout : ParallelLayout
        Which ranks share a batch part (data parallel) and which split its cells.
    train_cfg : DictConfig
        ``global_batch``, ``seed``.
    eval_samples : int or None
        Held-out pairs of ``eval_batch``; None: every one.
    device : torch.device
    """

    def __init__(
        self,
        config: DictConfig,
        layout: ParallelLayout,
        train_cfg: DictConfig,
        eval_samples: int | None,
        device: torch.device,
    ):
        if dist.get_rank() == 0:
            trajectories.prepare(config)
        dist.barrier()
        stored = trajectories.read(Path(config.path))
        self.layout = layout
        self.device = device
        self.train_trajectories = range(stored.n_train)
        self.test_trajectories = list(range(stored.n_train, stored.n_train + stored.n_test))
        self.n_times = stored.n_snapshots
        self.sharded = layout.domain_mesh is not None
        shard_dims = (
            {axis: _DATASET_DIMS[layout.config.domain[axis]] for axis in layout.domain_axes}
            if self.sharded
            else {}
        )
        self.field = ShardedHDF5Field(
            config.path,
            "vorticity",
            layout.domain_mesh if self.sharded else layout.mesh,
            shard_dims,
            index_dims=2,
            dtype=torch.float32,
        )
        every_snapshot = [(b, t) for b in self.train_trajectories for t in range(self.n_times)]
        statistics = self.field.statistics(every_snapshot)
        self.mean, self.std = float(statistics.mean), float(statistics.std)
        self.pairs = NextStepPairs.on_mesh(
            layout.mesh,
            layout.config.data_parallel,
            trajectories=tuple(self.train_trajectories),
            n_times=self.n_times,
            global_batch=train_cfg.global_batch,
            seed=train_cfg.seed,
        )
        self.eval_samples = eval_samples
        self.cells_per_sample = stored.height * stored.width

    # ------------------------------------------------------------------ batches
    def train_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.pairs.batch(step).read(self.field)
        return self._prepared(inputs), self._prepared(targets)

    def eval_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This data-parallel rank's share of the held-out pairs (all of them, or evenly spread
        over the test trajectories and times; the same every evaluation)."""
        pairs = [(b, t) for b in self.test_trajectories for t in range(self.n_times - 1)]
        count = len(pairs) if self.eval_samples is None else min(self.eval_samples, len(pairs))
        chosen = np.linspace(0, len(pairs) - 1, count).astype(int)
        mine = [pairs[i] for i in chosen[self.layout.dp_rank :: self.layout.dp_size]]
        inputs, targets = self.field.read_many(mine, [(b, t + 1) for b, t in mine])
        return self._prepared(inputs), self._prepared(targets)

    def rollout_batch(self, steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """This rank's share of the test trajectories, from the middle snapshot, and the
        ``steps`` true snapshots that follow it."""
        start = min(self.n_times // 2, self.n_times - 1 - steps)
        mine = self.test_trajectories[self.layout.dp_rank :: self.layout.dp_size]
        times = [[(b, start + k) for b in mine] for k in range(steps + 1)]
        fields = [self._prepared(f) for f in self.field.read_many(*times)]
        return fields[0], fields[1:]

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
