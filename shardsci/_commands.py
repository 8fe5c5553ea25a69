"""What the commands ``shardsci-train`` and ``shardsci-predict`` share: their configs, the
recipes, Hydra's composition errors as one line, and the run directory of a failed run.

Importing this module registers the run schemas and the config resolvers and finds the recipes
(NOTE [How train.py finds recipes]); like the commands, it sits above the recipes.

NOTE [Composition errors in one line]
Hydra reports its own composition errors (a misspelt key, an unknown choice, a value of the
wrong type, an override it cannot parse) from inside ``hydra.main``, where no handler of ours
runs: several lines, exit status 1. So a command (``run_composed``) runs ``hydra.main`` with
``HYDRA_FULL_ERROR=1``, under which Hydra raises its errors instead of printing them, and turns
a composition error into the one line and exit status of every other config mistake; the run
itself (``run_launched``) starts with the variable as the user had it, so its errors, its ranks
and Hydra's report of a failed run are what they were. Composing the overrides a third time
(Hydra composes twice: ``get_mode``, then the run), as ``check_composition`` does, cost 4.5 s of
start-up per process at load 50, paid by every rank. ``check_composition`` stays for the
in-process tests of the one line. With a flag (``-m``, ``--cfg``, ``--help``...) it leaves the
command line to Hydra: a sweep is not one config. ``HYDRA_FULL_ERROR=1`` skips the check, so
Hydra's full report appears. A renamed key (``RENAMED_KEYS``) is one line naming the new key,
sweeps included.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from hydra import compose, initialize_config_module
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from shardsci.training import (
    TRACEBACK_VAR,
    ConfigError,
    check_renamed_keys,
    discover_recipes,
    mesh_world_size,
    register_run_schemas,
    reported,
    traceback_requested,
)
from shardsci.training._renamed import renamed_key_hint

__all__ = ["CONFIG_MODULE", "check_composition", "run_composed", "run_launched"]

CONFIG_MODULE = "shardsci.configs"
"""Where the commands' configs are: ``config.yaml`` (training) and ``predict.yaml``."""


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


def check_composition(arguments: list[str], config_name: str = "config") -> None:
    """Raise ``ConfigError`` with Hydra's composition error of ``arguments`` in one line; do
    nothing when they compose, contain a flag, or a traceback is requested."""
    check_renamed_keys([a for a in arguments if not a.startswith("-")])
    if traceback_requested() or any(argument.startswith("-") for argument in arguments):
        return
    try:
        with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
            compose(config_name, overrides=arguments)
    except HydraException as error:
        raise ConfigError(_one_line(error)) from error


_HYDRA_RAISES = False
"""Whether ``run_composed`` set ``HYDRA_FULL_ERROR`` for Hydra's composition, which
``run_launched`` takes back before the run."""


def run_composed(arguments: list[str], run: Callable[[], None]) -> None:
    """Call ``run`` (a ``hydra.main`` function) with Hydra's composition errors of
    ``arguments`` (``sys.argv[1:]``) raised as ``ConfigError`` in one line; with a flag, or a
    traceback requested, Hydra reports them itself. NOTE [Composition errors in one line]."""
    global _HYDRA_RAISES
    check_renamed_keys([a for a in arguments if not a.startswith("-")])
    if traceback_requested() or any(argument.startswith("-") for argument in arguments):
        run()
        return
    os.environ[TRACEBACK_VAR] = "1"
    _HYDRA_RAISES = True
    try:
        run()
    except HydraException as error:
        if not _HYDRA_RAISES:  # raised by the run, and printed by Hydra as before
            raise
        raise ConfigError(_one_line(error)) from error
    finally:
        if _HYDRA_RAISES:
            os.environ.pop(TRACEBACK_VAR, None)
            _HYDRA_RAISES = False


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


def run_launched(cfg: DictConfig, launch: Callable[[DictConfig, bool], int]) -> None:
    """Inside ``hydra.main``: ``launch(cfg, multirun)``, its user errors as one line (NOTE
    [Errors for people]); a run that failed leaves no run directory holding only Hydra's files.
    Exits with the run's status when it is not 0."""
    global _HYDRA_RAISES
    if _HYDRA_RAISES:  # composed: the run sees HYDRA_FULL_ERROR as the user set it (unset)
        os.environ.pop(TRACEBACK_VAR, None)
        _HYDRA_RAISES = False
    run_dir = Path(cfg.run_dir)
    try:
        with reported():
            status = launch(cfg, HydraConfig.get().mode is RunMode.MULTIRUN)
    except BaseException:
        _discard_unused_run_dir(run_dir)
        raise
    if status:
        _discard_unused_run_dir(run_dir)
        raise SystemExit(status)


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
