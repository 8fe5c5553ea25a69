"""The prediction command: ``shardsci-predict +recipe=cfd predict.checkpoint=<run directory or
checkpoint> mesh=2x2 predict.resolution=256 predict.steps=10 predict.output=<new .h5 file>``.

Also ``python -m shardsci.predict`` and, in a checkout, ``python predict.py``. The config is
composed as training's (``configs/predict.yaml``: ``config.yaml`` and the ``predict`` group,
``PredictConfig``): the same recipe, model and mesh options, the model the one the checkpoint
holds. Everything the config shows is checked before any rank starts (NOTE [Config errors
before any rank starts]): the checkpoint against the model, the output path (never
overwritten), the resolution against the model and the mesh. Then every rank loads the
checkpoint (saved on any mesh), the recipe generates or reads the initial fields and the
solver's truth at that resolution (``Recipe.predict_task``), the model is rolled out, and every
step is written to the output by the ranks that hold it, its error against the truth and
against persistence recorded (``shardsci.training.predict_recipe``; NOTE [What a prediction
reads from a checkpoint]). ``metrics.json`` and ``prediction.png`` go to the run directory.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from shardsci._commands import CONFIG_MODULE, run_composed, run_launched
from shardsci.distributed import detect_launch_env
from shardsci.training import (
    ConfigError,
    check_prediction,
    get_recipe,
    predict_recipe,
    reported,
    run_ranks,
)

__all__ = ["launch", "main"]


def launch(cfg: DictConfig, multirun: bool = False) -> int:
    """Check ``cfg`` before any rank starts and plan its run once, then predict here (one
    rank, or under torchrun/srun) or on the plan's ranks started here; the exit status."""
    if cfg.recipe is None:
        raise ConfigError(
            "no recipe chosen: add +recipe=<name>, e.g. shardsci-predict +recipe=cfd "
            "predict.checkpoint=<run directory> predict.output=prediction.h5"
        )
    try:
        recipe = get_recipe(cfg.recipe)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    env = detect_launch_env()
    plan = check_prediction(cfg, recipe, env, multirun)
    return run_ranks(cfg, plan, env, predict_recipe)


def main() -> None:
    """The command: run ``_run``, Hydra's composition errors in one line."""
    with reported():
        run_composed(sys.argv[1:], _run)


@hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name="predict")
def _run(cfg: DictConfig) -> None:
    """Predict with the recipe ``cfg.recipe``'s model on the mesh ``cfg.mesh``."""
    run_launched(cfg, launch)


if __name__ == "__main__":
    main()
