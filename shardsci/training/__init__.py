"""Training machinery every recipe shares; recipes supply data, model and evaluation.

- ``Recipe``, ``register_recipe``, ``discover_recipes``: how ``train.py`` finds recipes and
  their config schemas (NOTE [How train.py finds recipes]).
- ``RunConfig`` and the generic groups' configs (``TrainConfig``, ``ParallelConfig``,
  ``LoggerConfig``, ``LauncherConfig``), ``schema_of``/``config_from`` between a component's
  config dataclass and its Hydra schema.
- ``check_run``: every check the config allows, before any rank starts; ``reported``: user
  errors as one line (NOTE [Errors for people]).
- ``start_run`` (process group, mesh, run directory) and ``Trainer`` (the loop: DDP/FSDP2 via
  ``parallelize``, precision, data-parallel means, checkpoints with the scheduler, resume).
- ``ParallelLayout``: which mesh axes do what; ``run_local_ranks``: start ranks here, like
  torchrun (NOTE [Ranks forked by train.py behave like torchrun's]).

Nothing here knows a recipe's data or model.
"""

from shardsci.training._checks import check_run, max_local_ranks
from shardsci.training._data_parallel import DataParallel, dp_sample_mean, parallelize
from shardsci.training._errors import (
    EXIT_USER_ERROR,
    TRACEBACK_VAR,
    USER_ERRORS,
    ConfigError,
    NonFiniteLoss,
    reported,
    traceback_requested,
)
from shardsci.training._launcher import LauncherConfig, LauncherKind, run_local_ranks
from shardsci.training._layout import LayoutPlan, ParallelConfig, ParallelLayout, mesh_world_size
from shardsci.training._loggers import LoggerConfig, LoggerKind, MetricLogger, WandbMode
from shardsci.training._precision import Precision, autocast
from shardsci.training._progress import Progress
from shardsci.training._recipes import (
    Recipe,
    discover_recipes,
    get_recipe,
    recipe_names,
    register_recipe,
)
from shardsci.training._run import RunContext, start_run
from shardsci.training._run_config import AdamWConfig, RunConfig, register_run_schemas
from shardsci.training._schedule import ScheduleConfig, warmup_cosine
from shardsci.training._schema import config_from, config_type_of, instantiate, plain, schema_of
from shardsci.training._signals import STOP_SIGNALS, StopRequests, exit_status
from shardsci.training._trainer import NonFinite, Task, TrainConfig, Trainer

__all__ = [
    "EXIT_USER_ERROR",
    "STOP_SIGNALS",
    "TRACEBACK_VAR",
    "USER_ERRORS",
    "AdamWConfig",
    "ConfigError",
    "DataParallel",
    "LauncherConfig",
    "LauncherKind",
    "LayoutPlan",
    "LoggerConfig",
    "LoggerKind",
    "MetricLogger",
    "NonFinite",
    "NonFiniteLoss",
    "ParallelConfig",
    "ParallelLayout",
    "Precision",
    "Progress",
    "Recipe",
    "RunConfig",
    "RunContext",
    "ScheduleConfig",
    "StopRequests",
    "Task",
    "TrainConfig",
    "Trainer",
    "WandbMode",
    "autocast",
    "check_run",
    "config_from",
    "config_type_of",
    "discover_recipes",
    "dp_sample_mean",
    "exit_status",
    "get_recipe",
    "instantiate",
    "max_local_ranks",
    "mesh_world_size",
    "parallelize",
    "plain",
    "recipe_names",
    "register_recipe",
    "register_run_schemas",
    "reported",
    "run_local_ranks",
    "schema_of",
    "start_run",
    "traceback_requested",
    "warmup_cosine",
]
