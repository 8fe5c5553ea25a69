"""A run is planned once (NOTE [A run is planned once]) and reads its data file's metadata once
per process (NOTE [A data file's metadata is read once per process]).

The real command runs the CFD recipe on a tiny file of the user's, with counters wrapped around
the library from outside (``tests/counted_run.py``): run-plan constructions, mesh shapes parsed
from a string, DeviceMeshes initialised and HDF5 files opened, per process. Ranks forked by
``train.py`` take the launcher's plan and its knowledge of the file; under torchrun every rank
plans once and reads the metadata once (``-m slow``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import h5py
import pytest

from shardsci.recipes.cfd.generate import DatasetConfig, generate_dataset
from shardsci.recipes.cfd.navier_stokes import SolverConfig

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "logger=none", "train.steps=0", "train.global_batch=2", "train.eval_every=100",
    "train.checkpoint_every=0", "eval.samples=2", "eval.rollout_steps=1", "model=fno",
    "model.modes=[4,4]", "model.width=4", "model.layers=1", "model.projection_channels=4",
]  # fmt: skip
RUN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = DatasetConfig(solver=SolverConfig(resolution=16), n_train=2, n_test=1, n_snapshots=3)
    path = generate_dataset(tmp_path_factory.mktemp("data") / "ns.h5", config)
    with h5py.File(path, "r+") as file:
        del file.attrs["created_by"]  # a file of the user's: read as it is
    return path.resolve()


def _counted_run(
    dataset: Path, run_dir: Path, *command: str, mesh: str = "1x2"
) -> dict[int, Counter]:
    """Run ``command`` (ending in ``tests/counted_run.py``'s arguments) on ``mesh``; the counts
    per pid."""
    counts = run_dir.parent / f"{run_dir.name}.counts"
    arguments = [
        str(counts),
        "+recipe=cfd",
        f"mesh={mesh}",
        f"data.path={dataset}",
        f"run_dir={run_dir}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [*command, str(ROOT / "tests" / "counted_run.py"), *arguments, *TINY],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    per_process: dict[int, Counter] = {}
    for line in counts.read_text().splitlines():
        pid, what = line.split(" ", 1)
        per_process.setdefault(int(pid), Counter())[what] += 1
    return per_process


def test_forked_ranks_take_the_launchers_plan_and_metadata(dataset: Path, tmp_path: Path) -> None:
    """mesh=1x2: the launcher plans and reads the file's metadata; each of its 2 ranks builds
    one DeviceMesh and opens the file once, to read its slabs."""
    per_process = _counted_run(dataset, tmp_path / "run", sys.executable)
    launchers = [pid for pid, counts in per_process.items() if counts["launcher"]]
    assert len(launchers) == 1
    launcher = per_process.pop(launchers[0])
    opened = f"open {dataset}"
    assert (launcher["plan"], launcher["parse"], launcher["device_mesh"]) == (1, 1, 0)
    assert launcher[opened] == 1
    assert len(per_process) == 2, per_process
    for counts in per_process.values():
        assert (counts["plan"], counts["parse"], counts["device_mesh"]) == (0, 0, 1), counts
        assert counts[opened] == 1, counts


@pytest.mark.slow
def test_torchrun_ranks_plan_once_each(dataset: Path, tmp_path: Path) -> None:
    """Under torchrun every rank is a launcher: it plans and reads the metadata once, then
    opens the file once more to read its slabs."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    per_process = _counted_run(dataset, tmp_path / "run", *torchrun, "--no-python", sys.executable)
    ranks = [counts for counts in per_process.values() if counts["launcher"]]
    assert len(ranks) == 2, per_process
    for counts in ranks:
        assert (counts["plan"], counts["parse"], counts["device_mesh"]) == (1, 1, 1), counts
        assert counts[f"open {dataset}"] == 2, counts
