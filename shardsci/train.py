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
(NOTE [Composition errors in one line] in ``shardsci/_commands.py``), is one line on standard
error and exit status 2 (``HYDRA_FULL_ERROR=1`` shows the traceback).
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from shardsci._commands import CONFIG_MODULE, check_composition, run_composed, run_launched
from shardsci.distributed import detect_launch_env
from shardsci.training import (
    ConfigError,
    check_run,
    get_recipe,
    reported,
    run_ranks,
    train_recipe,
)

__all__ = ["check_composition", "launch", "main"]


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
    env = detect_launch_env()
    if cfg.dry_run:  # one process, any mesh: nothing to check against this machine's ranks
        if env.rank != 0:  # under torchrun or srun every rank runs this: rank 0 plans for all
            return 0
        from shardsci.planning import dry_run

        return dry_run(cfg)
    from shardsci.planning import choose_for_launch  # parallel=auto's choice (mesh=N)

    cfg = choose_for_launch(cfg, env)
    plan = check_run(cfg, recipe, env, multirun)
    return run_ranks(cfg, plan, env, train_recipe)


def main() -> None:
    """The command: run ``_run``, Hydra's composition errors in one line."""
    with reported():
        run_composed(sys.argv[1:], _run)


@hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name="config")
def _run(cfg: DictConfig) -> None:
    """Run the recipe ``cfg.recipe`` on the mesh ``cfg.mesh``."""
    run_launched(cfg, launch)


if __name__ == "__main__":
    main()
