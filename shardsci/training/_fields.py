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

__all__ = ["CHANNELS", "NextStepFields", "Normalization", "RandomFields"]

CHANNELS = "C"
"""The name of a field's channel dim (absent from a dataset of a scalar field)."""

_INDEX_DIMS = ("trajectory", "time")


class Normalization:
    """The per-channel mean and standard deviation a model's fields are normalised with: the
    statistics of its training data.

    Parameters
    ----------
    mean, std : Tensor
        0-d for a scalar field stored without a channel dim, else ``(C,)``; any float dtype.
    spatial_ndim : int
        Spatial dims of the fields ``(N, C, *spatial)`` it is applied to.
    """

    def __init__(self, mean: torch.Tensor, std: torch.Tensor, spatial_ndim: int) -> None:
        self.mean_tensor = torch.as_tensor(mean, dtype=torch.float64)
        self.std_tensor = torch.as_tensor(std, dtype=torch.float64)
        self.mean, self.std = self._broadcastable(spatial_ndim)

    def normalize(self, t: torch.Tensor) -> torch.Tensor:
        """Fields in the data's units -> normalised."""
        return (t - self.mean) / self.std

    def denormalize(self, t: torch.Tensor) -> torch.Tensor:
        """Normalised fields back in the data's units."""
        return t * self.std + self.mean

    def state(self) -> dict[str, torch.Tensor]:
        """``{"mean": ..., "std": ...}`` as float64 tensors, for a checkpoint's ``extra``."""
        return {"mean": self.mean_tensor, "std": self.std_tensor}

    def _broadcastable(
        self, spatial_ndim: int
    ) -> tuple[float | torch.Tensor, float | torch.Tensor]:
        """A scalar field's statistics as Python numbers; per-channel ones as ``(C, 1, ...)``
        float32 tensors that broadcast over ``(N, C, *spatial)``."""
        if self.mean_tensor.ndim == 0:
            return float(self.mean_tensor), float(self.std_tensor)
        shape = (-1,) + (1,) * spatial_ndim
        mean, std = self.mean_tensor, self.std_tensor
        return mean.float().reshape(shape), std.float().reshape(shape)


class NextStepFields:
    """Normalised ``(N, C, *spatial)`` fields at t and t + 1 (training batches: t, t + 1, ...,
    t + ``unrolled``) on ``run.device``: ShardTensors split over the run's domain axes, plain
    tensors when nothing is split.

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
    unrolled : int
        Records after the input in each training sample (``train.rollout.steps``).
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
        unrolled: int = 1,
    ) -> None:
        dims = tuple(dims)
        if dims[:2] != _INDEX_DIMS:
            raise ValueError(f"dataset dims {dims}: expected {_INDEX_DIMS} first")
        parallelism = run.parallelism
        self.device = run.device
        self.sharded = parallelism.domain_mesh is not None
        self.has_channels = CHANNELS in dims
        self.field = trajectory_field(run, path, dataset, dims)
        self.path = Path(path)
        self.n_times = self.field.shape[1]
        self.test_trajectories = list(test)
        statistics = self.field.statistics([(b, t) for b in train for t in range(self.n_times)])
        self.normalization = Normalization(
            statistics.mean, statistics.std, len(self.field.spatial_dims)
        )
        dp = {"dp_rank": parallelism.dp_rank, "dp_size": parallelism.dp_size}
        self.unrolled = unrolled
        self.pairs = NextStepPairs(
            tuple(train), self.n_times, global_batch, seed, horizon=unrolled, **dp
        )
        self.held_out = HeldOutPairs(tuple(test), self.n_times, **dp)
        self.eval_samples = eval_samples
        self.cells_per_sample = int(np.prod([self.field.shape[d] for d in self.field.spatial_dims]))

    # ------------------------------------------------------------------ batches
    def train_batch(self, step: int) -> tuple[torch.Tensor, ...]:
        """This replica's part of global batch ``step``: the fields at t, t + 1, ...,
        t + ``unrolled`` (inputs, then targets)."""
        starts = self.pairs.batch(step).inputs
        fields = self.field.read_many(*(_later(starts, k) for k in range(self.unrolled + 1)))
        return tuple(self._prepared(f) for f in fields)

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
        return self.normalization.denormalize(t)

    def _prepared(self, samples: ShardTensor) -> torch.Tensor:
        """Samples as read -> normalised ``(N, C, *spatial)`` on the device; plain tensors
        when the fields are not split."""
        return prepared(samples, self.normalization, self.has_channels, self.sharded, self.device)


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
    unrolled : int
        Targets of a training batch (``train.rollout.steps``).
    """

    def __init__(
        self,
        run: RunContext,
        sample_shape: Sequence[int],
        dims: Sequence[str],
        global_batch: int,
        unrolled: int = 1,
    ) -> None:
        self.run = run
        self.unrolled = unrolled
        self.dims = tuple(dims)
        self.shape = (max(1, global_batch // run.parallelism.dp_size), *sample_shape)
        self.cells_per_sample = int(np.prod(sample_shape[1:]))

    def train_batch(self, step: int) -> tuple[torch.Tensor, ...]:
        return tuple(self._field() for _ in range(self.unrolled + 1))

    def _field(self) -> torch.Tensor:
        parallelism, device = self.run.parallelism, self.run.device
        mesh = parallelism.domain_mesh
        if mesh is None:
            return torch.randn(self.shape, device=device)
        placements = parallelism.field_placements(self.dims)
        spec = ShardTensorSpec.build(mesh, placements, self.shape, torch.float32)
        local = torch.randn(spec.local_shape(), device=device)
        return ShardTensor.from_local(local, mesh, placements, "chunk", shape=self.shape)


def trajectory_field(
    run: RunContext, path: str | Path, dataset: str, dims: Sequence[str]
) -> ShardedHDF5Field:
    """The dataset ``(trajectory, time, [C,] *spatial)`` at ``path``, read as float32 in the
    slabs the run's ``Parallelism`` gives this rank (whole when nothing is split)."""
    parallelism = run.parallelism
    sharded = parallelism.domain_mesh is not None
    return ShardedHDF5Field(
        path,
        dataset,
        parallelism.domain_mesh if sharded else parallelism.mesh,
        parallelism.split_dims(dims) if sharded else {},
        index_dims=2,
        spatial_dims=[d for d, name in enumerate(dims) if d >= 2 and name != CHANNELS],
        dtype=torch.float32,
    )


def prepared(
    samples: ShardTensor,
    normalization: Normalization | None,
    has_channels: bool,
    sharded: bool,
    device: torch.device,
) -> torch.Tensor:
    """Samples as read from a field -> ``(N, C, *spatial)`` on ``device``, normalised (unless
    ``normalization`` is None): a channel dim added to a scalar field's, plain tensors when the
    fields are not split."""
    fields = samples if normalization is None else normalization.normalize(samples)
    if not has_channels:
        fields = fields.unsqueeze(1)
    if not sharded:
        fields = fields.to_local()
    return fields.to(device)


def _later(pairs: np.ndarray, steps: int) -> np.ndarray:
    """(trajectory, time) pairs ``(S, 2)`` moved ``steps`` snapshots later."""
    return pairs + np.array([0, steps])
