"""The file of mesh and flow fields a mesh CFD run reads, and whether it must be generated.

The file is the user's or ours (NOTE [Whose data file is it] in ``shardsci/data/_files.py``).
A file of the user's is read as it is, if it follows ``SCHEMA`` (``data/README.md``) and its
node types and edges point at existing types and nodes; the ``data.dataset`` settings (which
say how to generate data) do not apply to it. A file of ours must hold the data
``data.dataset`` describes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import h5py
from omegaconf import DictConfig

from shardsci.data import DataError, DatasetSpec, HDF5Schema, check_hdf5, generation_reason
from shardsci.recipes.mesh_cfd.generate import CREATED_BY, MeshDataConfig, generate, outdated_reason
from shardsci.recipes.mesh_cfd.mesh import NODE_TYPES
from shardsci.training import config_from

__all__ = ["NODES", "SCHEMA", "MeshFile", "inspect", "prepare", "read"]

NODES = "node"
"""The dim of the triangle mesh's nodes: the recipe's one spatial dim, which the DeviceMesh's
domain axis splits."""

_INTS = ("int32", "int64")
_FLOATS = ("float32", "float64")

SCHEMA = HDF5Schema(
    datasets=(
        DatasetSpec("positions", (NODES, 2), _FLOATS),
        DatasetSpec("triangles", ("triangle", 3), _INTS),
        DatasetSpec("edge_index", (2, "edge"), _INTS),
        DatasetSpec("node_type", (NODES,), _INTS),
        DatasetSpec("fields", ("trajectory", "time", NODES, "channel"), _FLOATS),
    ),
    min_sizes={"trajectory": 2, "time": 2, "channel": 2, NODES: 1},
)
"""What the recipe reads from a file (``data/README.md``)."""


@dataclass(frozen=True)
class MeshFile:
    """What a data file holds: ``trajectories`` runs of ``times`` records on a mesh of
    ``nodes`` nodes (None: the file is still to be generated, its mesh not yet built)."""

    path: Path
    trajectories: int
    times: int
    nodes: int | None


def inspect(config: DictConfig) -> tuple[MeshFile, str | None]:
    """What a run with the ``data`` config ``config`` will read, and why its file must be
    generated first (None: it is read as it is). Reads metadata only, writes nothing.

    Raises
    ------
    DataError
        If the file may neither be generated nor read.
    """
    dataset = config_from(MeshDataConfig, config.dataset)
    path = Path(config.path)
    reason = generation_reason(
        path, config.generate, CREATED_BY, lambda stored: outdated_reason(stored, dataset)
    )
    if reason is not None:
        return MeshFile(path, dataset.trajectories, dataset.records, None), reason
    return read(path), None


def read(path: Path) -> MeshFile:
    """What the file at ``path`` holds, validated against ``SCHEMA``; node types and edge
    ends are checked against the types and nodes there are."""
    sizes = check_hdf5(path, SCHEMA).sizes
    with h5py.File(path, "r") as file:
        node_type = file["node_type"][:]
        edge_index = file["edge_index"][:]
    if node_type.size and not 0 <= node_type.min() <= node_type.max() < len(NODE_TYPES):
        raise DataError(
            f"data file {path}: node_type holds values from {node_type.min()} to "
            f"{node_type.max()}, expected 0 to {len(NODE_TYPES) - 1} ({', '.join(NODE_TYPES)})"
        )
    if edge_index.size and not 0 <= edge_index.min() <= edge_index.max() < sizes[NODES]:
        raise DataError(
            f"data file {path}: edge_index holds node ids from {edge_index.min()} to "
            f"{edge_index.max()}, expected 0 to {sizes[NODES] - 1}"
        )
    return MeshFile(path, sizes["trajectory"], sizes["time"], sizes[NODES])


def prepare(cfg: DictConfig) -> None:
    """Generate the run's data file if it must (``Recipe.prepare``: on one rank only)."""
    stored, reason = inspect(cfg.data)
    if reason is not None:
        generate(stored.path, config_from(MeshDataConfig, cfg.data.dataset))
