"""Recipes from the ``shardsci.recipes`` entry-point group (NOTE [How train.py finds recipes]);
an installed package end to end is in ``test_installed.py``."""

from __future__ import annotations

from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from shardsci.training import _recipes, discover_recipes, get_recipe

GROUP = "shardsci.recipes"


@pytest.fixture
def entry_points(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Install entry points (name -> value) for ``discover_recipes``; restores the registry."""
    monkeypatch.setattr(_recipes, "_RECIPES", dict(_recipes._RECIPES))
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "probe_recipe.py").write_text(
        "from shardsci.training import Recipe, register_recipe\n"
        "AS_OBJECT = Recipe(name='as_object', task='probe_recipe:task', spatial_dims=('H',))\n"
        "register_recipe(Recipe(name='as_module', task='probe_recipe:task', spatial_dims=('H',)))\n"
        "def task(cfg, run):\n    return None\n"
    )

    def install(**points: str) -> None:
        found = [EntryPoint(name, value, GROUP) for name, value in points.items()]
        monkeypatch.setattr(
            _recipes.importlib.metadata,
            "entry_points",
            lambda group: found if group == GROUP else [],
        )

    return install


def test_a_module_or_a_recipe_object_registers(entry_points) -> None:
    entry_points(as_module="probe_recipe", as_object="probe_recipe:AS_OBJECT")
    names = discover_recipes("shardsci.recipes")
    assert {"as_module", "as_object", "cfd"} <= set(names)
    assert get_recipe("as_object").load_task().__module__ == "probe_recipe"


def test_an_entry_point_that_registers_another_name_is_a_clear_error(entry_points) -> None:
    entry_points(smoothing="probe_recipe")
    with pytest.raises(ValueError, match="registered no recipe named 'smoothing'"):
        discover_recipes("shardsci.recipes")


def test_an_entry_point_that_fails_to_import_names_itself(entry_points) -> None:
    entry_points(broken="no_such_recipe_package")
    with pytest.raises(ImportError, match="entry point broken = 'no_such_recipe_package'"):
        discover_recipes("shardsci.recipes")
