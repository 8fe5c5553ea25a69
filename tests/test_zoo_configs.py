"""``model=fno|vit|transolver`` for ``+recipe=cfd``: each composes into a model that maps the
recipe's 64² field to a field of the same shape, and a mistyped choice fails at composition."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

import shardsci.train  # noqa: F401  registers the schemas, the resolvers and the recipes
from shardsci.training import instantiate

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _compose(*overrides: str):
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize("model", ["fno", "vit", "transolver"])
def test_recipe_model_maps_the_field_to_a_field(model: str) -> None:
    cfg = _compose("+recipe=cfd", f"model={model}")
    network = instantiate(cfg.model)
    resolution = cfg.data.dataset.solver.resolution
    with torch.no_grad():
        out = network(torch.randn(1, 1, resolution, resolution))
    assert out.shape == (1, 1, resolution, resolution)


@pytest.mark.parametrize(
    "override",
    ["model.coordinates=periodc", "model.modes=[12,x]", "model.heads=four", "model.slicez=8"],
)
def test_typos_fail_when_composing(override: str) -> None:
    model = {"modes": "fno", "heads": "vit"}.get(override.split("=")[0].split(".")[1], "transolver")
    with pytest.raises(ConfigCompositionException):
        _compose("+recipe=cfd", f"model={model}", override)
