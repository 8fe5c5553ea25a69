"""What every rank of a training run does, for any recipe: the recipe only chooses.

A recipe (``Recipe``) says what its data, loss and evaluation are (its ``Task``) and, through
its config, what its model is; ``train_recipe`` does the rest, the same for every recipe: the
process group and the run's mesh from the launcher's plan (NOTE [A run is planned once]), the
recipe's data preparation on rank 0 while the others wait, the model (``cfg.model``) on this
rank's device, and the ``Trainer``.
"""

from __future__ import annotations

from omegaconf import DictConfig

from shardsci.training._parallelism import ParallelPlan
from shardsci.training._recipes import get_recipe
from shardsci.training._run import prepare_data, start_run
from shardsci.training._schema import instantiate
from shardsci.training._trainer import Trainer

__all__ = ["train_recipe"]


def train_recipe(cfg: DictConfig, plan: ParallelPlan) -> dict[str, float]:
    """Train ``cfg.recipe`` on this rank's part of the mesh of ``plan``; the final metrics
    (on every rank)."""
    recipe = get_recipe(cfg.recipe)
    with start_run(cfg, plan) as run:
        prepare_data(recipe, cfg)
        model = instantiate(cfg.model).to(run.device)
        task = recipe.load_task()(cfg, run)
        return Trainer(run, cfg, model, task).fit()
