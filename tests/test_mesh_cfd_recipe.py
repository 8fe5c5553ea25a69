"""The mesh CFD recipe end to end: ``python train.py +recipe=mesh_cfd ...`` on a tiny dataset,
its outputs, and a resume from a checkpoint written at another rank count, under
``SHARDSCI_GATHER=error`` (no op may gather a sharded tensor it was not asked to).

By default one run on 2 ranks (the recipe's only default training run; its data, graph
partition, model and checks have their own tests); the resume and the uninterrupted run it
is compared with are slow (two more runs of train.py): run them with
``pytest -m slow tests/test_mesh_cfd_recipe.py``."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "logger=none",
    "train.log_every=1",
    "train.global_batch=2",
    "train.eval_every=2",
    "train.checkpoint_every=2",
    "eval.samples=2",
    "eval.rollout_steps=1",
    "data.test_trajectories=1",
    "data.dataset.trajectories=3",
    "data.dataset.records=3",
    "data.dataset.record_every=2",
    "data.dataset.spin_up_steps=4",
    "data.dataset.flow.nx=64",
    "data.dataset.flow.ny=32",
    "data.dataset.mesh.spacing=0.08",
    "data.dataset.mesh.wall_spacing=0.04",
    "model.hidden=8",
    "model.processor_blocks=2",
]
RUN_TIMEOUT_S = 300


def _train(
    data: Path, run_dir: Path, mesh: str, steps: int, *overrides: str
) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "train.py",
        "+recipe=mesh_cfd",
        f"mesh={mesh}",
        f"data.path={data}",
        f"run_dir={run_dir}",
        f"train.steps={steps}",
        *TINY,
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDSCI_GATHER": "error"}
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    assert done.returncode == 0, f"train.py failed ({done.returncode}):\n{done.stderr[-4000:]}"
    return done


def _losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two steps on 2 ranks, generating the data on the way (outside ``data/generated/``):
    the data file and the run directory."""
    root = tmp_path_factory.mktemp("mesh_cfd")
    data, run_dir = root / "cylinders.h5", root / "run"
    _train(data, run_dir, "2", 2, "data.generate=force")
    return data, run_dir


def test_trains_evaluates_and_draws(first_run: tuple[Path, Path]) -> None:
    _, run_dir = first_run
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["step"] == 2 and math.isfinite(metrics["final_loss"])
    assert 0 < metrics["eval_relative_l2"] < 1 and 0 < metrics["persistence_relative_l2"] < 1
    assert (run_dir / "eval_step000002.png").stat().st_size > 10_000


@pytest.mark.slow
def test_resumes_on_another_rank_count(first_run: tuple[Path, Path], tmp_path: Path) -> None:
    data, first = first_run
    run_dir = tmp_path / "run"
    shutil.copytree(first, run_dir)  # the fixture's run stays as it was for the test above
    resumed = _train(data, run_dir, "1", steps=4)
    assert "resumed from" in resumed.stdout and "at step 2" in resumed.stdout
    assert json.loads((run_dir / "metrics.json").read_text())["step"] == 4
    straight = tmp_path / "straight"
    _train(data, straight, "1", steps=4)
    got, expected = _losses(run_dir), _losses(straight)
    for step in (3, 4):
        assert got[step] == pytest.approx(expected[step], rel=1e-4), (step, got, expected)


@pytest.mark.slow
def test_rollout_training_on_a_split_graph_equals_one_rank(
    first_run: tuple[Path, Path], tmp_path: Path
) -> None:
    """``train.rollout.steps=2`` (NOTE [Unrolled training]) on the graph split over 2 ranks and
    on one rank: the same losses, and not the one-step losses of the fixture's run."""
    data, one_step = first_run
    runs = {mesh: tmp_path / f"mesh{mesh}" for mesh in ("2", "1")}
    for mesh, run_dir in runs.items():
        _train(data, run_dir, mesh, 2, "train.rollout.steps=2", "train.rollout.gradient=all")
    split, whole = (_losses(run_dir) for run_dir in runs.values())
    assert split.keys() == whole.keys() == {1, 2}
    for step in split:
        assert split[step] == pytest.approx(whole[step], rel=1e-4), (split, whole)
        assert split[step] != pytest.approx(_losses(one_step)[step], rel=1e-3)
