"""Building blocks for training loops: parallel layout, local launch, schedule, progress, logs.

Recipes compose these with their data and model; nothing here knows about either.
"""

from shardsci.training._layout import ParallelConfig, ParallelLayout, mesh_world_size
from shardsci.training._loggers import LoggerConfig, MetricLogger
from shardsci.training._progress import Progress
from shardsci.training._schedule import ScheduleConfig, warmup_cosine
from shardsci.training._spawn import run_local_ranks

__all__ = [
    "LoggerConfig",
    "MetricLogger",
    "ParallelConfig",
    "ParallelLayout",
    "Progress",
    "ScheduleConfig",
    "mesh_world_size",
    "run_local_ranks",
    "warmup_cosine",
]
