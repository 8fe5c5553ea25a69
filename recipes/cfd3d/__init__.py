"""The 3-D CFD recipe: learn the next velocity field of forced 3-D turbulence in a periodic box,
domain-parallel over D, H and W.

``python train.py +recipe=cfd3d mesh=2x2x2`` (a 2x2x2 block: ``parallel=block`` is this
recipe's default; ``mesh=2x2`` a pencil over D and H, ``mesh=8`` slabs of D,
``parallel=auto`` makes the first axis data parallel). Its configs are
``configs/recipe/cfd3d.yaml`` (and ``configs/recipe/cfd3d/model/<model>.yaml``: the 3-D settings
of the FNO, the UNet and the Transolver), ``configs/data/ns3d.yaml`` and
``configs/eval/cfd3d.yaml``; the solver and dataset generator are ``navier_stokes.py``
(``spectral.py``) and ``generate.py``; the data and the task are ``data.py`` and ``task.py``,
the augmentation by the 48 symmetries of the box ``symmetry.py``, and a one-process probe of
what the model can learn ``learnability.py``.
"""

from shardsci.recipes.cfd3d.config import SCHEMAS
from shardsci.recipes.cfd3d.task import VELOCITY
from shardsci.training import Recipe, register_recipe

RECIPE = register_recipe(
    Recipe(
        name="cfd3d",
        task="shardsci.recipes.cfd3d.task:next_step",
        spatial_dims=("D", "H", "W"),
        schemas=SCHEMAS,
        check=VELOCITY.check,
        prepare="shardsci.recipes.cfd3d.task:prepare",
        dry_run_task="shardsci.recipes.cfd3d.task:random_next_step",
        predict_task="shardsci.recipes.cfd3d.task:predict",
        predict_check=VELOCITY.predict_check,
    )
)
