"""An example recipe that lives outside shardsci: learn a smoothing stencil, domain-parallel.

Installed, it is found through its ``shardsci.recipes`` entry point (``pyproject.toml``);
its configs are ``smoothing_recipe/configs`` (``recipe/smoothing.yaml`` and two config groups
of its own, ``smoother`` and ``fields``), which the user adds to Hydra's search path:
``shardsci-train hydra.searchpath=[pkg://smoothing_recipe.configs] +recipe=smoothing mesh=1x2``.
"""

from shardsci.training import Recipe, register_recipe, schema_of
from smoothing_recipe.model import StencilNetConfig
from smoothing_recipe.task import FieldsConfig

RECIPE = register_recipe(
    Recipe(
        name="smoothing",
        task="smoothing_recipe.task:smoothing",
        spatial_dims=("H", "W"),
        schemas={
            ("smoother", "stencil_schema"): schema_of(
                StencilNetConfig, target="smoothing_recipe.model.StencilNet"
            ),
            ("fields", "random_schema"): FieldsConfig,
        },
    )
)
