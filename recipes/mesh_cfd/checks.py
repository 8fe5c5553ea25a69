"""What the mesh CFD recipe checks before any rank starts (NOTE [Config errors before any rank
starts]): the data file (a user's against the schema, or whether it may be generated), the
mesh's domain axes against the graph, the held-out split and the evaluation against the
trajectories."""

from __future__ import annotations

import math

from omegaconf import DictConfig

from recipes.mesh_cfd import meshfile
from recipes.mesh_cfd.generate import MeshDataConfig
from shardsci.training import LayoutPlan, config_from

__all__ = ["check"]


def check(cfg: DictConfig, plan: LayoutPlan) -> None:
    """Raise ``ValueError`` naming the first setting of ``cfg`` that cannot run on ``plan``."""
    try:
        config_from(MeshDataConfig, cfg.data.dataset)
    except (TypeError, ValueError) as error:
        raise ValueError(f"data.dataset: {error}") from error
    stored = meshfile.plan(cfg.data)[0]
    domain = [
        size for name, size in zip(plan.config.axis_names, plan.shape) if name in plan.config.domain
    ]
    if len(domain) > 1 and math.prod(domain) > 1:
        raise ValueError(
            f"the mesh CFD recipe splits its graph over one mesh axis, but the mesh "
            f"({plan.describe()}) has {len(domain)} domain axes; use mesh=N (parallel=slab) or "
            f"mesh=DxN parallel=auto"
        )
    parts = math.prod(domain)
    if stored.nodes is not None and parts > stored.nodes:
        raise ValueError(
            f"the mesh ({plan.describe()}) splits the graph into {parts} parts, but it has "
            f"{stored.nodes} nodes; expected at most {stored.nodes} parts"
        )
    test = cfg.data.test_trajectories
    if not 1 <= test < stored.trajectories:
        raise ValueError(
            f"data.test_trajectories={test}: expected 1 to {stored.trajectories - 1} (the data "
            f"has {stored.trajectories} trajectories)"
        )
    if cfg.eval.samples < 1:
        raise ValueError(f"eval.samples={cfg.eval.samples}: expected an integer >= 1")
    if not 1 <= cfg.eval.rollout_steps < stored.times:
        raise ValueError(
            f"eval.rollout_steps={cfg.eval.rollout_steps}: expected 1 to {stored.times - 1} "
            f"(the data has {stored.times} records per trajectory)"
        )
