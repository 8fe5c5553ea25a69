"""shardsci outside its checkout: installed by pip into a fresh environment, used from a project
directory that has a ``models`` package of its own.

The environment is a new virtual environment outside the repository whose dependencies (torch
and the rest) are linked from the one running the tests, so that nothing is downloaded and pip
never resolves another torch; shardsci itself is installed from a copy of the checkout with
``pip install --no-deps``, as a wheel, and the example recipe package
``examples/recipe_package`` beside it. One environment for the module, two trainings on 2
ranks: about 30 s on a quiet 2-core machine (100 s under heavy load).
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_NOT_COPIED_AT_TOP = {".git", ".venv", "outputs", "multirun", "build", "data", "wandb"}
_NOT_DEPENDENCIES = ("shardsci", "__editable__", "smoothing_recipe", "smoothing-recipe")
TIMEOUT_S = 300


class Installed:
    """A fresh environment with shardsci installed, and a user's project directory."""

    def __init__(self, root: Path):
        self.project = root / "project"
        self.bin = root / "env" / "bin"

    def run(self, *command: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["OMP_NUM_THREADS"] = "1"
        done = subprocess.run(
            [str(self.bin / command[0]), *command[1:]],
            cwd=cwd or self.project,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        assert done.returncode == 0, (
            f"{command} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        )
        return done


def _link_dependencies(target: Path) -> None:
    """Link every distribution of this environment except shardsci's into ``target``."""
    target.mkdir()
    for source in map(Path, site.getsitepackages()):
        for entry in source.iterdir():
            wanted = entry.suffix != ".pth" and not entry.name.startswith(_NOT_DEPENDENCIES)
            if wanted and not (target / entry.name).exists():
                (target / entry.name).symlink_to(entry)


def _copy_checkout(target: Path) -> Path:
    def ignore(directory: str, names: list[str]) -> set[str]:
        top = _NOT_COPIED_AT_TOP if Path(directory) == ROOT else set()
        return {n for n in names if n in top or n == "__pycache__" or n.endswith(".egg-info")}

    shutil.copytree(ROOT, target, symlinks=True, ignore=ignore)
    return target


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("installed")
    venv.create(root / "env", with_pip=False)
    _link_dependencies(root / "dependencies")
    (site_packages,) = (root / "env" / "lib").glob("python*/site-packages")
    (site_packages / "dependencies.pth").write_text(f"{root / 'dependencies'}\n")
    environment = Installed(root)
    for package in (_copy_checkout(root / "checkout"), root / "checkout/examples/recipe_package"):
        environment.run(
            "python", "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
            str(package), cwd=root,
        )  # fmt: skip
    models = environment.project / "models"
    models.mkdir(parents=True)
    (models / "__init__.py").write_text('WHOSE = "the user\'s"\n')
    return environment


@pytest.fixture(scope="module")
def imported(installed: Installed) -> list[str]:
    """One interpreter in the user's directory: the zoo imported beside the user's ``models``
    package, then the command's recipes (two tests, one start-up of torch)."""
    done = installed.run(
        "python",
        "-c",
        "import models, shardsci, shardsci.models\n"
        "from shardsci.models import UNet\n"
        "print(models.WHOSE, shardsci.__file__, UNet.__module__, sep='|')\n"
        "import shardsci.train, shardsci.training as t\n"
        "print(t.recipe_names())",
    )
    return done.stdout.strip().splitlines()


def test_the_zoo_imports_beside_a_models_package_of_the_users(imported: list[str]) -> None:
    whose, shardsci_file, unet_module = imported[0].split("|")
    assert whose == "the user's"
    assert "site-packages" in shardsci_file and not shardsci_file.startswith(str(ROOT))
    assert unet_module == "shardsci.models.unet"


def test_the_command_trains_the_cfd_recipe_from_the_users_directory(
    installed: Installed,
) -> None:
    """No run_dir and a relative data path: both land in the user's directory."""
    installed.run(
        "shardsci-train", "+recipe=cfd", "mesh=2x1", "train.steps=5", "logger=none",
        "data.path=data/generated/ns_tiny.h5", "data.dataset.solver.resolution=32",
        "data.dataset.n_train=4", "data.dataset.n_test=2", "data.dataset.n_snapshots=6",
        "train.global_batch=4", "eval.samples=4", "eval.rollout_steps=1",
    )  # fmt: skip
    assert (installed.project / "data" / "generated" / "ns_tiny.h5").is_file()
    (run_dir,) = (installed.project / "outputs").iterdir()
    assert json.loads((run_dir / "metrics.json").read_text())["step"] == 5


def test_an_installed_recipe_package_is_found_by_its_entry_point(imported: list[str]) -> None:
    """``smoothing`` comes only from the entry point of ``examples/recipe_package``: the
    command finds it without the recipe's configs on the search path."""
    assert "smoothing" in imported[1] and "'cfd'" in imported[1]


def test_an_installed_recipe_package_trains_through_the_command_on_2_ranks(
    installed: Installed,
) -> None:
    run_dir = installed.project / "smoothing_run"
    installed.run(
        "shardsci-train", "hydra.searchpath=[pkg://smoothing_recipe.configs]",
        "+recipe=smoothing", "mesh=1x2", "train.steps=4", "logger=none", f"run_dir={run_dir}",
    )  # fmt: skip
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["step"] == 4 and 0 < metrics["eval_mse"] < 10
