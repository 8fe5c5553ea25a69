"""Conventions of the training command users rely on: environment variables over config
defaults, offline logging without network lookups, no empty run directory after a failure."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300


def _python(*arguments: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *arguments],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


# By default tests/test_run_checks.py's real-command test checks this on its own run (mesh=1000,
# refused by the same check_run after Hydra made the run directory).
@pytest.mark.slow
def test_a_run_that_fails_before_training_leaves_no_run_directory(tmp_path: Path) -> None:
    done = _python("-m", "shardsci.train", "+recipe=cfd", "mesh=-1x2", cwd=tmp_path)
    assert done.returncode != 0 and "infers an axis" in done.stderr
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == []


# Slow (a start-up of the command, about 5 s): by default tests/test_run_checks.py checks both
# of our halves in-process, check_composition leaving the override to Hydra and `reported`
# re-raising when HYDRA_FULL_ERROR=1; what remains here is Hydra printing its traceback.
@pytest.mark.slow
def test_hydra_full_error_shows_the_whole_traceback(tmp_path: Path) -> None:
    done = _python(
        "-m", "shardsci.train", "+recipe=cfd", "train.stpes=3", cwd=tmp_path, HYDRA_FULL_ERROR="1"
    )
    assert done.returncode != 0 and "Traceback" in done.stderr and "stpes" in done.stderr


# Run in a fresh process: records every name lookup and connection the Python side of wandb
# makes (the check fails on any), then logs a step with the given logger config.
_LOG_ONE_STEP = """
import socket, sys
from pathlib import Path
def record(name, real):
    def recorded(*args, **kwargs):
        sys.stderr.write(f"NETWORK {name} {args[:1]}\\n")
        return real(*args, **kwargs)
    return recorded
for name in ("getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr", "getfqdn",
             "create_connection"):
    setattr(socket, name, record(name, getattr(socket, name)))
from shardsci.training import LoggerConfig, MetricLogger, WandbMode
logger = MetricLogger(LoggerConfig(mode=WandbMode[sys.argv[2]]), Path(sys.argv[1]), {}, True)
logger.log({"loss": 1.0}, step=1)
logger.finish()
"""


@pytest.fixture(scope="module")
def wandb_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str | None], tuple]]:
    """``_LOG_ONE_STEP`` in a fresh process for each case below (``None``: no ``WANDB_MODE``
    or ``WANDB_DIR``), all started at once: three start-ups in about the time of two on two
    idle cores. Each test waits for its own; whatever still runs at the end is killed."""
    started = {}
    for mode in (None, "disabled", "offline"):
        tmp_path = tmp_path_factory.mktemp(f"wandb-{mode}")
        run_dir, wandb_dir = tmp_path / "run", tmp_path / "elsewhere"
        run_dir.mkdir()
        wandb_dir.mkdir()
        env = {} if mode is None else {"WANDB_MODE": mode, "WANDB_DIR": str(wandb_dir)}
        process = subprocess.Popen(
            [sys.executable, "-c", _LOG_ONE_STEP, str(run_dir), "offline"], cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        started[mode] = (process, run_dir, wandb_dir)

    def finished(mode: str | None) -> tuple[subprocess.Popen, str, Path, Path]:
        """The finished process of ``mode``, its stderr, its run directory and WANDB_DIR."""
        process, run_dir, wandb_dir = started[mode]
        _, stderr = process.communicate(timeout=TIMEOUT_S)
        return process, stderr, run_dir, wandb_dir

    yield finished
    for process, _, _ in started.values():
        if process.poll() is None:
            process.kill()
            process.wait()


def test_offline_wandb_makes_no_network_lookup(wandb_runs) -> None:
    done, stderr, run_dir, _ = wandb_runs(None)
    assert done.returncode == 0, stderr
    assert "NETWORK" not in stderr, stderr
    assert list((run_dir / "wandb").glob("offline-run-*"))


@pytest.mark.parametrize("mode", ["disabled", "offline"])
def test_wandb_environment_variables_win_over_the_config(wandb_runs, mode: str) -> None:
    """The config says offline into the run directory; WANDB_MODE and WANDB_DIR say otherwise."""
    done, stderr, run_dir, wandb_dir = wandb_runs(mode)
    assert done.returncode == 0, stderr
    assert not (run_dir / "wandb").exists()
    written = list((wandb_dir / "wandb").glob("offline-run-*"))
    assert bool(written) == (mode == "offline")
