"""Schemas of the mesh CFD recipe's config groups: the data (from the dataset generator's
``MeshDataConfig``) and the evaluation; the models' schemas come from ``recipes.models``."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from recipes.mesh_cfd.generate import MeshDataConfig
from recipes.models import MODEL_SCHEMAS
from shardsci.data import GenerateMode
from shardsci.training import schema_of

__all__ = ["SCHEMAS", "MeshCFDDataConfig", "MeshCFDEvalConfig", "Partition"]

MeshDataSchema = schema_of(MeshDataConfig)


class Partition(enum.Enum):
    """How the graph is split over the domain axis (``data.partition``)."""

    metis = "metis"
    """METIS: balanced parts with few cut edges."""
    rcb = "rcb"
    """Recursive coordinate bisection of the node positions."""


@dataclass
class MeshCFDDataConfig:
    """The ``data`` group of the mesh CFD recipe (``configs/data/cylinders.yaml``).

    Attributes
    ----------
    path : str
        The HDF5 file of mesh and trajectories (``data/README.md``): a file of yours, read as
        it is if it follows the schema; or one shardsci generates, under ``data/generated/``.
    generate : GenerateMode
        ``auto``: generate a missing file, or regenerate an outdated one of ours, under
        ``data/generated/`` only; ``never``: only read; ``force``: regenerate (never over a
        file of yours). NOTE [Whose data file is it] in ``shardsci/data/_files.py``.
    dataset : MeshDataConfig
        What is simulated and recorded (flow, mesh, counts); a file of yours is what it is,
        and these settings do not apply to it.
    test_trajectories : int
        The last this many trajectories are held out.
    partition : Partition
        How the graph is split over the domain axis: ``metis`` or ``rcb`` (recursive
        coordinate bisection).
    """

    path: str = "data/generated/cylinders.h5"
    generate: GenerateMode = GenerateMode.auto
    dataset: MeshDataSchema = field(default_factory=MeshDataSchema)  # type: ignore[valid-type]
    test_trajectories: int = 2
    partition: Partition = Partition.metis


@dataclass
class MeshCFDEvalConfig:
    """The ``eval`` group (``configs/eval/mesh_cfd.yaml``): what each evaluation measures on the held-out trajectories.

    Attributes
    ----------
    samples : int
        Held-out (t, t + 1) pairs for the one-step error, spread evenly over the held-out
        trajectories and times.
    rollout_steps : int
        Autoregressive steps of the rollout, from the middle record of each held-out
        trajectory.
    """

    samples: int = 24
    rollout_steps: int = 5


SCHEMAS: dict[tuple[str, str], type] = {
    **MODEL_SCHEMAS,
    ("data", "cylinders_schema"): MeshCFDDataConfig,
    ("eval", "mesh_cfd_schema"): MeshCFDEvalConfig,
}
"""The recipe's Hydra schemas, ``(group, name) -> dataclass`` (``Recipe.schemas``)."""
