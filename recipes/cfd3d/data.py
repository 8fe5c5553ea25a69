"""The 3-D CFD recipe's data: a file of velocity trajectories ``(trajectory, time, 3, D, H,
W)``, ours (``generate.py``) or the user's (``data/README.md``), read in each rank's block as
next-step pairs (``shardsci.training.TrajectorySource``)."""

from __future__ import annotations

from shardsci.recipes.cfd3d.generate import (
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
    dims=("trajectory", "time", "C", "D", "H", "W"),
    created_by=CREATED_BY,
    config_type=DatasetConfig,
    generate=generate_dataset,
    outdated=outdated_reason,
    channels=3,
    generates_on_mesh=True,
)
"""The ``velocity`` dataset and its generator (which also runs on a mesh, each rank
integrating and writing its own block)."""
