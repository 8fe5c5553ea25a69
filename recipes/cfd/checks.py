"""What the CFD recipe checks before any rank starts (NOTE [Config errors before any rank
starts]): the dataset settings, the mesh against the field's rows, the batch against the
training pairs, the evaluation against the trajectories, the model against the field's shape."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from recipes.cfd.generate import DatasetConfig
from shardsci.training import LayoutPlan, config_from, instantiate

__all__ = ["check"]

_FIELD_DIMS = ("H", "W")


def check(cfg: DictConfig, plan: LayoutPlan) -> None:
    """Raise ``ValueError`` naming the first setting of ``cfg`` that cannot run on ``plan``."""
    try:
        dataset = config_from(DatasetConfig, cfg.data.dataset)
    except (TypeError, ValueError) as error:
        raise ValueError(f"data.dataset: {error}") from error
    n = dataset.solver.resolution
    _check_mesh(plan, n)
    pairs = dataset.n_train * (dataset.n_snapshots - 1)
    if cfg.train.global_batch > pairs:
        raise ValueError(
            f"train.global_batch={cfg.train.global_batch} exceeds the {pairs} training pairs "
            f"(data.dataset.n_train={dataset.n_train} trajectories x "
            f"{dataset.n_snapshots - 1} steps); expected at most {pairs}"
        )
    if cfg.eval.samples < 1:
        raise ValueError(f"eval.samples={cfg.eval.samples}: expected an integer >= 1")
    if not 1 <= cfg.eval.rollout_steps < dataset.n_snapshots:
        raise ValueError(
            f"eval.rollout_steps={cfg.eval.rollout_steps}: expected 1 to "
            f"{dataset.n_snapshots - 1} (data.dataset.n_snapshots={dataset.n_snapshots})"
        )
    _check_model(cfg.model, n)


def _check_mesh(plan: LayoutPlan, n: int) -> None:
    for axis, dim in plan.config.domain.items():
        if dim not in _FIELD_DIMS:
            raise ValueError(
                f"parallel.domain maps mesh axis {axis!r} to {dim!r}, but the vorticity fields "
                f"have spatial dims {list(_FIELD_DIMS)}"
            )
    for dim in _FIELD_DIMS:
        ranks = plan.ranks_along(dim)
        if ranks > n:
            raise ValueError(
                f"the mesh ({plan.describe()}) splits {dim} over {ranks} ranks, but the fields "
                f"have {n} rows (data.dataset.solver.resolution={n}); expected at most {n} "
                f"ranks along {dim}"
            )


def _check_model(model: DictConfig, n: int) -> None:
    """Run the model once on the meta device (shapes only, no memory, no compute) on a field
    of the data's shape ``(1, 1, n, n)``."""
    try:
        with torch.device("meta"):
            instantiate(model)(torch.empty(1, 1, n, n))
    except NotImplementedError:
        return  # an op without a meta kernel: nothing learnt, the ranks will tell
    except (ValueError, RuntimeError) as error:
        raise ValueError(
            f"model {model._target_} cannot take the recipe's fields of shape (batch, 1, {n}, "
            f"{n}): {error}"
        ) from error
