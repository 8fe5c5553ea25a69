"""The launcher behaves like torchrun, tried on real processes (NOTE [Ranks forked by train.py
behave like torchrun's]).

SIGTERM or SIGINT to the launching process (or Ctrl-C to its whole process group) stops every
rank after an agreed step, with a final checkpoint, and the exit status says which signal; a
rank killed while the others wait for it in a collective ends the run; a killed launcher
takes its ranks with it. No rank outlives its launcher.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import h5py
import pytest

from shardsci.recipes.cfd.generate import DatasetConfig, generate_dataset
from shardsci.recipes.cfd.navier_stokes import SolverConfig
from shardsci.training import exit_status

ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 240
EXIT_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = DatasetConfig(solver=SolverConfig(resolution=32), n_train=4, n_test=2, n_snapshots=6)
    path = generate_dataset(tmp_path_factory.mktemp("data") / "ns.h5", config)
    with h5py.File(path, "r+") as file:
        del file.attrs["created_by"]  # a file of the user's: read as it is
    return path


@pytest.fixture
def training(dataset: Path, tmp_path: Path) -> Iterator[subprocess.Popen]:
    """``train.py`` on a 2x1 mesh, far from done, once every rank has finished a step."""
    command = [
        sys.executable, "train.py", "+recipe=cfd", "mesh=2x1", f"data.path={dataset}",
        f"run_dir={tmp_path}", "logger=none", "train.steps=100000", "train.log_every=1",
        "train.eval_every=100000", "train.checkpoint_every=0", "train.global_batch=8",
        "eval.samples=8", "eval.rollout_steps=1", "launcher.grace_s=60",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        _wait_for_a_step(process, tmp_path)
        yield process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate(timeout=EXIT_TIMEOUT_S)


def _wait_for_a_step(process: subprocess.Popen, run_dir: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not _logged_steps(run_dir):
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no training step within the startup timeout"
        time.sleep(0.2)


def _logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if line.endswith("}")]


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started (its ranks)."""
    tasks = Path(f"/proc/{pid}/task")
    return [int(c) for task in tasks.iterdir() for c in (task / "children").read_text().split()]


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie does not: it only waits to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _finish(process: subprocess.Popen) -> tuple[int, str]:
    _, stderr = process.communicate(timeout=EXIT_TIMEOUT_S)
    return process.returncode, stderr


@pytest.mark.parametrize(
    ("signum", "target"),
    [
        # By default tests/test_faults.py's SIGTERM-and-requeue test makes these checks on its
        # own run of the same command (train.py's ranks, mesh 2x1, grace 60 s).
        pytest.param(signal.SIGTERM, "launcher", marks=pytest.mark.slow),
        # SIGINT to the launcher alone takes SIGTERM's path; Ctrl-C (the group) stays default.
        pytest.param(signal.SIGINT, "launcher", marks=pytest.mark.slow),
        (signal.SIGINT, "group"),
    ],
)
def test_a_stop_signal_stops_every_rank_with_a_final_checkpoint(
    training: subprocess.Popen, tmp_path: Path, signum: signal.Signals, target: str
) -> None:
    """``group`` is Ctrl-C in a terminal: the launcher and every rank get SIGINT at once."""
    ranks = _children(training.pid)
    assert len(ranks) == 2
    if target == "group":
        os.killpg(training.pid, signum)
    else:
        training.send_signal(signum)
    status, stderr = _finish(training)
    assert status == exit_status(signum), stderr[-3000:]
    assert f"stopped by {signum.name}" in stderr
    assert "Traceback" not in stderr
    assert not [rank for rank in ranks if _alive(rank)]
    last = max(_logged_steps(tmp_path))
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == f"step_{last:06d}"


def test_a_rank_killed_while_the_others_wait_for_it_ends_the_run(
    training: subprocess.Popen,
) -> None:
    ranks = _children(training.pid)
    os.kill(ranks[1], signal.SIGKILL)
    status, stderr = _finish(training)
    assert status == exit_status(signal.SIGKILL), stderr[-3000:]
    assert f"rank 1 (pid {ranks[1]}) was killed by SIGKILL" in stderr
    assert not [rank for rank in ranks if _alive(rank)]


def test_no_rank_outlives_a_killed_launcher(training: subprocess.Popen) -> None:
    ranks = _children(training.pid)
    training.kill()
    _finish(training)
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while [rank for rank in ranks if _alive(rank)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [rank for rank in ranks if _alive(rank)]
