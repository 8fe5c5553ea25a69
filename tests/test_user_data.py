"""The user's data is theirs (NOTE [Whose data file is it]): a run reads a user's file as it is
or refuses it in one line before any rank starts, never writes over it, and generates data only
where the user asked for generated data.

Runs ``train.launch`` in this process with the rank starter (``run_ranks``) replaced by a
recorder: a refused config never reaches it, an accepted one does. Every user file's checksum is
compared before and after.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from hydra import compose, initialize_config_dir

import shardsci.train as train
from shardsci.recipes.cfd.generate import SOLVER_VERSION, DatasetConfig, generate_dataset
from shardsci.recipes.cfd.navier_stokes import SolverConfig
from shardsci.training import ConfigError

ROOT = Path(__file__).resolve().parents[1]
TINY = DatasetConfig(
    solver=SolverConfig(resolution=16, dt=0.05, seed=3), n_train=2, n_test=1, n_snapshots=3,
    record_every=2,
)  # fmt: skip
TINY_OVERRIDES = [
    "data.dataset.solver.resolution=16", "data.dataset.solver.dt=0.05",
    "data.dataset.solver.seed=3", "data.dataset.n_train=2", "data.dataset.n_test=1",
    "data.dataset.n_snapshots=3", "data.dataset.record_every=2",
    "train.global_batch=4", "eval.rollout_steps=2", "model=unet",
]  # fmt: skip


@pytest.fixture(scope="module")
def ours(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A file our generator wrote with the settings of ``TINY_OVERRIDES``."""
    return generate_dataset(tmp_path_factory.mktemp("ours") / "ns.h5", TINY)


def _users_copy(ours: Path, directory: Path) -> Path:
    """The same data, as a file of the user's (no ``created_by`` attribute)."""
    path = directory / "mine.h5"
    shutil.copyfile(ours, path)
    with h5py.File(path, "r+") as file:
        del file.attrs["created_by"]
    return path


def _checksum(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records the runs that passed the checks, instead of running them."""
    runs: list[str] = []
    monkeypatch.setattr(train, "run_ranks", lambda cfg, *_: runs.append(cfg.data.path))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    return runs


def _launch(run_dir: Path, path: Path | str, *overrides: str) -> None:
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                "+recipe=cfd", f"run_dir={run_dir}", f"data.path={path}", *TINY_OVERRIDES,
                *overrides,
            ],
        )  # fmt: skip
    train.launch(cfg)


def test_a_users_file_that_follows_the_schema_is_read_as_it_is(
    ours: Path, tmp_path: Path, started: list[str]
) -> None:
    """Whatever data.dataset says: the file's shape decides (here 16x16 against a 64 config)."""
    path = _users_copy(ours, tmp_path)
    before = _checksum(path)
    for mode in ("auto", "never"):
        _launch(
            tmp_path / "run", path, f"data.generate={mode}", "data.dataset.solver.resolution=64"
        )
    assert started == [str(path)] * 2
    assert _checksum(path) == before


def _wrong_rank(file: h5py.File) -> None:
    del file["vorticity"]
    file["vorticity"] = np.zeros((3, 3, 16), np.float32)


def _wrong_dtype(file: h5py.File) -> None:
    del file["vorticity"]
    file["vorticity"] = np.zeros((3, 3, 16, 16), np.int32)


def _no_dataset(file: h5py.File) -> None:
    file.move("vorticity", "omega")


def _no_split(file: h5py.File) -> None:
    del file.attrs["n_test"]


def _split_of_other_data(file: h5py.File) -> None:
    file.attrs["n_test"] = 5


def _split_as_text(file: h5py.File) -> None:
    file.attrs["n_train"] = "two"


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (
            _wrong_rank,
            r"dataset 'vorticity' of shape \(3, 3, 16\) has 3 dims; expected datasets "
            r"'vorticity' \(trajectory, time, H, W\) float32/float64; attributes n_train",
        ),
        (_wrong_dtype, "has dtype int32; expected"),
        (_no_dataset, "has no dataset 'vorticity'"),
        (_no_split, "lacks the attribute 'n_test'"),
        (_split_of_other_data, "n_train=2 and n_test=5 must be >= 1 and add up to the 3"),
        (_split_as_text, "attribute 'n_train' is 'two', expected int"),
    ],
)  # fmt: skip
def test_a_users_file_that_does_not_follow_the_schema_is_refused_untouched(
    ours: Path, tmp_path: Path, started: list[str], corrupt, message: str
) -> None:
    path = _users_copy(ours, tmp_path)
    with h5py.File(path, "r+") as file:
        corrupt(file)
    before = _checksum(path)
    with pytest.raises(ConfigError, match=message):
        _launch(tmp_path / "run", path)
    assert _checksum(path) == before and not started


def test_force_never_writes_over_a_users_file(
    ours: Path, tmp_path: Path, started: list[str]
) -> None:
    path = _users_copy(ours, tmp_path)
    before = _checksum(path)
    with pytest.raises(ConfigError, match=r"data\.generate=force would overwrite"):
        _launch(tmp_path / "run", path, "data.generate=force")
    assert _checksum(path) == before and not started


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
@pytest.mark.parametrize("mode", ["auto", "never", "force"])
def test_a_file_that_is_not_hdf5_is_refused_untouched(
    ours: Path, tmp_path: Path, started: list[str], damage: str, mode: str
) -> None:
    path = tmp_path / "mine.h5"
    whole = ours.read_bytes()
    content = {"garbage": b"\x00not HDF5" * 100, "truncated": whole[: len(whole) // 2]}
    path.write_bytes(content.get(damage, b""))
    before = _checksum(path)
    with pytest.raises(ConfigError, match=f"data file {path} cannot be read as HDF5"):
        _launch(tmp_path / "run", path, f"data.generate={mode}")
    assert _checksum(path) == before and not started


@pytest.mark.parametrize("mode", ["auto", "never"])
def test_a_missing_users_file_is_an_error_not_a_generation(
    tmp_path: Path, started: list[str], mode: str
) -> None:
    path = tmp_path / "misspelt" / "mine.h5"
    with pytest.raises(ConfigError, match=f"data file {path} does not exist"):
        _launch(tmp_path / "run", path, f"data.generate={mode}")
    assert not (tmp_path / "misspelt").exists() and not started


def test_data_is_generated_where_the_user_asked_for_generated_data(
    tmp_path: Path, started: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under data/generated/ (auto) or with force; the checks themselves write nothing."""
    monkeypatch.chdir(tmp_path)
    _launch(tmp_path / "run", "data/generated/ns.h5")
    _launch(tmp_path / "run", tmp_path / "elsewhere.h5", "data.generate=force")
    assert started == ["data/generated/ns.h5", str(tmp_path / "elsewhere.h5")]
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ConfigError, match=r"data\.generate=never reads only"):
        _launch(tmp_path / "run", "data/generated/ns.h5", "data.generate=never")


def test_an_outdated_file_of_ours_is_regenerated_only_under_data_generated(
    ours: Path, tmp_path: Path, started: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cached = tmp_path / "data" / "generated" / "ns.h5"
    cached.parent.mkdir(parents=True)
    shutil.copyfile(ours, cached)
    _launch(tmp_path / "run", cached, "data.dataset.solver.viscosity=2e-3")
    assert started == [str(cached)]
    with pytest.raises(ConfigError, match=r"attribute 'viscosity' is 0\.001, expected 0\.002"):
        _launch(
            tmp_path / "run", cached, "data.dataset.solver.viscosity=2e-3", "data.generate=never"
        )
    before = _checksum(ours)
    with pytest.raises(ConfigError, match=f"data file {ours} was generated with other settings"):
        _launch(tmp_path / "run", ours, "data.dataset.solver.viscosity=2e-3")
    assert _checksum(ours) == before


def test_a_file_of_another_solver_version_is_refused_before_training(
    ours: Path, tmp_path: Path, started: list[str]
) -> None:
    path = tmp_path / "old.h5"
    shutil.copyfile(ours, path)
    with h5py.File(path, "r+") as file:
        file.attrs["solver_version"] = "0-old"
    with pytest.raises(
        ConfigError, match=f"attribute 'solver_version' is '0-old', expected {SOLVER_VERSION!r}"
    ):
        _launch(tmp_path / "run", path)
    assert not started


# ---------------------------------------------------------------------------- mesh CFD recipe
def _mesh_file(path: Path, nodes: int = 5, edge_end: int = 4, field_nodes: int = 5) -> Path:
    """A user's mesh file: 5 nodes, 2 triangles, 3 trajectories of 3 records of (u, v, w)."""
    with h5py.File(path, "w") as file:
        file["positions"] = np.random.default_rng(0).random((nodes, 2))
        file["triangles"] = np.array([[0, 1, 2], [1, 3, 2]])
        file["edge_index"] = np.array([[0, 1, 1, 2, 3, 2], [1, 0, 2, 1, 2, edge_end]])
        file["node_type"] = np.zeros(nodes, np.int64)
        file["fields"] = np.zeros((3, 3, field_nodes, 3), np.float32)
    return path


def _launch_mesh_cfd(run_dir: Path, path: Path, *overrides: str) -> None:
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                "+recipe=mesh_cfd", f"run_dir={run_dir}", f"data.path={path}",
                "data.test_trajectories=1", "eval.rollout_steps=1", *overrides,
            ],
        )  # fmt: skip
    train.launch(cfg)


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ({}, None),
        ({"field_nodes": 4}, "has 4 along node, but another dataset has 5"),
        ({"edge_end": 7}, "edge_index holds node ids from 0 to 7, expected 0 to 4"),
    ],
)
def test_the_mesh_recipe_reads_a_users_mesh_file_or_refuses_it_untouched(
    tmp_path: Path, started: list[str], shape: dict[str, int], message: str | None
) -> None:
    path = _mesh_file(tmp_path / "mesh.h5", **shape)
    before = _checksum(path)
    if message is None:
        _launch_mesh_cfd(tmp_path / "run", path)
        assert started == [str(path)]
    else:
        with pytest.raises(ConfigError, match=message):
            _launch_mesh_cfd(tmp_path / "run", path)
        assert not started
    with pytest.raises(ConfigError, match=r"data\.generate=force would overwrite"):
        _launch_mesh_cfd(tmp_path / "run", path, "data.generate=force")
    assert _checksum(path) == before


def test_the_mesh_recipe_does_not_generate_over_a_misspelt_path(
    tmp_path: Path, started: list[str]
) -> None:
    with pytest.raises(ConfigError, match="does not exist; data is generated only under"):
        _launch_mesh_cfd(tmp_path / "run", tmp_path / "cylindres.h5")
    assert list(tmp_path.iterdir()) == [] and not started
