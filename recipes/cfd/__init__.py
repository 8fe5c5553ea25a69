"""The CFD recipe: learn the next vorticity field of 2-D Navier–Stokes, domain-parallel.

``python train.py +recipe=cfd mesh=4x2``; its configs are ``configs/recipe/cfd.yaml`` (and
``configs/recipe/cfd/model/<model>.yaml``, this recipe's settings of each zoo model),
``configs/data/ns2d.yaml``; the solver and dataset generator are ``navier_stokes.py`` and
``generate.py``.
"""

from recipes.cfd.checks import check
from recipes.cfd.config import SCHEMAS
from shardsci.training import Recipe, register_recipe

RECIPE = register_recipe(
    Recipe(
        name="cfd",
        run="recipes.cfd.train:run",
        schemas=SCHEMAS,
        check=check,
        plan="recipes.cfd.plan:planned_task",
    )
)
