"""``NextStepFields`` against a single-process reading of the same file: a 3-D field of two
channels ``(trajectory, time, C, D, H, W)`` on 4 gloo ranks, data parallel on one axis and D
split unevenly on the other, and a 2-D scalar field split over H and W. Every rank's training,
held-out and rollout batches, made whole, equal the file's samples normalised with per-channel
statistics of the training trajectories computed here with numpy."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from shardsci.data import HeldOutPairs, NextStepPairs
from shardsci.distributed import detect_launch_env
from shardsci.testing import run_on_ranks
from shardsci.training import (
    NextStepFields,
    ParallelConfig,
    Parallelism,
    ParallelPlan,
    RunContext,
    whole_tensor,
)

TRAIN, TEST, BATCH, SEED = (0, 1, 2), (3, 4), 4, 5
CASES = {
    "3d-2-channels-dp2-x-D2": (
        (5, 4, 2, 3, 4, 2), ("trajectory", "time", "C", "D", "H", "W"), "2x2", ParallelConfig()
    ),
    "2d-scalar-block-2x2": (
        (5, 4, 6, 5), ("trajectory", "time", "H", "W"), "2x2", ParallelConfig(None, None, {})
    ),
}  # fmt: skip


def _batches(path: str, case: str) -> dict:
    _, dims, mesh_shape, parallel = CASES[case]
    spatial = tuple(d for d in dims[2:] if d != "C")
    plan = ParallelPlan.of(mesh_shape, parallel, spatial, world_size=4)
    parallelism = Parallelism.build(plan, "cpu")
    run = RunContext(detect_launch_env(), parallelism, Path(path).parent, torch.device("cpu"))
    fields = NextStepFields(run, path, "u", dims, TRAIN, TEST, BATCH, SEED, eval_samples=5)
    start, truths = fields.rollout_batch(2)
    batches = {
        "train": fields.train_batch(3),
        "eval": fields.eval_batch(),
        "rollout": (start, *truths),
    }
    whole = {k: [whole_tensor(t).numpy() for t in v] for k, v in batches.items()}
    return {"dp": (parallelism.dp_rank, parallelism.dp_size), **whole}


@pytest.mark.parametrize("case", CASES)
def test_batches_equal_the_files_samples_normalised(tmp_path: Path, case: str) -> None:
    shape, dims, _, _ = CASES[case]
    data = np.random.default_rng(0).normal(3.0, 2.0, shape)
    path = tmp_path / "u.h5"
    with h5py.File(path, "w") as file:
        file["u"] = data
    if "C" not in dims:
        data = data[:, :, None]  # one channel
    training = data[list(TRAIN)]
    mean, std = (f(training, axis=(0, 1, *range(3, data.ndim))) for f in (np.mean, np.std))
    channels = (-1,) + (1,) * (data.ndim - 3)
    normalised = ((data - mean.reshape(channels)) / std.reshape(channels)).astype(np.float32)

    def samples(pairs: np.ndarray, later: int = 0) -> np.ndarray:
        return normalised[pairs[:, 0], pairs[:, 1] + later]

    for got in run_on_ranks(4, _batches, str(path), case):
        dp_rank, dp_size = got["dp"]
        pairs = NextStepPairs(TRAIN, shape[1], BATCH, SEED, dp_rank, dp_size).batch(3).inputs
        held_out = HeldOutPairs(TEST, shape[1], dp_rank, dp_size)
        expected = {
            "train": [samples(pairs), samples(pairs, 1)],
            "eval": [samples(held_out.pairs(5)), samples(held_out.pairs(5), 1)],
            "rollout": [samples(held_out.rollout_starts(2), k) for k in range(3)],
        }
        for kind, arrays in expected.items():
            for a, b in zip(got[kind], arrays):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"{case} {kind}")
