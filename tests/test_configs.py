"""Every recipe x mesh x axis-role configuration composes, and a typo fails at composition."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import train  # noqa: F401  registers the schemas and resolvers
from shardsci.distributed import mesh_axis_sizes
from shardsci.training import ParallelConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RECIPES = sorted(p.stem for p in (CONFIGS / "recipe").glob("*.yaml"))
MESHES = ["1", "2", "8", "2x1", "1x2", "2x2", "4x2", "2x2x2"]
PARALLEL = {"auto": MESHES, "block": ["2x2", "4x2"], "slab": ["1", "2", "8"]}


def _compose(*overrides: str):
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def _resolved(cfg) -> ParallelConfig:
    parallel = ParallelConfig(**OmegaConf.to_container(cfg.parallel, resolve=True))
    return parallel.resolved(len(mesh_axis_sizes(str(cfg.mesh))))


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
