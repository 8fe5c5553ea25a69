"""Next-step data of a field stored in HDF5 as ``(trajectory, time, [C,] *spatial)``: the
batches of a training run, its held-out pairs and rollouts, each rank reading only its slab.

A recipe that learns to advance a gridded field by one record (2-D vorticity, a 3-D velocity)
names its file, its dataset and the dataset's dims; ``NextStepFields`` does the rest the same
way for all: which part of a global batch is this replica's (``NextStepPairs``), which held-out
pairs and rollout starts (``HeldOutPairs``), the slab of every sample this rank reads
(``ShardedHDF5Field``, split as the run's ``Parallelism`` says), the normalisation statistics
of the training trajectories, combined without gathering a field. ``RandomFields`` stands in
for it in a dry run.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from shardsci.data import HeldOutPairs, NextStepPairs, ShardedHDF5Field
from shardsci.tensor import ShardTensor, ShardTensorSpec
from shardsci.training._run import RunContext

__all__ = ["CHANNELS", "NextStepFields", "RandomFields"]

CHANNELS = "C"
"""The name of a field's channel dim (absent from a dataset of a scalar field)."""

_INDEX_DIMS = ("trajectory", "time")


class NextStepFields:
    """Normalised ``(N, C, *spatial)`` fields at t and t + 1 on ``run.device``: ShardTensors
    split over the run's domain axes, plain tensors when nothing is split.

    Parameters
    ----------
    run : RunContext
    path : path
        The HDF5 file.
    dataset : str
        The dataset: ``(trajectory, time, *spatial)`` of a scalar field (read as one channel),
        or ``(trajectory, time, C, *spatial)``.
    dims : sequence of str
        The dataset's dim names, e.g. ``("trajectory", "time", "H", "W")``; the spatial ones
        are those the run's ``ParallelPlan`` may split.
    train, test : sequence of int
        The training and the held-out trajectories.
    global_batch, seed : int
        Pairs per step over all replicas; the seed of their order (``NextStepPairs``).
    eval_samples : int or None
        Held-out pairs of ``eval_batch`` (None: every one).
    """

    def __init__(
        self,
        run: RunContext,
        path: str | Path,
        dataset: str,
        dims: Sequence[str],
        train: Sequence[int],
        test: Sequence[int],
        global_batch: int,
        seed: int,
        eval_samples: int | None,
    ) -> None:
        dims = tuple(dims)
        if dims[:2] != _INDEX_DIMS:
            raise ValueError(f"dataset dims {dims}: expected {_INDEX_DIMS} first")
        parallelism = run.parallelism
        self.device = run.device
        self.sharded = parallelism.domain_mesh is not None
        self.has_channels = CHANNELS in dims
        self.field = ShardedHDF5Field(
            path,
            dataset,
            parallelism.domain_mesh if self.sharded else parallelism.mesh,
            parallelism.split_dims(dims) if self.sharded else {},
            index_dims=2,
            spatial_dims=[d for d, name in enumerate(dims) if d >= 2 and name != CHANNELS],
            dtype=torch.float32,
        )
        self.n_times = self.field.shape[1]
        self.test_trajectories = list(test)
        statistics = self.field.statistics([(b, t) for b in train for t in range(self.n_times)])
        self.mean, self.std = self._broadcastable(statistics.mean, statistics.std)
        dp = {"dp_rank": parallelism.dp_rank, "dp_size": parallelism.dp_size}
        self.pairs = NextStepPairs(tuple(train), self.n_times, global_batch, seed, **dp)
        self.held_out = HeldOutPairs(tuple(test), self.n_times, **dp)
        self.eval_samples = eval_samples
        self.cells_per_sample = int(np.prod([self.field.shape[d] for d in self.field.spatial_dims]))

    # ------------------------------------------------------------------ batches
    def train_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This replica's part of global batch ``step``: inputs and targets."""
        inputs, targets = self.pairs.batch(step).read(self.field)
        return self._prepared(inputs), self._prepared(targets)

    def eval_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This replica's share of the held-out pairs (``HeldOutPairs.pairs``)."""
        mine = self.held_out.pairs(self.eval_samples)
        inputs, targets = self.field.read_many(mine, _later(mine, 1))
        return self._prepared(inputs), self._prepared(targets)

    def rollout_batch(self, steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """This replica's share of the held-out trajectories at their rollout start and the
        ``steps`` true fields that follow it (``HeldOutPairs.rollout_starts``)."""
        starts = self.held_out.rollout_starts(steps)
        fields = self.field.read_many(*(_later(starts, k) for k in range(steps + 1)))
        prepared = [self._prepared(f) for f in fields]
        return prepared[0], prepared[1:]

    # ------------------------------------------------------------------ units
    def denormalize(self, t: torch.Tensor) -> torch.Tensor:
        """Normalised fields back in the file's units."""
        return t * self.std + self.mean

    def _prepared(self, samples: ShardTensor) -> torch.Tensor:
        """Samples as read -> normalised ``(N, C, *spatial)`` on the device; plain tensors
        when the fields are not split."""
        fields = (samples - self.mean) / self.std
        if not self.has_channels:
            fields = fields.unsqueeze(1)
        if not self.sharded:
            fields = fields.to_local()
        return fields.to(self.device)

    def _broadcastable(
        self, mean: torch.Tensor, std: torch.Tensor
    ) -> tuple[float | torch.Tensor, float | torch.Tensor]:
        """A scalar field's statistics as Python numbers; per-channel ones as ``(C, 1, ...)``
        float32 tensors that broadcast over ``(N, C, *spatial)``."""
        if not self.has_channels:
            return float(mean), float(std)
        shape = (-1,) + (1,) * len(self.field.spatial_dims)
        return mean.float().reshape(shape), std.float().reshape(shape)


class RandomFields:
    """Stands in for ``NextStepFields`` in a dry run (``Recipe.dry_run_task``): normalised
    random ``(b, *sample_shape)`` fields on ``run.device``, ``b`` the global batch over the
    data-parallel replicas (at least 1), split over the domain axes as ``NextStepFields``'
    (``torch.chunk`` shard sizes).

    Parameters
    ----------
    run : RunContext
    sample_shape : sequence of int
        ``(C, *spatial)``.
    dims : sequence of str
        The names of the batch's dims, ``("N", "C", *spatial)``.
    global_batch : int
    """

    def __init__(
        self, run: RunContext, sample_shape: Sequence[int], dims: Sequence[str], global_batch: int
    ) -> None:
        self.run = run
        self.dims = tuple(dims)
        self.shape = (max(1, global_batch // run.parallelism.dp_size), *sample_shape)
        self.cells_per_sample = int(np.prod(sample_shape[1:]))

    def train_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._field(), self._field()

    def _field(self) -> torch.Tensor:
        parallelism, device = self.run.parallelism, self.run.device
        mesh = parallelism.domain_mesh
        if mesh is None:
            return torch.randn(self.shape, device=device)
        placements = parallelism.field_placements(self.dims)
        spec = ShardTensorSpec.build(mesh, placements, self.shape, torch.float32)
        local = torch.randn(spec.local_shape(), device=device)
        return ShardTensor.from_local(local, mesh, placements, "chunk", shape=self.shape)


def _later(pairs: np.ndarray, steps: int) -> np.ndarray:
    """(trajectory, time) pairs ``(S, 2)`` moved ``steps`` snapshots later."""
    return pairs + np.array([0, steps])
