"""Everything a composed run config allows to check, checked once before any rank starts.

NOTE [Config errors before any rank starts]
A mistake that the config already shows (a mesh this machine cannot run, a batch that does not
split over the replicas, a negative step count, ``launcher=slurm`` without ``-m``, a model
that cannot take the data's shape, a user's file that is not what the recipe reads) is found
by ``check_run`` in the launching process: one ``ConfigError`` (NOTE [Errors for people]),
before a process is forked, a GPU touched or a file written. Under torchrun and srun every rank
is a launching process and raises the same error. The ranks keep their own checks (they guard
the library's API), but a run that passes ``check_run`` should not meet them.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from shardsci.checkpoint import CheckpointError, resolve_resume
from shardsci.distributed import LaunchEnv
from shardsci.training._errors import ConfigError
from shardsci.training._launcher import LauncherKind
from shardsci.training._parallelism import ParallelConfig, ParallelPlan
from shardsci.training._recipes import Recipe
from shardsci.training._schema import config_from, config_type_of, instantiate
from shardsci.training._trainer import TrainConfig

__all__ = [
    "LOCAL_RANKS_PER_CPU",
    "MAX_LOCAL_RANKS_VAR",
    "check_model_input",
    "check_run",
    "max_local_ranks",
    "plan_parallelism",
]

MAX_LOCAL_RANKS_VAR = "SHARDSCI_MAX_LOCAL_RANKS"
"""Overrides how many ranks ``train.py`` may start on this machine."""

LOCAL_RANKS_PER_CPU = 4
"""CPU ranks started per core at most (the quick start runs 8 on 2 cores)."""

_MIN_LOCAL_CPU_RANKS = 8


def check_run(cfg: DictConfig, recipe: Recipe, env: LaunchEnv, multirun: bool) -> ParallelPlan:
    """Check the composed ``cfg`` of ``recipe``; return the run's plan, the one the ranks
    build their mesh from (NOTE [A run is planned once]).

    Parameters
    ----------
    cfg : DictConfig
        The composed run config.
    recipe : Recipe
        The chosen recipe; its ``check`` runs last.
    env : LaunchEnv
        How this process was launched (``single``: ``train.py`` will start the ranks).
    multirun : bool
        Whether Hydra runs in ``-m`` mode (the only mode in which its launchers run).

    Raises
    ------
    ConfigError
        The first problem found, in one line naming the setting and what is expected.
    """
    _check_launcher(cfg, env, multirun)
    plan = plan_parallelism(cfg, recipe, env)
    _check_train(OmegaConf.to_object(cfg.train), plan, Path(cfg.run_dir) / "checkpoints")
    _check_component("model", cfg.model)
    if recipe.check is not None:
        try:
            recipe.check(cfg, plan)
        except (ValueError, CheckpointError) as error:
            raise ConfigError(str(error)) from error
    return plan


def check_model_input(model: DictConfig, sample_shape: tuple[int, ...]) -> None:
    """Raise ``ValueError`` if the model of the config node ``model`` cannot take a batch of
    fields of ``sample_shape`` (``(C, *spatial)``): it runs once on the meta device (shapes
    only, no memory, no compute). For a recipe's ``check``; a model with an op that has no meta
    kernel passes (the ranks will tell)."""
    shape = (1, *sample_shape)
    try:
        with torch.device("meta"):
            instantiate(model)(torch.empty(shape))
    except NotImplementedError:
        return
    except (ValueError, RuntimeError) as error:
        fields = ", ".join(str(n) for n in sample_shape)
        raise ValueError(
            f"model {model._target_} cannot take the recipe's fields of shape (batch, {fields}): "
            f"{error}"
        ) from error


def max_local_ranks() -> tuple[int, str]:
    """How many ranks ``train.py`` may start on this machine, and why."""
    if os.environ.get(MAX_LOCAL_RANKS_VAR):
        text = os.environ[MAX_LOCAL_RANKS_VAR]
        if not text.isdigit() or int(text) < 1:
            raise ConfigError(f"{MAX_LOCAL_RANKS_VAR}={text!r}: expected a positive integer")
        return int(text), f"{MAX_LOCAL_RANKS_VAR}={text}"
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        return count, f"one rank per GPU, {count} visible"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    limit = max(_MIN_LOCAL_CPU_RANKS, LOCAL_RANKS_PER_CPU * (cores or 1))
    return (
        limit,
        f"{LOCAL_RANKS_PER_CPU} per CPU core, {cores} cores; {MAX_LOCAL_RANKS_VAR} sets it",
    )


def _check_launcher(cfg: DictConfig, env: LaunchEnv, multirun: bool) -> None:
    if cfg.launcher.kind is LauncherKind.slurm and env.launcher == "single" and not multirun:
        raise ConfigError(
            "launcher=slurm submits the run through Hydra's submitit launcher, which runs only "
            "in multirun mode: add -m (python train.py -m +recipe=... launcher=slurm), or use "
            "sbatch scripts/slurm/train.sbatch"
        )
    for name in ("timeout_s", "grace_s"):
        if not cfg.launcher[name] > 0:
            raise ConfigError(
                f"launcher.{name}={cfg.launcher[name]}: expected a positive number of seconds"
            )
    if cfg.launcher.max_restarts < 0:
        raise ConfigError(
            f"launcher.max_restarts={cfg.launcher.max_restarts}: expected an integer >= 0"
        )


def plan_parallelism(cfg: DictConfig, recipe: Recipe, env: LaunchEnv) -> ParallelPlan:
    """The plan of ``cfg.mesh`` and ``cfg.parallel`` for ``recipe``'s fields over the ranks this
    launch will have: torchrun's or srun's, or those ``train.py`` starts here (checked against
    what this machine allows). The one place a run's mesh is parsed and its axis roles resolved
    (NOTE [A run is planned once]).

    Raises
    ------
    ConfigError
        Naming ``mesh=...`` and what does not fit.
    """
    mesh = str(cfg.mesh)
    launched = env.launcher != "single"
    try:
        parallel = config_from(ParallelConfig, cfg.parallel)
        world_size = env.world_size if launched else None
        plan = ParallelPlan.of(mesh, parallel, recipe.spatial_dims, world_size)
    except (TypeError, ValueError) as error:
        started = f" ({env.launcher} started {env.world_size} ranks)" if launched else ""
        message = str(error)
        prefix = "" if message.startswith(f"mesh={mesh}") else f"mesh={mesh}: "
        raise ConfigError(f"{prefix}{message}{started}") from error
    if not launched:
        _check_local_ranks(mesh, plan.world_size)
    return plan


def _check_local_ranks(mesh: str, world_size: int) -> None:
    limit, why = max_local_ranks()
    if world_size > limit:
        raise ConfigError(
            f"mesh={mesh} needs {world_size} ranks, but train.py starts at most {limit} on this "
            f"machine ({why}); run larger meshes with torchrun or srun over several nodes"
        )


def _check_train(train: TrainConfig, plan: ParallelPlan, checkpoints: Path) -> None:
    try:
        train.check()
    except ValueError as error:
        raise ConfigError(str(error)) from error
    if train.global_batch % plan.dp_size:
        raise ConfigError(
            f"train.global_batch={train.global_batch} does not split over the {plan.dp_size} "
            f"data-parallel replicas of mesh {plan.describe()}: expected a multiple of "
            f"{plan.dp_size}"
        )
    try:
        resolve_resume(checkpoints, train.resume)
    except CheckpointError as error:
        raise ConfigError(f"train.resume={train.resume}: {error}") from error


def _check_component(group: str, node: DictConfig) -> None:
    """Build the config dataclass behind ``node`` (if its schema has one): its own checks run."""
    config_type = config_type_of(node)
    if config_type is None:
        return
    try:
        config_from(config_type, node)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{group}: {error}") from error
