"""What the mesh CFD recipe checks before any rank starts (NOTE [Config errors before any rank
starts]): the data file (a user's against the schema, or whether it may be generated), the
DeviceMesh's domain axis against the graph's nodes, the held-out split, the batch against the
training pairs and the evaluation against the trajectories. That the DeviceMesh has at most one domain axis follows from the
recipe's one spatial dim (``ParallelPlan``)."""

from __future__ import annotations

from omegaconf import DictConfig

from shardsci.recipes.mesh_cfd import meshfile
from shardsci.recipes.mesh_cfd.generate import MeshDataConfig
from shardsci.training import ParallelPlan, config_from

__all__ = ["check"]


def check(cfg: DictConfig, plan: ParallelPlan) -> None:
    """Raise ``ValueError`` naming the first setting of ``cfg`` that cannot run on ``plan``."""
    try:
        config_from(MeshDataConfig, cfg.data.dataset)
    except (TypeError, ValueError) as error:
        raise ValueError(f"data.dataset: {error}") from error
    stored = meshfile.inspect(cfg.data)[0]
    if stored.nodes is not None:
        plan.check_fits({meshfile.NODES: stored.nodes}, f"a triangle mesh of {stored.nodes} nodes")
    test = cfg.data.test_trajectories
    if not 1 <= test < stored.trajectories:
        raise ValueError(
            f"data.test_trajectories={test}: expected 1 to {stored.trajectories - 1} (the data "
            f"has {stored.trajectories} trajectories)"
        )
    unrolled = cfg.train.rollout.steps
    if unrolled >= stored.times:
        raise ValueError(
            f"train.rollout.steps={unrolled}: expected 1 to {stored.times - 1} (the data has "
            f"{stored.times} records per trajectory)"
        )
    samples = (stored.trajectories - test) * (stored.times - unrolled)
    if cfg.train.global_batch > samples:
        what = "training pairs" if unrolled == 1 else f"training {unrolled}-step rollouts"
        raise ValueError(
            f"train.global_batch={cfg.train.global_batch} exceeds the {samples} {what} of "
            f"the data ({stored.trajectories - test} training trajectories of {stored.times} "
            f"records); expected at most {samples}"
        )
    if cfg.eval.samples < 1:
        raise ValueError(f"eval.samples={cfg.eval.samples}: expected an integer >= 1")
    if not 1 <= cfg.eval.rollout_steps < stored.times:
        raise ValueError(
            f"eval.rollout_steps={cfg.eval.rollout_steps}: expected 1 to {stored.times - 1} "
            f"(the data has {stored.times} records per trajectory)"
        )
