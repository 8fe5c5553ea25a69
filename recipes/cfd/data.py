"""The CFD recipe's data: a file of vorticity trajectories ``(trajectory, time, H, W)``, ours
(``generate.py``, on rank 0 before the run) or the user's (``data/README.md``), read in each
rank's slab as next-step pairs (``shardsci.training.TrajectorySource``)."""

from __future__ import annotations

from shardsci.recipes.cfd.generate import (
    CREATED_BY,
    DATASET_NAME,
    DatasetConfig,
    generate_dataset,
    outdated_reason,
)
from shardsci.training import TrajectorySource

__all__ = ["TRAJECTORIES"]

TRAJECTORIES = TrajectorySource(
    dataset=DATASET_NAME,
    dims=("trajectory", "time", "H", "W"),
    created_by=CREATED_BY,
    config_type=DatasetConfig,
    generate=generate_dataset,
    outdated=outdated_reason,
)
"""The ``vorticity`` dataset and its generator."""
