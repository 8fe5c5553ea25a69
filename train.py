"""Train a recipe: ``python train.py +recipe=cfd mesh=4x2``.

Without torchrun or SLURM variables this process composes the config, checks it (NOTE [Config
errors before any rank starts]) and starts the mesh's ranks on this machine; under torchrun or
srun every rank composes and checks the same config and runs its part. ``-m ...
launcher=slurm`` submits the job with Hydra's submitit launcher. Recipes are the packages
under ``recipes/`` (NOTE [How train.py finds recipes]). A mistake in the config is one line on
standard error and exit status 2 (``HYDRA_FULL_ERROR=1`` shows the traceback).
"""

from __future__ import annotations

import os
import sys
import time

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from shardsci.distributed import detect_launch_env
from shardsci.training import (
    ConfigError,
    check_run,
    discover_recipes,
    get_recipe,
    mesh_world_size,
    register_run_schemas,
    reported,
    run_local_ranks,
)


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
discover_recipes("recipes")


def launch(cfg: DictConfig, multirun: bool = False) -> int:
    """Check ``cfg``, then run its recipe here (one rank, or under torchrun/srun) or on the
    mesh's ranks started here; the run's exit status."""
    if cfg.recipe is None:
        raise ConfigError("no recipe chosen: add +recipe=<name>, e.g. python train.py +recipe=cfd")
    try:
        recipe = get_recipe(cfg.recipe)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if cfg.dry_run:  # one process, any mesh: nothing to check against this machine's ranks
        from shardsci.planning import dry_run

        return dry_run(cfg)
    env = detect_launch_env()
    plan = check_run(cfg, recipe, env, multirun)
    run = recipe.load_run()
    if env.launcher != "single" or plan.world_size == 1:
        run(cfg)
        return 0
    OmegaConf.resolve(cfg)  # one run directory for every rank, resolved here
    return run_local_ranks(
        plan.world_size,
        run,
        cfg,
        grace_s=cfg.launcher.grace_s,
        max_restarts=cfg.launcher.max_restarts,
    )


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    with reported():
        status = launch(cfg, multirun=HydraConfig.get().mode is RunMode.MULTIRUN)
    if status:
        sys.exit(status)


if __name__ == "__main__":
    main()
