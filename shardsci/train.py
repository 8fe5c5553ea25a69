"""The training command: ``shardsci-train +recipe=cfd mesh=4x2``.

The same entry point runs as ``python -m shardsci.train`` and, in a checkout, as ``python
train.py``. The configs ship with the package (``pkg://shardsci.configs``); a user adds config
directories of their own with ``hydra.searchpath=[file:///abs/dir, pkg://their.package]``.
The run directory (``outputs/<date>_<time>/`` unless ``run_dir=`` says otherwise) and every
relative data path are relative to the directory the command is started in; a run that fails
before it has written anything leaves no run directory behind.

Without torchrun or SLURM variables this process composes the config, checks it (NOTE [Config
errors before any rank starts]), plans the run once (NOTE [A run is planned once]) and starts
the plan's ranks on this machine; under torchrun or srun every rank composes, checks and plans
the same config and runs its part. ``-m ...
launcher=slurm`` submits the job with Hydra's submitit launcher. How recipes are found: NOTE
[How train.py finds recipes]. A mistake in the config, Hydra's composition errors included
(NOTE [Composition errors in one line]), is one line on standard error and exit status 2
(``HYDRA_FULL_ERROR=1`` shows the traceback).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import hydra
from hydra import compose, initialize_config_module
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from shardsci.distributed import detect_launch_env
from shardsci.training import (
    ConfigError,
    check_renamed_keys,
    check_run,
    discover_recipes,
    get_recipe,
    mesh_world_size,
    register_run_schemas,
    reported,
    run_ranks,
    traceback_requested,
    train_recipe,
)
from shardsci.training._renamed import renamed_key_hint

__all__ = ["check_composition", "launch", "main"]

CONFIG_MODULE = "shardsci.configs"


def _run_dir() -> str:
    """One directory for all ranks of a run: SHARDSCI_RUN_DIR, else named after the SLURM job
    or the torchrun rendezvous, else after the time this process started."""
    if os.environ.get("SHARDSCI_RUN_DIR"):
        return os.environ["SHARDSCI_RUN_DIR"]
    if os.environ.get("SLURM_JOB_ID"):
        return f"outputs/slurm-{os.environ['SLURM_JOB_ID']}"
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id != "none":
        return f"outputs/torchrun-{run_id}"
    return time.strftime("outputs/%Y-%m-%d_%H-%M-%S")


OmegaConf.register_new_resolver("shardsci_run_dir", _run_dir, use_cache=True)
OmegaConf.register_new_resolver("shardsci_world_size", lambda mesh: mesh_world_size(str(mesh)))
register_run_schemas()
discover_recipes("shardsci.recipes")


def launch(cfg: DictConfig, multirun: bool = False) -> int:
    """Check ``cfg`` and plan its run once (NOTE [A run is planned once]), then train its
    recipe here (one rank, or under torchrun/srun) or on the plan's ranks started here; the
    run's exit status."""
    if cfg.recipe is None:
        raise ConfigError("no recipe chosen: add +recipe=<name>, e.g. shardsci-train +recipe=cfd")
    try:
        recipe = get_recipe(cfg.recipe)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if cfg.dry_run:  # one process, any mesh: nothing to check against this machine's ranks
        from shardsci.planning import dry_run

        return dry_run(cfg)
    env = detect_launch_env()
    plan = check_run(cfg, recipe, env, multirun)
    return run_ranks(cfg, plan, env, train_recipe)


# NOTE [Composition errors in one line]
# Hydra reports its own composition errors (a misspelt key, an unknown choice, a value of the
# wrong type, an override it cannot parse) from inside ``hydra.main``, where no handler of ours
# runs: several lines, exit status 1. So the command composes the overrides once with Hydra's
# compose API first (about 0.15 s) and turns those errors into the one line and exit status of
# every other config mistake. With a flag (``-m``, ``--cfg``, ``--help``...) it leaves the
# command line to Hydra: a sweep is not one config. ``HYDRA_FULL_ERROR=1`` skips the check, so
# Hydra's full report appears. A renamed key (``RENAMED_KEYS``) is one line naming the new key,
# sweeps included.


def main() -> None:
    """The command: check that the overrides compose, then run (``_run``)."""
    with reported():
        check_composition(sys.argv[1:])
    _run()


def check_composition(arguments: list[str]) -> None:
    """Raise ``ConfigError`` with Hydra's composition error of ``arguments`` in one line; do
    nothing when they compose, contain a flag, or a traceback is requested."""
    check_renamed_keys([a for a in arguments if not a.startswith("-")])
    if traceback_requested() or any(argument.startswith("-") for argument in arguments):
        return
    try:
        with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
            compose("config", overrides=arguments)
    except HydraException as error:
        raise ConfigError(_one_line(error)) from error


def _one_line(error: HydraException) -> str:
    """Hydra's composition error as one line: its first line, the cause's first line, its
    hints; for a missing config the choices there are."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if isinstance(error, MissingConfigException):
        choices = [name for name in error.options or () if not name.endswith("_schema")]
        return lines[0] + (f"; expected one of: {', '.join(choices)}" if choices else "")
    head = lines[0].rstrip(".")
    if error.__cause__ is not None:
        head += ": " + str(error.__cause__).splitlines()[0]
    hint = renamed_key_hint(f"{error}\n{error.__cause__}")
    return "; ".join(
        [head, *(line[0].lower() + line[1:] for line in lines[1:]), *filter(None, [hint])]
    )


@hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name="config")
def _run(cfg: DictConfig) -> None:
    """Run the recipe ``cfg.recipe`` on the mesh ``cfg.mesh``."""
    run_dir = Path(cfg.run_dir)
    try:
        with reported():
            status = launch(cfg, multirun=HydraConfig.get().mode is RunMode.MULTIRUN)
    except BaseException:
        _discard_unused_run_dir(run_dir)
        raise
    if status:
        _discard_unused_run_dir(run_dir)
        sys.exit(status)


def _discard_unused_run_dir(run_dir: Path) -> None:
    """Remove ``run_dir`` after a failure if it holds only what Hydra writes when a job starts
    (``.hydra/``, the job's log). One process does it: global rank 0, or the process that
    started the ranks."""
    if os.environ.get("RANK", "0") != "0" or not run_dir.is_dir():
        return
    if all(
        (entry.name == ".hydra" and entry.is_dir()) or (entry.suffix == ".log" and entry.is_file())
        for entry in run_dir.iterdir()
    ):
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
