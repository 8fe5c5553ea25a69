"""Every recipe x mesh x axis-role x model configuration composes, and a typo fails at
composition: a misspelt key, a value of the wrong type, a mistyped choice."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import shardsci.train  # noqa: F401  registers the schemas, the resolvers and the recipes
from shardsci.distributed import mesh_axis_sizes
from shardsci.training import (
    DataParallel,
    ParallelConfig,
    Precision,
    config_from,
    config_type_of,
    get_recipe,
    recipe_names,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RECIPES = sorted(p.stem for p in (CONFIGS / "recipe").glob("*.yaml"))
MESHES = ["1", "2", "8", "2x1", "1x2", "2x2", "4x2", "2x2x2"]
PARALLEL = {"auto": MESHES, "block": ["2x2", "4x2"], "slab": ["1", "2", "8"]}
RECIPE_MODELS = [
    (recipe, model.stem)
    for recipe in RECIPES
    for model in sorted((CONFIGS / "recipe" / recipe / "model").glob("*.yaml"))
]


def _compose(*overrides: str):
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def _resolved(cfg) -> ParallelConfig:
    parallel = config_from(ParallelConfig, cfg.parallel)
    return parallel.resolved(len(mesh_axis_sizes(str(cfg.mesh))))


def test_every_recipe_config_is_a_registered_recipe() -> None:
    assert recipe_names() == RECIPES
    for recipe in RECIPES:
        assert get_recipe(recipe).load_run().__name__ == "run"


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(
    ("parallel", "mesh"), [(p, m) for p, meshes in PARALLEL.items() for m in meshes]
)
def test_every_recipe_mesh_and_axis_roles_compose(recipe: str, parallel: str, mesh: str) -> None:
    cfg = _compose(f"+recipe={recipe}", f"mesh={mesh}", f"parallel={parallel}")
    assert cfg.recipe == recipe and str(cfg.mesh) == mesh
    resolved = _resolved(cfg)
    assert len(resolved.axis_names) == len(mesh.split("x"))
    assert OmegaConf.to_container(cfg, resolve=True)["run_dir"]


@pytest.mark.parametrize(("recipe", "model"), RECIPE_MODELS)
def test_every_model_of_every_recipe_composes_into_a_valid_config(recipe: str, model: str) -> None:
    """The recipe's settings of the model (``configs/recipe/<recipe>/model/<model>.yaml``)
    pass the model config's own checks."""
    cfg = _compose(f"+recipe={recipe}", f"model={model}")
    config_type = config_type_of(cfg.model)
    assert config_type is not None, f"model={model} has no schema from schema_of"
    config_from(config_type, cfg.model)


def test_choices_are_enums() -> None:
    cfg = _compose("+recipe=cfd", "model=unet", "train.parallel=fsdp2", "train.precision=bf16")
    train_config = OmegaConf.to_object(cfg.train)
    assert train_config.parallel is DataParallel.fsdp2
    assert train_config.precision is Precision.bf16
    assert config_from(config_type_of(cfg.model), cfg.model).padding_mode == "circular"


def test_mesh_4x2_is_data_parallel_then_domain() -> None:
    resolved = _resolved(_compose("+recipe=cfd", "mesh=4x2"))
    assert resolved.axis_names == ["dp", "domain"]
    assert resolved.data_parallel == "dp"
    assert resolved.domain == {"domain": "H"}


def test_block_decomposition_splits_h_and_w() -> None:
    resolved = _resolved(_compose("+recipe=cfd", "mesh=2x2", "parallel=block"))
    assert resolved.data_parallel is None
    assert resolved.domain == {"domain_h": "H", "domain_w": "W"}


@pytest.mark.parametrize(
    "override",
    [
        "train.stpes=3",
        "model.widht=8",
        "model.width=eight",
        "data.dataset.solver.resolutoin=32",
        "parallel.axis_name=[a]",
        "optim.lr=fast",
        "eval.sample=3",
        "train.parallel=bogus",
        "train.precision=bf17",
        "model.coordinates=periodc",
        "model.activation=gelux",
        "data.dataset.solver.forcing=kolmogorv",
        "logger.kind=tensorboard",
        "logger.mode=offlne",
        "launcher.kind=slrm",
        "model=unett",
    ],
)
def test_typos_fail_when_composing(override: str) -> None:
    with pytest.raises(ConfigCompositionException):
        _compose("+recipe=cfd", override)


@pytest.mark.parametrize(
    ("config", "ndim", "message"),
    [
        (ParallelConfig(["dp", "x"], "dp", {"y": "H"}), 2, "parallel.domain maps 'y'"),
        (ParallelConfig(["dp", "x"], "dp", {}), 2, r"mesh axes \['x'\] are neither"),
        (ParallelConfig(["a", "b"], "dp", None), 2, "parallel.data_parallel 'dp' is not"),
        (ParallelConfig(None, "dp", None), 4, "the mesh has 4 axes"),
        (ParallelConfig(["a", "b"], None, {"a": "H", "b": "H"}), 2, "two axes to one"),
    ],
)
def test_inconsistent_axis_roles_are_a_clear_error(config, ndim, message) -> None:
    with pytest.raises(ValueError, match=message):
        config.resolved(ndim)
