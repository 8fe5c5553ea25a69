"""Everything the config shows is checked before any rank starts: one clear line, no fork.

``train.launch`` is called in this process on composed configs with the rank starter
(``run_ranks``) replaced by a tripwire, so a check that happened only inside the ranks would
trip it. One subprocess
run checks what a user sees: one line on standard error, exit status 2, and the traceback
only with ``HYDRA_FULL_ERROR=1``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import shardsci.train as train
from shardsci._commands import run_composed
from shardsci.distributed import detect_launch_env
from shardsci.training import (
    EXIT_USER_ERROR,
    ConfigError,
    check_run,
    get_recipe,
    max_local_ranks,
    reported,
)

ROOT = Path(__file__).resolve().parents[1]


def _compose(tmp_path: Path, *overrides: str):
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        return compose("config", overrides=["+recipe=cfd", f"run_dir={tmp_path}", *overrides])


@pytest.fixture
def no_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    def tripwire(*args, **kwargs):
        raise AssertionError("ranks were started before the config was refused")

    monkeypatch.setattr(train, "run_ranks", tripwire)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("SHARDSCI_MAX_LOCAL_RANKS", raising=False)


@pytest.mark.usefixtures("no_ranks")
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["mesh=1000"], r"mesh=1000 needs 1000 ranks, but train.py starts at most \d+"),
        (["mesh=-1x2"], "infers an axis from the world size"),
        (["mesh=2x0"], "axis 1 has size 0"),
        (["train.steps=-5"], r"train.steps=-5: expected an integer >= 0"),
        (["train.log_every=0"], r"train.log_every=0: expected an integer >= 1"),
        (["train.grad_clip=-1"], "train.grad_clip=-1.0: expected a positive norm"),
        (
            ["train.compile=true", "train.compile_backend=inductr"],
            r"train.compile_backend=inductr: expected one of \[.*'inductor'",
        ),
        (["mesh=3x2"], "train.global_batch=16 does not split over the 3 data-parallel"),
        (["launcher=slurm"], "add -m"),
        (["launcher.timeout_s=0"], "launcher.timeout_s=0.0: expected a positive"),
        (["train.resume=/no/such/checkpoint"], "checkpoint /no/such/checkpoint does not exist"),
        (["model=unet", "model.norm_groups=5"], "model: norm_groups=5 must divide"),
        (
            ["model=unet", "model.in_channels=2"],
            r"cannot take the recipe's fields .* expects input \(B, 2",
        ),
        (
            ["model=unet", "model.depth=6", "data.dataset.solver.resolution=32"],
            "UNet with depth=6 needs H and W divisible by 64",
        ),
        (["data.dataset.n_snapshots=1"], r"data.dataset: DatasetConfig.n_snapshots must be >= 2"),
        (["train.global_batch=1000"], "exceeds the 608 training pairs"),
        (["eval.rollout_steps=20"], r"eval.rollout_steps=20: expected 1 to 19"),
        (["eval.samples=0"], r"eval.samples=0: expected an integer >= 1"),
        (["train.rollout.steps=0"], r"train.rollout.steps=0: expected an integer >= 1"),
        (["train.rollout.steps=20"], r"train.rollout.steps=20: expected 1 to 19 \(the data"),
        (
            ["train.rollout.steps=3", "train.global_batch=1000"],
            "exceeds the 544 training 3-step rollouts",
        ),
    ],
)
def test_a_config_that_cannot_run_is_refused_before_any_rank_starts(
    tmp_path: Path, overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        train.launch(_compose(tmp_path, *overrides))


@pytest.mark.usefixtures("no_ranks")
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.global_batch=1000"], "exceeds the 144 training pairs"),
        (["mesh=2x2", "parallel=block"], "the mesh has 2 axes besides data parallelism but the "
         r"fields have 1 spatial dims \['node'\]"),
    ],
)  # fmt: skip
def test_the_mesh_cfd_recipe_is_checked_before_any_rank_starts(
    tmp_path: Path, overrides: list[str], message: str
) -> None:
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=["+recipe=mesh_cfd", f"run_dir={tmp_path}", *overrides])
    with pytest.raises(ConfigError, match=message):
        train.launch(cfg)


@pytest.mark.usefixtures("no_ranks")
def test_the_mesh_is_checked_against_the_fields_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHARDSCI_MAX_LOCAL_RANKS", "64")
    with pytest.raises(
        ConfigError, match="splits H over 64 ranks, but the fields have 32 cells along H"
    ):
        train.launch(
            _compose(
                tmp_path,
                "mesh=1x64",
                "data.dataset.solver.resolution=32",
                "model=unet",
                "model.depth=2",
            )
        )


def test_under_torchrun_the_mesh_must_cover_the_started_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    environ = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}
    environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    cfg = _compose(tmp_path, "mesh=4x2")
    with pytest.raises(ConfigError, match=r"has 8 ranks but the world size is 4 \(torchrun"):
        check_run(cfg, get_recipe("cfd"), detect_launch_env(environ), multirun=False)
    plan = check_run(
        _compose(tmp_path, "mesh=-1x2"), get_recipe("cfd"), detect_launch_env(environ), False
    )
    assert plan.shape == (2, 2)


def test_the_local_rank_limit_can_be_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDSCI_MAX_LOCAL_RANKS", "3")
    assert max_local_ranks()[0] == 3
    monkeypatch.setenv("SHARDSCI_MAX_LOCAL_RANKS", "many")
    with pytest.raises(ConfigError, match="expected a positive integer"):
        max_local_ranks()


def test_the_quick_start_passes_the_checks(tmp_path: Path) -> None:
    plan = check_run(
        _compose(tmp_path, "mesh=4x2"), get_recipe("cfd"), detect_launch_env({}), False
    )
    assert plan.world_size == 8 and plan.dp_size == 4


def test_a_user_sees_one_line_and_no_traceback(tmp_path: Path) -> None:
    """Without ``run_dir``: Hydra makes a run directory under ``outputs/`` before the check
    fails, and the failed run removes it (tests/test_command.py's ``mesh=-1x2`` case, which
    fails on the same path, runs under ``-m slow``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    done = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "+recipe=cfd", "mesh=1000"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    limit, why = max_local_ranks()
    assert done.returncode == EXIT_USER_ERROR, done.stderr
    assert done.stderr.splitlines() == [
        f"error: mesh=1000 needs 1000 ranks, but train.py starts at most {limit} on this "
        f"machine ({why}); run larger meshes with torchrun or srun over several nodes"
    ]
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == []


@pytest.mark.parametrize(
    ("override", "line"),
    [
        (
            "train.stepz=3",
            "Could not override 'train.stepz': Key 'stepz' not in 'TrainConfig'; to append to "
            "your config use +train.stepz=3",
        ),
        ("parallel=dpp", "In 'config': Could not find 'parallel/dpp'; expected one of: auto, "
         "block, slab"),
        ("model=unett", "In 'recipe/cfd': Could not find 'model/unett'; expected one of: fno, "
         "meshgraphnet, transolver, unet, vit"),
        ("train.steps=abc", "Error merging override train.steps=abc: Value 'abc' of type 'str' "
         "could not be converted to Integer"),
        ("optim.lr", "Error parsing override 'optim.lr'; missing EQUAL at '<EOF>'; see "
         "https://hydra.cc/docs/1.2/advanced/override_grammar/basic for details"),
    ],
)  # fmt: skip
def test_a_composition_error_is_one_line(
    monkeypatch: pytest.MonkeyPatch, override: str, line: str
) -> None:
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(ConfigError) as refused:
        train.check_composition(["+recipe=cfd", override])
    assert str(refused.value) == line


@pytest.mark.parametrize(
    ("arguments", "line"),
    [
        (["+recipe=cfd", "train.parallel=fsdp2"],
         "train.parallel was renamed train.dp_mode: write train.dp_mode=fsdp2"),
        (["-m", "+recipe=cfd", "train.parallel=ddp,fsdp2"],
         "train.parallel was renamed train.dp_mode: write train.dp_mode=ddp,fsdp2"),
        ([f"hydra.searchpath=[file://{ROOT}/tests/configs]", "+recipe=old_keys"],
         "In 'recipe/old_keys': ConfigKeyError raised while composing config:; key 'parallel' "
         "not in 'TrainConfig'; full_key: train.parallel; reference_type=TrainConfig; "
         "object_type=TrainConfig; train.parallel was renamed train.dp_mode"),
    ],
)  # fmt: skip
def test_a_renamed_key_names_the_new_one(
    monkeypatch: pytest.MonkeyPatch, arguments: list[str], line: str
) -> None:
    """On the command line (sweeps too) and in a config file."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(ConfigError) as refused:
        train.check_composition(arguments)
    assert str(refused.value) == line


def test_overrides_that_compose_or_carry_a_flag_are_left_to_hydra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    train.check_composition(["+recipe=cfd", "mesh=4x2", "model=unet"])
    train.check_composition(["-m", "+recipe=cfd", "mesh=1,2"])  # a sweep is not one config
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    train.check_composition(["+recipe=cfd", "train.stepz=3"])  # Hydra's own report follows


def test_a_misspelt_key_is_one_line_and_leaves_no_run_directory(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    done = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "+recipe=cfd", "train.stpes=3"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == EXIT_USER_ERROR, done.stderr
    assert done.stderr.splitlines() == [
        "error: Could not override 'train.stpes': Key 'stpes' not in 'TrainConfig'; to append "
        "to your config use +train.stpes=3"
    ]
    assert not (tmp_path / "outputs").exists()


def test_hydras_own_composition_is_the_one_checked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The command does not compose a third time: ``hydra.main``'s composition error, raised
    under HYDRA_FULL_ERROR for the moment, is the one line; the variable is unset after."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py", "+recipe=cfd", "model=unett"])
    monkeypatch.setattr(train, "check_composition", None)  # not called
    with pytest.raises(ConfigError) as refused:
        run_composed(sys.argv[1:], train._run)
    assert str(refused.value) == (
        "In 'recipe/cfd': Could not find 'model/unett'; expected one of: fno, meshgraphnet, "
        "transolver, unet, vit"
    )
    assert "HYDRA_FULL_ERROR" not in os.environ and not (tmp_path / "outputs").exists()


def test_hydra_full_error_shows_the_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as stopped, reported():
        raise ConfigError("what is wrong; what is expected")
    assert stopped.value.code == EXIT_USER_ERROR
    assert capsys.readouterr().err == "error: what is wrong; what is expected\n"
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ConfigError), reported():
        raise ConfigError("what is wrong; what is expected")
