"""What the CFD recipe checks before any rank starts (NOTE [Config errors before any rank
starts]): the data file (a user's against the schema, or whether it may be generated), the
mesh against the field's rows, the batch against the training pairs, the evaluation against
the trajectories, the model against the field's shape."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from shardsci.recipes.cfd import trajectories
from shardsci.recipes.cfd.generate import DatasetConfig
from shardsci.training import ParallelPlan, config_from, instantiate

__all__ = ["check"]


def check(cfg: DictConfig, plan: ParallelPlan) -> None:
    """Raise ``ValueError`` naming the first setting of ``cfg`` that cannot run on ``plan``."""
    try:
        config_from(DatasetConfig, cfg.data.dataset)
    except (TypeError, ValueError) as error:
        raise ValueError(f"data.dataset: {error}") from error
    data = trajectories.inspect(cfg.data)[0]
    plan.check_fits({"H": data.height, "W": data.width}, data.describe())
    pairs = data.n_train * (data.n_snapshots - 1)
    if cfg.train.global_batch > pairs:
        raise ValueError(
            f"train.global_batch={cfg.train.global_batch} exceeds the {pairs} training pairs "
            f"of the data ({data.describe()}); expected at most {pairs}"
        )
    if cfg.eval.samples is not None and cfg.eval.samples < 1:
        raise ValueError(f"eval.samples={cfg.eval.samples}: expected an integer >= 1 or null")
    if not 1 <= cfg.eval.rollout_steps < data.n_snapshots:
        raise ValueError(
            f"eval.rollout_steps={cfg.eval.rollout_steps}: expected 1 to "
            f"{data.n_snapshots - 1} (the data has {data.n_snapshots} snapshots per trajectory)"
        )
    _check_model(cfg.model, data)


def _check_model(model: DictConfig, data: trajectories.Trajectories) -> None:
    """Run the model once on the meta device (shapes only, no memory, no compute) on a field
    of the data's shape ``(1, 1, H, W)``."""
    shape = (1, 1, data.height, data.width)
    try:
        with torch.device("meta"):
            instantiate(model)(torch.empty(shape))
    except NotImplementedError:
        return  # an op without a meta kernel: nothing learnt, the ranks will tell
    except (ValueError, RuntimeError) as error:
        raise ValueError(
            f"model {model._target_} cannot take the recipe's fields of shape (batch, 1, "
            f"{data.height}, {data.width}): {error}"
        ) from error
