"""The recipe registry: recipes register themselves, their config schemas and their checks.

NOTE [How train.py finds recipes]
A recipe is a ``Recipe``: a name (``+recipe=<name>`` selects ``configs/recipe/<name>.yaml``),
the function every rank runs (``"package.module:function"``, imported when the recipe is
chosen, so finding recipes imports no training code), the Hydra schemas of its config groups
(stored in Hydra's ConfigStore on registration) and an optional check of a composed config
run once, in the launching process, before any rank starts. A recipe package registers itself
when imported (``register_recipe`` in its ``__init__``); ``discover_recipes("recipes")``
imports every sub-package of ``recipes``, so a new recipe is a new package there and a
``configs/recipe/<name>.yaml``, with no edit elsewhere. Other sources of recipes (a
``shardsci.recipes`` entry-point group, a user's package named on the command line) only have
to import modules that call ``register_recipe``.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from shardsci.training._layout import LayoutPlan

__all__ = ["Recipe", "discover_recipes", "get_recipe", "recipe_names", "register_recipe"]

RecipeCheck = Callable[[DictConfig, LayoutPlan], None]
"""``check(cfg, plan)``: raise ``ValueError`` with one clear line if ``cfg`` cannot run on the
mesh ``plan`` (NOTE [Config errors before any rank starts])."""


@dataclass(frozen=True)
class Recipe:
    """A training task that ``train.py`` can run.

    Attributes
    ----------
    name : str
        Selected by ``+recipe=<name>``.
    run : str
        ``"package.module:function"``; ``function(cfg)`` runs on every rank and returns the
        final metrics.
    schemas : mapping
        ``(group, name) -> dataclass``: Hydra schemas of the recipe's config groups, stored in
        the ConfigStore (``configs/<group>/<option>.yaml`` names them in its defaults list).
    check : callable or None
        ``check(cfg, plan)``, run in the launching process before any rank starts, after the
        generic checks: raise ``ValueError`` naming what is wrong with ``cfg`` and what is
        expected (the data's shape against the mesh and the model, the data file, ...).
    plan : str or None
        ``"package.module:function"`` for ``dry_run=true`` (``shardsci.planning``):
        ``function(cfg, context, device)`` returns the model and a ``Task`` whose batches have
        the shapes and layouts of the real ones, made without reading data, on ``device``.
    """

    name: str
    run: str
    schemas: Mapping[tuple[str, str], type] = field(default_factory=dict)
    check: RecipeCheck | None = None
    plan: str | None = None

    def __post_init__(self) -> None:
        module, _, function = self.run.partition(":")
        if not (self.name.isidentifier() and module and function.isidentifier()):
            raise ValueError(
                f"Recipe(name={self.name!r}, run={self.run!r}): expected an identifier as the "
                f"name and 'package.module:function' as run"
            )

    def load_run(self) -> Callable[[DictConfig], Mapping[str, float]]:
        """Import and return the function every rank runs."""
        return _load(self.run)

    def load_plan(self) -> Callable[..., Any]:
        """Import and return the dry run's ``plan`` function (see ``plan``)."""
        if self.plan is None:
            raise ValueError(f"recipe {self.name!r} has no plan for a dry run")
        return _load(self.plan)


def _load(path: str) -> Callable[..., Any]:
    module, _, function = path.partition(":")
    return getattr(importlib.import_module(module), function)


_RECIPES: dict[str, Recipe] = {}


def register_recipe(recipe: Recipe) -> Recipe:
    """Make ``recipe`` available to ``+recipe=<name>`` and store its schemas in Hydra.

    Registering the same recipe again is a no-op; another recipe under a taken name is an
    error.
    """
    known = _RECIPES.get(recipe.name)
    if known is not None and known != recipe:
        raise ValueError(f"a different recipe is already registered as {recipe.name!r}: {known}")
    _RECIPES[recipe.name] = recipe
    store = ConfigStore.instance()
    for (group, name), schema in recipe.schemas.items():
        store.store(group=group, name=name, node=schema)
    return recipe


def get_recipe(name: Any) -> Recipe:
    """The registered recipe ``name``; a ``ValueError`` naming the known ones otherwise."""
    if name not in _RECIPES:
        known = ", ".join(sorted(_RECIPES)) or "none"
        raise ValueError(f"no recipe {name!r}; choose one with +recipe=<name>: {known}")
    return _RECIPES[name]


def recipe_names() -> list[str]:
    """Names of the registered recipes, sorted."""
    return sorted(_RECIPES)


def discover_recipes(package: str) -> list[str]:
    """Import every sub-package of ``package`` (each registers its recipe); the names found.

    See NOTE [How train.py finds recipes].
    """
    root = importlib.import_module(package)
    for module in pkgutil.iter_modules(root.__path__, prefix=f"{package}."):
        if module.ispkg:
            importlib.import_module(module.name)
    return recipe_names()
