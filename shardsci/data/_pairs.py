"""Pairs of snapshots for next-step training (shuffled, resumable) and for evaluation (the
same every time), split over data-parallel ranks.

NOTE [Every batch is a pure function of (seed, step)]
Epoch ``e`` visits all pairs in the order of a permutation drawn from ``(seed, e)``; global
batch ``s`` is the ``s % steps_per_epoch``-th slice of ``global_batch`` pairs of epoch
``s // steps_per_epoch`` (an incomplete last slice is dropped), and data-parallel rank ``r``
takes the ``r``-th of ``dp_size`` equal parts of it. No state is carried from batch to batch:
the domain ranks of a data-parallel group compute the same part without communicating, and a
run resumes at any step by computing that step's batch, reading nothing it skips.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from torch.distributed.device_mesh import DeviceMesh

from shardsci.data._field import ShardedHDF5Field, axis_index
from shardsci.tensor._api import ShardTensor
from shardsci.tensor._caches import cached
from shardsci.tensor._spec import mesh_coordinate

__all__ = ["HeldOutPairs", "NextStepPairs", "PairBatch"]


@dataclass(frozen=True)
class PairBatch:
    """This data-parallel rank's part of one global batch.

    Attributes
    ----------
    step : int
        Global step (batch number since the start of training).
    epoch : int
        Epoch the batch belongs to.
    inputs, targets : ndarray of int, (b, 2)
        Leading indices (trajectory and time, in the field's order) of each input and of its
        target, ``b = global_batch / dp_size``.
    """

    step: int
    epoch: int
    inputs: np.ndarray
    targets: np.ndarray

    def read(self, field: ShardedHDF5Field) -> tuple[ShardTensor, ShardTensor]:
        """Inputs and targets from ``field`` (this rank's slabs; shared snapshots read once)."""
        inputs, targets = field.read_many(self.inputs, self.targets)
        return inputs, targets


@dataclass(frozen=True)
class NextStepPairs:
    """Pairs ``((b, t), (b, t + horizon))`` over trajectories ``b`` of ``n_times`` snapshots,
    shuffled per epoch and split over data-parallel ranks (see NOTE [Every batch is a pure
    function of (seed, step)]).

    Attributes
    ----------
    trajectories : tuple of int
        Trajectory indices to draw from (e.g. the training split).
    n_times : int
        Snapshots per trajectory.
    global_batch : int
        Pairs per step over all data-parallel ranks; a multiple of ``dp_size``.
    seed : int
        Seed of the shuffles.
    dp_rank, dp_size : int
        This rank's position along the data-parallel ranks, and their number.
    horizon : int
        Snapshots between an input and its target.
    time_dim : int
        Which of the two leading index dims is time: 1 for ``(trajectory, time, ...)`` data,
        0 for ``(time, trajectory, ...)``.
    """

    trajectories: tuple[int, ...]
    n_times: int
    global_batch: int
    seed: int = 0
    dp_rank: int = 0
    dp_size: int = 1
    horizon: int = 1
    time_dim: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "trajectories", tuple(int(b) for b in self.trajectories))
        if not 1 <= self.horizon < self.n_times:
            raise ValueError(
                f"need 1 <= horizon < n_times to form pairs; got horizon={self.horizon}, "
                f"n_times={self.n_times}"
            )
        if self.time_dim not in (0, 1):
            raise ValueError(f"time_dim must be 0 or 1 (of two index dims), got {self.time_dim}")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank {self.dp_rank} is not in [0, dp_size={self.dp_size})")
        if self.global_batch < 1 or self.global_batch % self.dp_size:
            raise ValueError(
                f"global_batch {self.global_batch} must be a positive multiple of the "
                f"{self.dp_size} data-parallel ranks"
            )
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"global_batch {self.global_batch} exceeds the {self.n_pairs} pairs available"
            )

    @classmethod
    def on_mesh(
        cls, mesh: DeviceMesh, dp_axis: str | int | None, **kwargs: object
    ) -> NextStepPairs:
        """Pairs for this rank of ``mesh``, data-parallel along ``dp_axis`` (None: no dp)."""
        if dp_axis is None:
            return cls(**kwargs)  # type: ignore[arg-type]
        axis = axis_index(mesh, dp_axis)
        dp_rank, dp_size = mesh_coordinate(mesh)[axis], mesh.shape[axis]
        return cls(dp_rank=dp_rank, dp_size=dp_size, **kwargs)  # type: ignore[arg-type]

    @property
    def pairs_per_trajectory(self) -> int:
        return self.n_times - self.horizon

    @property
    def n_pairs(self) -> int:
        return len(self.trajectories) * self.pairs_per_trajectory

    @property
    def steps_per_epoch(self) -> int:
        return self.n_pairs // self.global_batch

    def batch(self, step: int) -> PairBatch:
        """This rank's part of global batch ``step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, position = divmod(step, self.steps_per_epoch)
        part = self.global_batch // self.dp_size
        start = position * self.global_batch + self.dp_rank * part
        pairs = _permutation(self.seed, epoch, self.n_pairs)[start : start + part]
        trajectory = np.asarray(self.trajectories, dtype=np.int64)[
            pairs // self.pairs_per_trajectory
        ]
        time = pairs % self.pairs_per_trajectory
        return PairBatch(
            step,
            epoch,
            self._indices(trajectory, time),
            self._indices(trajectory, time + self.horizon),
        )

    def _indices(self, trajectory: np.ndarray, time: np.ndarray) -> np.ndarray:
        columns = [time, trajectory] if self.time_dim == 0 else [trajectory, time]
        return np.stack(columns, axis=1)

    def batches(self, start_step: int = 0, stop_step: int | None = None) -> Iterator[PairBatch]:
        """Batches ``start_step, start_step + 1, ...`` up to ``stop_step`` (default: forever)."""
        step = start_step
        while stop_step is None or step < stop_step:
            yield self.batch(step)
            step += 1


@dataclass(frozen=True)
class HeldOutPairs:
    """The held-out pairs of an evaluation and the starts of its rollouts, the same at every
    evaluation, split over data-parallel ranks.

    Attributes
    ----------
    trajectories : tuple of int
        The held-out trajectories.
    n_times : int
        Snapshots per trajectory.
    dp_rank, dp_size : int
        This rank's position along the data-parallel ranks, and their number.
    """

    trajectories: tuple[int, ...]
    n_times: int
    dp_rank: int = 0
    dp_size: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "trajectories", tuple(int(b) for b in self.trajectories))
        if self.n_times < 2 or not self.trajectories:
            raise ValueError(
                f"held-out pairs need a trajectory and 2 snapshots; got trajectories "
                f"{self.trajectories}, n_times={self.n_times}"
            )
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank {self.dp_rank} is not in [0, dp_size={self.dp_size})")

    def pairs(self, samples: int | None) -> np.ndarray:
        """This rank's share of ``samples`` (t, t + 1) pairs spread evenly over the held-out
        trajectories and times (None: every pair); shares differ by one pair at most.

        Returns
        -------
        ndarray of int, (b, 2)
            The inputs' (trajectory, time); the targets are at time + 1.
        """
        every = [(b, t) for b in self.trajectories for t in range(self.n_times - 1)]
        count = len(every) if samples is None else min(samples, len(every))
        chosen = np.linspace(0, len(every) - 1, count).astype(int)
        mine = [every[i] for i in chosen[self.dp_rank :: self.dp_size]]
        return np.asarray(mine, dtype=np.int64).reshape(-1, 2)

    def rollout_starts(self, steps: int) -> np.ndarray:
        """This rank's share of the held-out trajectories, each from its middle snapshot (or
        the latest one that leaves ``steps`` snapshots after it).

        Returns
        -------
        ndarray of int, (b, 2)
            The starts' (trajectory, time); step ``k`` of a rollout is at time + k.
        """
        if not 1 <= steps < self.n_times:
            raise ValueError(
                f"a rollout of {steps} steps needs 1 <= steps < n_times={self.n_times}"
            )
        start = min(self.n_times // 2, self.n_times - 1 - steps)
        mine = self.trajectories[self.dp_rank :: self.dp_size]
        return np.asarray([(b, start) for b in mine], dtype=np.int64).reshape(-1, 2)


@cached("epoch permutations", 2)
def _permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)
