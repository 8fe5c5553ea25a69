"""``shardsci-predict``: a trained model rolled out at any resolution it takes, on any mesh, the
prediction written without any rank holding it whole.

Fast: the output of data-parallel replicas written as one file equals the array (4 gloo ranks,
uneven trajectories per replica, H split); the truth's configuration at another resolution;
the checkpoint a path names; and every bad input refused in one line before any rank starts
(``launch`` in this process, the rank starter a tripwire), with no file written. Slow
(``-m slow``): the command end to end, 2-D and 3-D, from a checkpoint trained on another mesh,
on 2 ranks at twice the training resolution, its output read with plain h5py against a
single-process prediction.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

import shardsci.predict as predict
from shardsci.checkpoint import save_checkpoint
from shardsci.data import ShardedHDF5Writer
from shardsci.recipes.cfd import generate as generate2d
from shardsci.recipes.cfd.data import TRAJECTORIES as SOURCE_2D
from shardsci.recipes.cfd3d import generate as generate3d
from shardsci.recipes.cfd3d.data import TRAJECTORIES as SOURCE_3D
from shardsci.tensor import ShardTensor, ShardTensorSpec
from shardsci.testing import run_on_ranks
from shardsci.training import (
    ConfigError,
    ParallelConfig,
    Parallelism,
    ParallelPlan,
    instantiate,
    resolve_checkpoint,
)
from shardsci.training._next_step_prediction import at_resolution

ROOT = Path(__file__).resolve().parents[1]
SMALL_FNO = [
    "model.modes=[4,4]", "model.width=8", "model.layers=2", "model.projection_channels=8",
]  # fmt: skip
TINY_2D = [
    "data.dataset.solver.resolution=16", "data.dataset.n_train=2", "data.dataset.n_test=1",
    "data.dataset.n_snapshots=4", "data.dataset.record_every=4", "data.dataset.solver.dt=0.025",
]  # fmt: skip
TINY_3D = [
    "data.dataset.solver.resolution=8", "data.dataset.solver.dt=0.01",
    "data.dataset.solver.ic_max_wavenumber=2", "data.dataset.solver.forcing_wavenumber=1.5",
    "data.dataset.n_train=2", "data.dataset.n_test=1", "data.dataset.n_snapshots=4",
    "data.dataset.record_every=2", "data.dataset.warmup_steps=2",
]  # fmt: skip
SMALL_FNO_3D = [
    "model.modes=[2,2,2]", "model.width=4", "model.layers=1", "model.projection_channels=4",
]  # fmt: skip


# ---------------------------------------------------------------------------- the output
def _write_replicas(path: str) -> None:
    """3 trajectories over 2 replicas (2/1), H split over the domain axis (5/4 of 9)."""
    plan = ParallelPlan.of("2x2", ParallelConfig(), ("H", "W"), world_size=4)
    parallelism = Parallelism.build(plan, "cpu")
    whole = torch.arange(2 * 3 * 1 * 9 * 4, dtype=torch.float32).reshape(2, 3, 1, 9, 4)
    sizes = (2, 1)
    first = sum(sizes[: parallelism.dp_rank])
    mine = whole[:, first : first + sizes[parallelism.dp_rank]]
    placements = parallelism.field_placements(("N", "C", "H", "W"))
    with ShardedHDF5Writer.create(
        path, "prediction", whole.shape, torch.float32, {"mesh": "2x2"}, parallelism.mesh
    ) as writer:
        for step in range(2):
            spec = ShardTensorSpec.build(
                parallelism.domain_mesh, placements, mine[step].shape, torch.float32
            )
            local = spec.narrow(mine[step])
            field = ShardTensor.from_local(
                local, parallelism.domain_mesh, placements, "chunk", shape=spec.shape
            )
            wrapped = parallelism.on_whole_mesh(field, sizes)
            assert wrapped.to_local().data_ptr() == local.data_ptr()  # the block itself
            assert wrapped.spec.sharding_by_dim[0].sizes == sizes
            writer.append(wrapped)


def test_replicas_write_one_file_without_gathering(tmp_path: Path) -> None:
    path = tmp_path / "prediction.h5"
    run_on_ranks(4, _write_replicas, str(path))
    with h5py.File(path, "r") as file:
        data = file["prediction"][:]
        assert file["prediction"].attrs["steps_written"] == 2
    np.testing.assert_array_equal(data, np.arange(data.size, dtype=np.float32).reshape(data.shape))


# ---------------------------------------------------------------------------- the truth
@pytest.mark.parametrize("generate", [generate2d, generate3d], ids=["2d", "3d"])
def test_the_truth_at_twice_the_resolution_keeps_the_record_interval_and_the_cfl(
    generate,
) -> None:
    trained = generate.DatasetConfig()
    n = trained.solver.resolution
    finer = at_resolution(trained, 2 * n, seed=7, trajectories=3, snapshots=5)
    assert finer.solver.resolution == 2 * n and finer.solver.dt == pytest.approx(
        trained.solver.dt / 2, rel=1e-15
    )
    assert finer.record_dt == pytest.approx(trained.record_dt, rel=1e-15)
    assert finer.warmup_steps * finer.solver.dt == pytest.approx(
        trained.warmup_steps * trained.solver.dt, rel=1e-15
    )
    assert (finer.solver.seed, finer.n_train, finer.n_test, finer.n_snapshots) == (7, 3, 0, 5)
    same = dataclasses.replace(trained.solver, seed=7)
    assert at_resolution(trained, n, 7, 3, 5).solver == same  # not rescaled: bit for bit


def test_a_resolution_that_breaks_the_record_interval_is_refused() -> None:
    trained = generate3d.DatasetConfig()  # 16 steps a record at 32³
    with pytest.raises(ValueError, match=r"predict.resolution=33: .* not integers"):
        at_resolution(trained, 33, 1, 1, 2)


# ---------------------------------------------------------------------------- the checkpoint
def test_a_checkpoint_is_found_from_its_run_directory(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    for step in (1, 2):
        save_checkpoint(tmp_path / "checkpoints", step, model, None, {"step": step})
    latest = tmp_path / "checkpoints" / "step_000002"
    assert resolve_checkpoint(tmp_path) == latest
    assert resolve_checkpoint(tmp_path / "checkpoints") == latest
    first = tmp_path / "checkpoints" / "step_000001"
    assert resolve_checkpoint(first) == first
    with pytest.raises(Exception, match="does not exist"):
        resolve_checkpoint(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(Exception, match="holds no complete checkpoint"):
        resolve_checkpoint(tmp_path / "empty")


# ---------------------------------------------------------------------------- bad inputs
def _compose(tmp_path: Path, recipe: str, *overrides: str):
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        return compose(
            "predict",
            overrides=[
                f"+recipe={recipe}",
                f"run_dir={tmp_path}/run",
                f"predict.output={tmp_path}/out.h5",
                f"predict.data={tmp_path}/truth.h5",
                "predict.generate=force",
                *overrides,
            ],
        )


def _checkpoint(tmp_path: Path, recipe: str, *overrides: str, state: bool = True) -> Path:
    """A checkpoint of the composed model, with the prediction state a run of the recipe's
    tiny data would save."""
    cfg = _compose(tmp_path, recipe, *overrides)
    module = generate2d if recipe == "cfd" else generate3d
    source = SOURCE_2D if recipe == "cfd" else SOURCE_3D
    attributes = {
        **module.dataset_attributes(source.config(cfg.data.dataset)),
        "created_by": module.CREATED_BY,
    }
    channels = () if recipe == "cfd" else (3,)
    prediction = {"mean": torch.zeros(channels), "std": torch.ones(channels)}
    extra = {"prediction": {**prediction, "data_attributes": attributes}} if state else {}
    path = tmp_path / "trained"
    save_checkpoint(path / "checkpoints", 5, instantiate(cfg.model), None, extra)
    return path


@pytest.fixture
def no_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    def tripwire(*args, **kwargs):
        raise AssertionError("ranks were started before the config was refused")

    monkeypatch.setattr(predict, "run_ranks", tripwire)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)


def _refused(tmp_path: Path, recipe: str, message: str, *overrides: str) -> None:
    cfg = _compose(tmp_path, recipe, *overrides)
    with pytest.raises(ConfigError, match=message):
        predict.launch(cfg)
    assert not (tmp_path / "out.h5").exists() and not (tmp_path / "truth.h5").exists()


@pytest.mark.usefixtures("no_ranks")
def test_a_missing_checkpoint_is_refused(tmp_path: Path) -> None:
    _refused(
        tmp_path, "cfd", r"predict.checkpoint=\S+ does not exist; expected a run directory",
        f"predict.checkpoint={tmp_path}/missing", *TINY_2D,
    )  # fmt: skip


@pytest.mark.usefixtures("no_ranks")
def test_unset_checkpoint_and_output_are_refused(tmp_path: Path) -> None:
    cfg = _compose(tmp_path, "cfd", "predict.output=null")
    with pytest.raises(ConfigError, match=r"predict.checkpoint is not set; shardsci-predict"):
        predict.launch(cfg)


@pytest.mark.usefixtures("no_ranks")
def test_an_output_that_exists_is_never_overwritten(tmp_path: Path) -> None:
    trained = _checkpoint(tmp_path, "cfd", *TINY_2D, *SMALL_FNO)
    (tmp_path / "out.h5").write_bytes(b"mine")
    cfg = _compose(tmp_path, "cfd", f"predict.checkpoint={trained}", *TINY_2D, *SMALL_FNO)
    with pytest.raises(ConfigError, match=r"out.h5 exists; a prediction never overwrites a file"):
        predict.launch(cfg)
    assert (tmp_path / "out.h5").read_bytes() == b"mine"


@pytest.mark.usefixtures("no_ranks")
def test_a_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    trained = _checkpoint(tmp_path, "cfd", *TINY_2D, *SMALL_FNO)
    _refused(
        tmp_path, "cfd", r"checkpoint \S+step_000005 does not match the model: missing",
        f"predict.checkpoint={trained}", "model=unet", *TINY_2D,
    )  # fmt: skip


@pytest.mark.usefixtures("no_ranks")
def test_a_checkpoint_without_prediction_state_is_refused(tmp_path: Path) -> None:
    trained = _checkpoint(tmp_path, "cfd", *TINY_2D, *SMALL_FNO, state=False)
    _refused(
        tmp_path, "cfd", "holds no prediction state",
        f"predict.checkpoint={trained}", *TINY_2D, *SMALL_FNO,
    )  # fmt: skip


@pytest.mark.usefixtures("no_ranks")
@pytest.mark.parametrize(
    ("recipe", "overrides", "message"),
    [
        ("cfd", ["model=unet", "predict.resolution=20"], "needs H and W divisible by 8"),
        ("cfd3d", ["model=unet", "model.depth=3", "predict.resolution=12"],
         "needs D, H and W divisible by 8"),
        ("cfd3d", ["predict.resolution=10"], r"predict.resolution=10: .* not integers"),
        ("cfd3d", ["mesh=1x1x16"],
         r"splits W over 16 ranks, but the fields have 8 cells along W \(the prediction's"),
        ("cfd", ["mesh=4x1", "predict.trajectories=3"],
         "predict.trajectories=3 leaves data-parallel replicas"),
    ],
)  # fmt: skip
def test_a_prediction_that_cannot_run_is_one_line_before_any_rank_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recipe: str, overrides: list[str], message: str
) -> None:
    monkeypatch.setenv("SHARDSCI_MAX_LOCAL_RANKS", "16")
    tiny = TINY_2D if recipe == "cfd" else TINY_3D
    small = SMALL_FNO if recipe == "cfd" else SMALL_FNO_3D
    model = [o for o in overrides if o.startswith("model")] or small
    trained = _checkpoint(tmp_path, recipe, *tiny, *model)
    others = [o for o in overrides if not o.startswith("model")]
    _refused(tmp_path, recipe, message, f"predict.checkpoint={trained}", *tiny, *model, *others)


def test_a_refused_prediction_is_one_line_and_exit_status_2(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "predict.py", "+recipe=cfd", f"run_dir={tmp_path}/run",
         f"predict.checkpoint={tmp_path}/missing", f"predict.output={tmp_path}/out.h5"],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: predict.checkpoint={tmp_path}/missing")
    assert not (tmp_path / "run").exists() and not (tmp_path / "out.h5").exists()


# ---------------------------------------------------------------------------- end to end
def _command(script: str, *arguments: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, script, *arguments, "logger=none"] if script == "train.py"
        else [sys.executable, script, *arguments],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, f"{script} failed ({done.returncode}):\n{done.stderr[-4000:]}"
    return done


@pytest.mark.slow
@pytest.mark.parametrize(
    ("recipe", "tiny", "train_mesh", "predict_mesh", "resolution"),
    [
        ("cfd", [*TINY_2D, *SMALL_FNO], "1x2", ["mesh=2x1"], 32),
        ("cfd3d", [*TINY_3D, *SMALL_FNO_3D], "2", ["mesh=1x2"], 16),
    ],
    ids=["2d-trained-on-1x2-predicted-on-2x1-at-32", "3d-trained-on-2-predicted-on-1x2-at-16"],
)
def test_predicted_on_two_ranks_equals_one_process(
    tmp_path: Path,
    recipe: str,
    tiny: list[str],
    train_mesh: str,
    predict_mesh: list[str],
    resolution: int,
) -> None:
    """Train on one mesh, predict at twice the resolution on 2 ranks of another and in one
    process: the same file contents (to float32 round-off: sums run in another order), the
    attributes that say what it is, the errors in ``metrics.json``. About 2 minutes here at a
    load average of 20."""
    train_run = tmp_path / "train"
    _command(
        "train.py", f"+recipe={recipe}", f"mesh={train_mesh}", f"run_dir={train_run}",
        f"data.path={tmp_path}/data.h5", "data.generate=force", "train.steps=2",
        "train.global_batch=2", "eval.rollout_steps=1", *tiny,
    )  # fmt: skip
    outputs = {}
    for name, mesh in (("two", predict_mesh), ("one", ["mesh=1"])):
        outputs[name] = tmp_path / f"{name}.h5"
        _command(
            "predict.py", f"+recipe={recipe}", *mesh, f"run_dir={tmp_path}/{name}",
            f"predict.checkpoint={train_run}", f"predict.output={outputs[name]}",
            f"predict.resolution={resolution}", "predict.steps=2", "predict.trajectories=2",
            f"predict.data={tmp_path}/truth_{name}.h5", "predict.generate=force", *tiny,
        )  # fmt: skip
    with h5py.File(outputs["two"], "r") as two, h5py.File(outputs["one"], "r") as one:
        a, b = two["prediction"], one["prediction"]
        channels = 1 if recipe == "cfd" else 3
        assert a.shape == (2, 2, channels, *(resolution,) * (2 if recipe == "cfd" else 3))
        np.testing.assert_allclose(a[:], b[:], rtol=1e-4, atol=1e-5 * np.abs(b[:]).max())
        assert a.attrs["complete"] and a.attrs["steps_written"] == 2
        attributes = dict(two.attrs)
    assert attributes["mesh"] == predict_mesh[0].removeprefix("mesh=")
    assert attributes["model"] == "shardsci.models.FNO"
    assert list(attributes["resolution"]) == [resolution] * (2 if recipe == "cfd" else 3)
    assert attributes["checkpoint"].endswith("step_000002")
    metrics = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert len(metrics["relative_l2"]) == len(metrics["persistence_relative_l2"]) == 2
    assert all(0 < e < 2 for e in metrics["relative_l2"])
    assert len(metrics["memory"]["peak_rss_mib_per_rank"]) == 2
    assert (tmp_path / "two" / "prediction.png").stat().st_size > 10_000
