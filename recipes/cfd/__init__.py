"""The CFD recipe: learn the next vorticity field of 2-D Navier–Stokes, domain-parallel.

``python train.py +recipe=cfd mesh=4x2``; its configs are ``configs/recipe/cfd.yaml`` (and
``configs/recipe/cfd/model/<model>.yaml``, this recipe's settings of each zoo model),
``configs/data/ns2d.yaml``; the solver and dataset generator are ``navier_stokes.py`` and
``generate.py``; the task is ``task.py``.
"""

from shardsci.recipes.cfd.checks import check
from shardsci.recipes.cfd.config import SCHEMAS
from shardsci.training import Recipe, register_recipe

RECIPE = register_recipe(
    Recipe(
        name="cfd",
        task="shardsci.recipes.cfd.task:next_step",
        spatial_dims=("H", "W"),
        schemas=SCHEMAS,
        check=check,
        prepare="shardsci.recipes.cfd.trajectories:prepare",
        dry_run_task="shardsci.recipes.cfd.task:random_next_step",
    )
)
