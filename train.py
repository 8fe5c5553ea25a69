"""Train a recipe: ``python train.py +recipe=cfd mesh=4x2``.

Without torchrun or SLURM variables this process composes the config and starts the mesh's
ranks on this machine; under torchrun or srun every rank composes the same config and runs
its part. ``-m ... launcher=slurm`` submits the job with Hydra's submitit launcher. Recipes
are the packages under ``recipes/`` (NOTE [How train.py finds recipes]).
"""

from __future__ import annotations

import os
import sys
import time

import hydra
from omegaconf import DictConfig, OmegaConf

from shardsci.distributed import detect_launch_env
from shardsci.training import (
    discover_recipes,
    get_recipe,
    mesh_world_size,
    register_run_schemas,
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


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    if cfg.recipe is None:
        raise SystemExit("choose a recipe, e.g. python train.py +recipe=cfd")
    run = get_recipe(cfg.recipe).load_run()
    launched = detect_launch_env().launcher != "single"
    world_size = mesh_world_size(str(cfg.mesh))
    if launched or world_size == 1:
        run(cfg)
        return
    if world_size is None:
        raise SystemExit(
            f"mesh={cfg.mesh} infers an axis from the world size; start it with torchrun or "
            f"srun, or give every axis size"
        )
    status = run_local_ranks(world_size, run, cfg)
    if status:
        sys.exit(status)


if __name__ == "__main__":
    main()
