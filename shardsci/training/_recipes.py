"""The recipe registry: recipes register themselves, their config schemas and their checks.

NOTE [How train.py finds recipes]
A recipe is a ``Recipe``: a name (``+recipe=<name>`` selects ``configs/recipe/<name>.yaml``),
the spatial dims of its fields (what the mesh's domain axes may split), the function that makes
its ``Task`` on every rank (``"package.module:function"``, imported when the recipe is chosen,
so finding recipes imports no training code), the Hydra schemas of its config groups (stored in
Hydra's ConfigStore on registration), an optional check of a composed config run once, in the
launching process, before any rank starts, an optional data preparation run on rank 0 while
the others wait, and an optional data-free task for dry runs. Everything else about a run (the
mesh, the model from ``cfg.model``, the loop) is ``shardsci.training``'s (``train_recipe``). A
recipe package registers itself when imported (``register_recipe`` in its ``__init__``).
``discover_recipes("shardsci.recipes")`` (run by the training command, ``shardsci/train.py``)
imports every sub-package of the in-repo ``recipes/``, so a new recipe there is a new package
and a ``configs/recipe/<name>.yaml``, with no edit elsewhere; it then loads every entry point of
the group ``shardsci.recipes``, so an installed package of the user's own adds recipes too:

    [project.entry-points."shardsci.recipes"]
    my_task = "my_package.recipe"     # a module that registers Recipe(name="my_task", ...)

The entry point's name is the recipe's name; its value is a module that registers the recipe
when imported, or the ``Recipe`` itself. Such a package ships its configs (a
``recipe/<name>.yaml`` and any groups of its own) in a directory the user adds to Hydra's
search path: ``hydra.searchpath=[pkg://my_package.configs]``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from shardsci.training._parallelism import ParallelPlan

__all__ = [
    "ENTRY_POINT_GROUP",
    "Recipe",
    "discover_recipes",
    "get_recipe",
    "recipe_names",
    "register_recipe",
]

ENTRY_POINT_GROUP = "shardsci.recipes"
"""The entry-point group installed packages declare their recipes in."""

RecipeCheck = Callable[[DictConfig, ParallelPlan], None]
"""``check(cfg, plan)``: raise ``ValueError`` with one clear line if ``cfg`` cannot run on the
mesh ``plan`` (NOTE [Config errors before any rank starts])."""


@dataclass(frozen=True)
class Recipe:
    """A task that ``train.py`` can run: what its data, loss and evaluation are.

    Attributes
    ----------
    name : str
        Selected by ``+recipe=<name>``.
    task : str
        ``"package.module:function"``; ``function(cfg, run)`` runs on every rank, with ``run``
        the rank's ``RunContext``, and returns the ``Task``: its batches (this rank's part),
        losses and evaluation. The model is ``cfg.model``, instantiated by the library.
    spatial_dims : tuple of str
        The fields' spatial dims, outermost first (``("H", "W")``, ``("D", "H", "W")``, the
        nodes of a graph): what the mesh's domain axes split (``ParallelPlan``).
    schemas : mapping
        ``(group, name) -> dataclass``: Hydra schemas of the recipe's config groups, stored in
        the ConfigStore (``configs/<group>/<option>.yaml`` names them in its defaults list).
    check : callable or None
        ``check(cfg, plan)``, run in the launching process before any rank starts, after the
        generic checks: raise ``ValueError`` naming what is wrong with ``cfg`` and what is
        expected (the data's shape against the mesh and the model, the data file, ...).
    prepare : str or None
        ``"package.module:function"``; ``function(cfg)`` runs on global rank 0 before any rank
        makes its task, while the others wait (generating a missing data file).
    dry_run_task : str or None
        ``"package.module:function"`` for ``dry_run=true`` (``shardsci.planning``): like
        ``task``, but its batches have the shapes and layouts of the real ones, made without
        reading data, on ``run.device`` (the ``meta`` device).
    """

    name: str
    task: str
    spatial_dims: tuple[str, ...]
    schemas: Mapping[tuple[str, str], type] = field(default_factory=dict)
    check: RecipeCheck | None = None
    prepare: str | None = None
    dry_run_task: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "spatial_dims", tuple(self.spatial_dims))
        paths = {"task": self.task, "prepare": self.prepare, "dry_run_task": self.dry_run_task}
        for what, path in paths.items():
            module, _, function = (path or "m:f").partition(":")
            if not (self.name.isidentifier() and module and function.isidentifier()):
                raise ValueError(
                    f"Recipe(name={self.name!r}, {what}={path!r}): expected an identifier as "
                    f"the name and 'package.module:function' as {what}"
                )
        if not self.spatial_dims or not all(isinstance(d, str) for d in self.spatial_dims):
            raise ValueError(
                f"Recipe(name={self.name!r}, spatial_dims={self.spatial_dims!r}): expected the "
                f"names of the fields' spatial dims, e.g. ('H', 'W')"
            )

    def load_task(self) -> Callable[..., Any]:
        """Import and return the function that makes the task on every rank (see ``task``)."""
        return _load(self.task)

    def load_prepare(self) -> Callable[[DictConfig], Any] | None:
        """Import and return the data preparation (see ``prepare``), if any."""
        return None if self.prepare is None else _load(self.prepare)

    def load_dry_run_task(self) -> Callable[..., Any]:
        """Import and return the dry run's task function (see ``dry_run_task``)."""
        if self.dry_run_task is None:
            raise ValueError(f"recipe {self.name!r} has no dry_run_task for a dry run")
        return _load(self.dry_run_task)


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
    """Import every sub-package of ``package`` (each registers its recipe), then load the
    ``shardsci.recipes`` entry points; the names of all registered recipes.

    See NOTE [How train.py finds recipes].
    """
    root = importlib.import_module(package)
    for module in pkgutil.iter_modules(root.__path__, prefix=f"{package}."):
        if module.ispkg:
            importlib.import_module(module.name)
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        _load_entry_point(entry)
    return recipe_names()


def _load_entry_point(entry: importlib.metadata.EntryPoint) -> None:
    where = f"entry point {entry.name} = {entry.value!r} (group {ENTRY_POINT_GROUP})"
    try:
        loaded = entry.load()
    except Exception as error:
        raise ImportError(f"{where} could not be imported: {error}") from error
    if isinstance(loaded, Recipe):
        register_recipe(loaded)
    if entry.name not in _RECIPES:
        raise ValueError(
            f"{where} registered no recipe named {entry.name!r}; expected a module that calls "
            f"register_recipe(Recipe(name={entry.name!r}, ...)), or such a Recipe"
        )
