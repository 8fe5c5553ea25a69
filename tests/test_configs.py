"""Every recipe x mesh x axis-role x model configuration composes, and a typo fails at
composition: a misspelt key, a value of the wrong type, a mistyped choice."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import shardsci.train  # noqa: F401  registers the schemas, the resolvers and the recipes
from shardsci.training import (
    DataParallelMode,
    ParallelConfig,
    ParallelPlan,
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


def _plan(cfg) -> ParallelPlan:
    parallel = config_from(ParallelConfig, cfg.parallel)
    return ParallelPlan.of(str(cfg.mesh), parallel, get_recipe(cfg.recipe).spatial_dims)


def test_every_recipe_config_is_a_registered_recipe() -> None:
    assert recipe_names() == RECIPES
    for recipe in RECIPES:
        assert callable(get_recipe(recipe).load_task())


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(
    ("parallel", "mesh"), [(p, m) for p, meshes in PARALLEL.items() for m in meshes]
)
def test_every_recipe_mesh_and_axis_roles_compose(recipe: str, parallel: str, mesh: str) -> None:
    """... and plans, unless the mesh has more domain axes than the recipe's fields have
    spatial dims: then one clear error."""
    cfg = _compose(f"+recipe={recipe}", f"mesh={mesh}", f"parallel={parallel}")
    assert cfg.recipe == recipe and str(cfg.mesh) == mesh
    assert OmegaConf.to_container(cfg, resolve=True)["run_dir"]
    axes = len(mesh.split("x"))
    splitting = axes - (parallel == "auto")
    if splitting > len(get_recipe(recipe).spatial_dims):
        with pytest.raises(ValueError, match="axes besides data parallelism but the fields have"):
            _plan(cfg)
        return
    plan = _plan(cfg)
    assert len(plan.axis_names) == axes and len(plan.domain) == splitting


@pytest.mark.parametrize(("recipe", "model"), RECIPE_MODELS)
def test_every_model_of_every_recipe_composes_into_a_valid_config(recipe: str, model: str) -> None:
    """The recipe's settings of the model (``configs/recipe/<recipe>/model/<model>.yaml``)
    pass the model config's own checks."""
    cfg = _compose(f"+recipe={recipe}", f"model={model}")
    config_type = config_type_of(cfg.model)
    assert config_type is not None, f"model={model} has no schema from schema_of"
    config_from(config_type, cfg.model)


def test_choices_are_enums() -> None:
    cfg = _compose("+recipe=cfd", "model=unet", "train.dp_mode=fsdp2", "train.precision=bf16")
    train_config = OmegaConf.to_object(cfg.train)
    assert train_config.dp_mode is DataParallelMode.fsdp2
    assert train_config.precision is Precision.bf16
    assert config_from(config_type_of(cfg.model), cfg.model).padding_mode == "circular"


def test_mesh_4x2_is_data_parallel_then_domain() -> None:
    plan = _plan(_compose("+recipe=cfd", "mesh=4x2"))
    assert plan.axis_names == ("dp", "domain")
    assert plan.dp_axis == "dp"
    assert plan.domain == {"domain": "H"}


def test_block_decomposition_splits_h_and_w() -> None:
    plan = _plan(_compose("+recipe=cfd", "mesh=2x2", "parallel=block"))
    assert plan.dp_axis is None
    assert plan.domain == {"domain_h": "H", "domain_w": "W"}


@pytest.mark.parametrize("domain", ["+parallel.domain={across: W}", "+parallel.domain.across=W"])
def test_the_command_line_chooses_which_dim_an_axis_splits(domain: str) -> None:
    plan = _plan(_compose("+recipe=cfd", "mesh=4x2", "parallel.axis_names=[dp,across]", domain))
    assert plan.domain == {"across": "W"}


D_H_W = ("D", "H", "W")


@pytest.mark.parametrize(
    ("parallel", "mesh", "names", "domain"),
    [
        ("slab", "8", ("domain",), {"domain": "D"}),
        ("block", "2x4", ("domain_d", "domain_h"), {"domain_d": "D", "domain_h": "H"}),
        ("block", "2x2x2", ("domain_d", "domain_h", "domain_w"), dict(zip(
            ("domain_d", "domain_h", "domain_w"), D_H_W))),
        ("auto", "2x2x2", ("dp", "domain_d", "domain_h"), {"domain_d": "D", "domain_h": "H"}),
        ("auto", "4x2", ("dp", "domain"), {"domain": "D"}),
    ],
)  # fmt: skip
def test_axis_roles_of_a_3d_field_split_d_then_h_then_w(
    parallel: str, mesh: str, names: tuple[str, ...], domain: dict[str, str]
) -> None:
    """Slab, pencil (block on two axes) and 2x2x2 block decompositions of a (D, H, W) field."""
    cfg = _compose("+recipe=cfd", f"mesh={mesh}", f"parallel={parallel}")
    plan = ParallelPlan.of(mesh, config_from(ParallelConfig, cfg.parallel), D_H_W)
    assert (plan.axis_names, dict(plan.domain)) == (names, domain)
    assert plan.ranks_along("D") == plan.size(names[-len(domain)])


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
        "train.dp_mode=bogus",
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
        (ParallelConfig(["dp", "x", "z"], "dp", {"x": "H"}), 3, r"mesh axes \['z'\] are neither"),
        (ParallelConfig(["a", "b"], "dp", {}), 2, "parallel.data_parallel 'dp' is not"),
        (ParallelConfig(None, "dp", {}), 4, "the mesh has 3 axes besides data parallelism"),
        (ParallelConfig(["a", "b"], None, {"a": "H", "b": "H"}), 2, "two axes to one"),
        (ParallelConfig(["a", "b"], None, {"a": "H", "b": "D"}), 2, r"to 'D', but the fields"),
        (ParallelConfig(["a", "a"], None, {}), 2, "parallel.axis_names: .* repeats a"),
        (ParallelConfig(["dp"], "dp", {}), 2, r"the mesh has 2 axes but parallel.axis_names"),
    ],
)
def test_inconsistent_axis_roles_are_a_clear_error(config, ndim, message) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelPlan.of("x".join(["1"] * ndim), config, ("H", "W"))
