"""What the CFD recipe checks before any rank starts (NOTE [Config errors before any rank
starts]): the data file (a user's against the schema, or whether it may be generated), the
mesh against the field's rows, the batch against the training pairs, the evaluation against
the trajectories, the model against the field's shape."""

from __future__ import annotations

from omegaconf import DictConfig

from shardsci.recipes.cfd import trajectories
from shardsci.recipes.cfd.generate import DatasetConfig
from shardsci.training import ParallelPlan, check_model_input, config_from

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
    check_model_input(cfg.model, (1, data.height, data.width))
