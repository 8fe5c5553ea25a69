"""The training command's rank body on the rank pool, for tests whose subject is what a run
computes rather than how the command starts it.

A ``train.py`` process costs its own start-up (``import shardsci.train``, about 5.3 s of CPU
here, then forking its ranks); a pool rank has paid it once for the whole suite. The body below
does on each pool rank what ``train_recipe`` does on a rank that ``train.py`` forked, in the
pool's process group instead of a new one, so its losses, metrics and checkpoints are those of
the command on the same mesh (tests/test_faults.py compares them bit for bit with ``train.py``
runs that were interrupted and resumed).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import shardsci.train  # noqa: F401  registers the config schemas and the recipes
from shardsci import gather_policy
from shardsci.distributed import LaunchEnv, detect_launch_env
from shardsci.training import Parallelism, RunContext, Trainer, check_run, get_recipe, instantiate

ROOT = Path(__file__).resolve().parents[1]


def compose_run(*overrides: str) -> DictConfig:
    """The run configuration ``python train.py +recipe=cfd <overrides>`` composes."""
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        return compose("config", overrides=["+recipe=cfd", *overrides])


def train_recipe_on_the_pool(overrides: list[str]) -> tuple[int, dict[str, float]]:
    """On every rank of the pool: the run planned as ``train.py`` plans it, then what
    ``train_recipe`` does on a rank ``train.py`` forked, under ``SHARDSCI_GATHER=error`` as
    the tests run the command; this rank's number of held-out samples and the final metrics."""
    cfg = compose_run(*overrides)
    plan = check_run(cfg, get_recipe(cfg.recipe), detect_launch_env({}), False)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert plan.world_size == world, (plan, world)
    env = LaunchEnv(rank, world, rank, world, "127.0.0.1", 0, "single")
    run = RunContext(env, Parallelism.build(plan, "cpu"), Path(cfg.run_dir), torch.device("cpu"))
    if run.leader:
        run.run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.train.seed)
    with gather_policy("error"):
        model = instantiate(cfg.model)
        task = get_recipe(cfg.recipe).load_task()(cfg, run)
        held_out = task.data.eval_batch()[0].shape[0]
        return held_out, Trainer(run, cfg, model, task).fit()
