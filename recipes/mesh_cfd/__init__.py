"""The mesh CFD recipe: learn the next velocity of flow past cylinders on a triangle mesh.

``python train.py +recipe=mesh_cfd mesh=2``; its configs are ``configs/recipe/mesh_cfd.yaml``
(and ``configs/recipe/mesh_cfd/model/<model>.yaml``), ``configs/data/cylinders.yaml``,
``configs/eval/mesh_cfd.yaml``; the solver, the mesh and the dataset generator are
``cylinder_flow.py``, ``mesh.py`` and ``generate.py``.
"""

from recipes.mesh_cfd.checks import check
from recipes.mesh_cfd.config import SCHEMAS
from shardsci.training import Recipe, register_recipe

RECIPE = register_recipe(
    Recipe(name="mesh_cfd", run="recipes.mesh_cfd.train:run", schemas=SCHEMAS, check=check)
)
