"""Training machinery every recipe shares; recipes only choose their data, model, loss and
evaluation.

- ``Recipe``, ``register_recipe``, ``discover_recipes``: how ``train.py`` finds recipes and
  their config schemas (NOTE [How train.py finds recipes]).
- ``RunConfig`` and the generic groups' configs (``TrainConfig``, ``ParallelConfig``,
  ``LoggerConfig``, ``LauncherConfig``), ``schema_of``/``config_from`` between a component's
  config dataclass and its Hydra schema.
- ``check_run``: every check the config allows, before any rank starts, returning the run's
  ``ParallelPlan`` (``plan_parallelism``: NOTE [A run is planned once]); ``reported``: user
  errors as one line (NOTE [Errors for people]).
- ``run_ranks``: run a per-rank function here or on ranks forked like torchrun's (NOTE [Ranks
  forked by train.py behave like torchrun's]); ``train_recipe``: what every rank of a training
  run does; ``start_run`` (process group, the plan's one ``DeviceMesh`` as a ``Parallelism``,
  run directory), ``prepare_data`` (rank 0 prepares, the others wait) and ``Trainer`` (the loop:
  DDP/FSDP2 via ``parallelize``, precision, data-parallel means, checkpoints with the scheduler,
  resume), which takes one ``training_step`` per step, the dry run's step too (NOTE [One
  training step]).
- ``NextStepFields`` (and ``RandomFields`` for dry runs): the batches, held-out pairs and
  rollouts of a field stored as ``(trajectory, time, [C,] *spatial)``, each rank reading its
  slab, normalised by a ``Normalization``; ``TrajectorySource``: such a file, ours or the
  user's, and its generation; ``NextStepProblem``: what a recipe that learns to advance such a
  field needs (its ``NextStepTask``, dry-run task, checks and data preparation), the recipe
  naming only its data and how to picture a sample (``save_rollout``).
- ``PredictConfig``, ``check_prediction``, ``predict_recipe``: ``shardsci-predict``, a trained
  model rolled out from new initial fields at any resolution it takes, on any mesh, the
  prediction written without gathering it (NOTE [What a prediction reads from a checkpoint]);
  a recipe's ``PredictTask`` supplies the fields.
- ``whole_tensor``: a small sharded result as a plain tensor; ``dp_sample_mean``: a per-sample
  figure averaged over the global batch; ``relative_l2``, ``rollout``, ``describe_forecast``:
  the evaluation of a next-step model.

Nothing here knows a recipe's data or model.
"""

from shardsci.training._checks import (
    check_component,
    check_launcher,
    check_model_input,
    check_run,
    max_local_ranks,
    plan_parallelism,
)
from shardsci.training._data_parallel import DataParallelMode, dp_sample_mean, parallelize
from shardsci.training._errors import (
    EXIT_USER_ERROR,
    TRACEBACK_VAR,
    USER_ERRORS,
    ConfigError,
    NonFiniteLoss,
    reported,
    traceback_requested,
)
from shardsci.training._fields import CHANNELS, NextStepFields, Normalization, RandomFields
from shardsci.training._forecast import describe_forecast, relative_l2, rollout
from shardsci.training._launcher import LauncherConfig, LauncherKind, run_local_ranks, run_ranks
from shardsci.training._loggers import LoggerConfig, LoggerKind, MetricLogger, WandbMode
from shardsci.training._next_step import NextStepEvalConfig, NextStepProblem, NextStepTask
from shardsci.training._parallelism import (
    ParallelConfig,
    Parallelism,
    ParallelPlan,
    mesh_world_size,
)
from shardsci.training._plots import save_rollout
from shardsci.training._precision import Precision, autocast
from shardsci.training._predict import (
    PredictConfig,
    PredictTask,
    check_prediction,
    describe_prediction,
    predict_recipe,
    resolve_checkpoint,
)
from shardsci.training._progress import Progress
from shardsci.training._recipes import (
    Recipe,
    discover_recipes,
    get_recipe,
    recipe_names,
    register_recipe,
)
from shardsci.training._renamed import RENAMED_KEYS, check_renamed_keys
from shardsci.training._run import RunContext, prepare_data, start_run
from shardsci.training._run_config import AdamWConfig, RunConfig, register_run_schemas
from shardsci.training._schedule import ScheduleConfig, warmup_cosine
from shardsci.training._schema import config_from, config_type_of, instantiate, plain, schema_of
from shardsci.training._signals import STOP_SIGNALS, StopRequests, exit_status
from shardsci.training._step import Task, prediction_state, training_step
from shardsci.training._train import train_recipe
from shardsci.training._trainer import NonFinite, TrainConfig, Trainer
from shardsci.training._trajectories import Trajectories, TrajectorySource
from shardsci.training._unrolled import RolloutConfig, RolloutGradient, unrolled_loss
from shardsci.training._whole import whole_tensor

__all__ = [
    "CHANNELS",
    "EXIT_USER_ERROR",
    "RENAMED_KEYS",
    "STOP_SIGNALS",
    "TRACEBACK_VAR",
    "USER_ERRORS",
    "AdamWConfig",
    "ConfigError",
    "DataParallelMode",
    "LauncherConfig",
    "LauncherKind",
    "LoggerConfig",
    "LoggerKind",
    "MetricLogger",
    "NextStepEvalConfig",
    "NextStepFields",
    "NextStepProblem",
    "NextStepTask",
    "NonFinite",
    "NonFiniteLoss",
    "Normalization",
    "ParallelConfig",
    "ParallelPlan",
    "Parallelism",
    "Precision",
    "PredictConfig",
    "PredictTask",
    "Progress",
    "RandomFields",
    "Recipe",
    "RolloutConfig",
    "RolloutGradient",
    "RunConfig",
    "RunContext",
    "ScheduleConfig",
    "StopRequests",
    "Task",
    "TrainConfig",
    "Trainer",
    "Trajectories",
    "TrajectorySource",
    "WandbMode",
    "autocast",
    "check_component",
    "check_launcher",
    "check_model_input",
    "check_prediction",
    "check_renamed_keys",
    "check_run",
    "config_from",
    "config_type_of",
    "describe_forecast",
    "describe_prediction",
    "discover_recipes",
    "dp_sample_mean",
    "exit_status",
    "get_recipe",
    "instantiate",
    "max_local_ranks",
    "mesh_world_size",
    "parallelize",
    "plain",
    "plan_parallelism",
    "predict_recipe",
    "prediction_state",
    "prepare_data",
    "recipe_names",
    "register_recipe",
    "register_run_schemas",
    "relative_l2",
    "reported",
    "resolve_checkpoint",
    "rollout",
    "run_local_ranks",
    "run_ranks",
    "save_rollout",
    "schema_of",
    "start_run",
    "traceback_requested",
    "train_recipe",
    "training_step",
    "unrolled_loss",
    "warmup_cosine",
    "whole_tensor",
]
