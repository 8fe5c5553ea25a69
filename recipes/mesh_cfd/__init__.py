"""The mesh CFD recipe: learn the next velocity of flow past cylinders on a triangle mesh.

``python train.py +recipe=mesh_cfd mesh=2``; its configs are ``configs/recipe/mesh_cfd.yaml``
(and ``configs/recipe/mesh_cfd/model/<model>.yaml``), ``configs/data/cylinders.yaml``,
``configs/eval/mesh_cfd.yaml``; the solver, the triangle mesh and the dataset generator are
``cylinder_flow.py``, ``mesh.py`` and ``generate.py``; the task is ``task.py``. The DeviceMesh's
one domain axis splits the triangle mesh's nodes (``mesh=N``, or ``mesh=DxN`` with data
parallelism on the first axis).
"""

from shardsci.recipes.mesh_cfd.checks import check
from shardsci.recipes.mesh_cfd.config import SCHEMAS
from shardsci.recipes.mesh_cfd.meshfile import NODES
from shardsci.training import Recipe, register_recipe

RECIPE = register_recipe(
    Recipe(
        name="mesh_cfd",
        task="shardsci.recipes.mesh_cfd.task:next_velocity",
        spatial_dims=(NODES,),
        schemas=SCHEMAS,
        check=check,
        prepare="shardsci.recipes.mesh_cfd.meshfile:prepare",
    )
)
