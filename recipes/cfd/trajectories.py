"""The file of vorticity trajectories a CFD run reads, and whether it must be generated first.

The file is the user's or ours (NOTE [Whose data file is it] in ``shardsci/data/_files.py``).
A file of the user's is read as it is, if it follows ``SCHEMA`` (``data/README.md``): its
shape and ``n_train``/``n_test`` attributes say what the run trains and evaluates on, and the
``data.dataset`` settings (which say how to generate data) do not apply to it. A file of ours
must hold the data ``data.dataset`` describes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from shardsci.data import DataError, DatasetSpec, HDF5Schema, check_hdf5, generation_reason
from shardsci.recipes.cfd.generate import (
    CREATED_BY,
    DATASET_NAME,
    DatasetConfig,
    generate_dataset,
    outdated_reason,
)
from shardsci.training import config_from

__all__ = ["SCHEMA", "Trajectories", "inspect", "prepare", "read"]

logger = logging.getLogger(__name__)

SCHEMA = HDF5Schema(
    datasets=(DatasetSpec(DATASET_NAME, ("trajectory", "time", "H", "W"), ("float32", "float64")),),
    attributes={"n_train": int, "n_test": int},
    min_sizes={"trajectory": 2, "time": 2},
)
"""What the recipe reads from a file (``data/README.md``)."""


@dataclass(frozen=True)
class Trajectories:
    """What a data file holds: trajectories ``[0, n_train)`` train, the next ``n_test`` are
    held out; each has ``n_snapshots`` fields of ``height x width``."""

    path: Path
    n_train: int
    n_test: int
    n_snapshots: int
    height: int
    width: int

    @classmethod
    def of_config(cls, path: Path, dataset: DatasetConfig) -> Trajectories:
        n = dataset.solver.resolution
        return cls(path, dataset.n_train, dataset.n_test, dataset.n_snapshots, n, n)

    def describe(self) -> str:
        return (
            f"{self.n_train} training and {self.n_test} held-out trajectories of "
            f"{self.n_snapshots} snapshots of {self.height}x{self.width}"
        )


def inspect(config: DictConfig) -> tuple[Trajectories, str | None]:
    """What a run with the ``data`` config ``config`` will read, and why its file must be
    generated first (None: it is read as it is). Reads metadata only, writes nothing.

    Raises
    ------
    DataError
        If the file may neither be generated nor read (missing, not ours and not following
        ``SCHEMA``, ours but outdated where the run may not regenerate it).
    """
    dataset = config_from(DatasetConfig, config.dataset)
    path = Path(config.path)
    reason = generation_reason(
        path, config.generate, CREATED_BY, lambda stored: outdated_reason(stored, dataset)
    )
    if reason is not None:
        return Trajectories.of_config(path, dataset), reason
    return read(path), None


def read(path: Path) -> Trajectories:
    """The trajectories of the file at ``path``, validated against ``SCHEMA``."""
    contents = check_hdf5(path, SCHEMA)
    n_train, n_test = contents.attributes["n_train"], contents.attributes["n_test"]
    count = contents.sizes["trajectory"]
    if n_train < 1 or n_test < 1 or n_train + n_test != count:
        raise DataError(
            f"data file {path}: attributes n_train={n_train} and n_test={n_test} must be >= 1 "
            f"and add up to the {count} trajectories of dataset {DATASET_NAME!r}"
        )
    sizes = contents.sizes
    return Trajectories(path, n_train, n_test, sizes["time"], sizes["H"], sizes["W"])


def prepare(cfg: DictConfig) -> None:
    """Generate the run's data file if it must (``Recipe.prepare``: on one rank only)."""
    trajectories, reason = inspect(cfg.data)
    if reason is not None:
        logger.info("generating %s: %s", trajectories.path, reason)
        generate_dataset(trajectories.path, config_from(DatasetConfig, cfg.data.dataset))
