"""Training machinery every recipe shares; recipes supply data, model and evaluation.

- ``Recipe``, ``register_recipe``, ``discover_recipes``: how ``train.py`` finds recipes and
  their config schemas (NOTE [How train.py finds recipes]).
- ``RunConfig`` and the generic groups' configs (``TrainConfig``, ``ParallelConfig``,
  ``LoggerConfig``, ``LauncherConfig``), ``schema_of``/``config_from`` between a component's
  config dataclass and its Hydra schema.
- ``start_run`` (process group, mesh, run directory) and ``Trainer`` (the loop: DDP/FSDP2 via
  ``parallelize``, precision, data-parallel means, checkpoints with the scheduler, resume).
- ``ParallelLayout``: which mesh axes do what; ``run_local_ranks``: start ranks here.

Nothing here knows a recipe's data or model.
"""

from shardsci.training._data_parallel import DataParallel, dp_mean, dp_sample_mean, parallelize
from shardsci.training._layout import ParallelConfig, ParallelLayout, mesh_world_size
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
from shardsci.training._run_config import (
    AdamWConfig,
    LauncherConfig,
    LauncherKind,
    RunConfig,
    register_run_schemas,
)
from shardsci.training._schedule import ScheduleConfig, warmup_cosine
from shardsci.training._schema import config_from, config_type_of, instantiate, plain, schema_of
from shardsci.training._spawn import run_local_ranks
from shardsci.training._trainer import Task, TrainConfig, Trainer

__all__ = [
    "AdamWConfig",
    "DataParallel",
    "LauncherConfig",
    "LauncherKind",
    "LoggerConfig",
    "LoggerKind",
    "MetricLogger",
    "ParallelConfig",
    "ParallelLayout",
    "Precision",
    "Progress",
    "Recipe",
    "RunConfig",
    "RunContext",
    "ScheduleConfig",
    "Task",
    "TrainConfig",
    "Trainer",
    "WandbMode",
    "autocast",
    "config_from",
    "config_type_of",
    "discover_recipes",
    "dp_mean",
    "dp_sample_mean",
    "get_recipe",
    "instantiate",
    "mesh_world_size",
    "parallelize",
    "plain",
    "recipe_names",
    "register_recipe",
    "register_run_schemas",
    "run_local_ranks",
    "schema_of",
    "start_run",
    "warmup_cosine",
]
