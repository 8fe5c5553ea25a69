"""Schemas of the mesh CFD recipe's config groups: the data (from the dataset generator's
``MeshDataConfig``) and the evaluation; the models' schemas come from ``recipes.models``."""

from __future__ import annotations

from dataclasses import dataclass, field

from recipes.mesh_cfd.generate import MeshDataConfig
from recipes.models import MODEL_SCHEMAS
from shardsci.training import schema_of

__all__ = ["SCHEMAS", "MeshCFDDataConfig", "MeshCFDEvalConfig"]

MeshDataSchema = schema_of(MeshDataConfig)


@dataclass
class MeshCFDDataConfig:
    """The ``data`` group of the mesh CFD recipe (``configs/data/cylinders.yaml``).

    Attributes
    ----------
    path : str
        The HDF5 file of mesh and trajectories; generated on first use (or regenerated when it
        holds other data than ``dataset``).
    dataset : MeshDataConfig
        What is simulated and recorded (flow, mesh, counts).
    test_trajectories : int
        The last this many trajectories are held out.
    partition : str
        How the graph is split over the domain axis: ``"metis"`` or ``"rcb"`` (recursive
        coordinate bisection).
    """

    path: str = "data/generated/cylinders.h5"
    dataset: MeshDataSchema = field(default_factory=MeshDataSchema)  # type: ignore[valid-type]
    test_trajectories: int = 2
    partition: str = "metis"


@dataclass
class MeshCFDEvalConfig:
    """The ``eval`` group: what each evaluation measures on the held-out trajectories.

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
    ("recipe", "mesh_cfd_eval_schema"): MeshCFDEvalConfig,
}
"""The recipe's Hydra schemas, ``(group, name) -> dataclass`` (``Recipe.schemas``)."""
