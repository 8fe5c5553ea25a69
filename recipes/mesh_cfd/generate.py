"""The mesh CFD dataset: flow past cylinders sampled at the nodes of a triangle mesh, in HDF5.

Every trajectory runs :class:`CylinderFlow` from small random vorticity with its own inflow
speed, spins up until the wake sheds, then records velocity and vorticity at the mesh nodes
every ``record_every`` steps. The file holds the mesh and the fields::

    positions   (N, 2)        float64  node coordinates
    triangles   (T, 3)        int64    counter-clockwise node ids
    edge_index  (2, E)        int64    triangle sides, both directions
    node_type   (N,)          int64    index into attrs["node_types"]
    inflow      (S,)          float64  inflow speed of each trajectory
    fields      (S, T, N, 3)  float32  u, v, ω of trajectory s at record t (contiguous, so a
                                       rank reads only its nodes' rows)

with attrs ``solver_version``, ``record_dt`` (time between records), ``channels``,
``node_types``, ``config`` (the JSON of the :class:`MeshDataConfig`) and ``created_by``, which
marks the file as shardsci's (NOTE [Whose data file is it] in ``shardsci/data/_files.py``);
``data/README.md`` gives the schema a file of the user's own must follow.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from shardsci.data import GenerateMode, generation_reason, replace_if_ours, temporary_beside
from shardsci.recipes.mesh_cfd.cylinder_flow import SOLVER_VERSION, CylinderFlow, CylinderFlowConfig
from shardsci.recipes.mesh_cfd.mesh import NODE_TYPES, MeshConfig, TriangleMesh, cylinder_mesh

CHANNELS = ("u", "v", "vorticity")
CREATED_BY = "shardsci recipes.mesh_cfd.generate"


@dataclass(frozen=True)
class MeshDataConfig:
    """What to simulate and record."""

    flow: CylinderFlowConfig = field(default_factory=CylinderFlowConfig)
    """Geometry, physics and time step of the flow."""
    mesh: MeshConfig = field(default_factory=MeshConfig)
    """The mesh the fields are sampled on."""
    trajectories: int = 8
    """Number of trajectories S."""
    records: int = 25
    """Records T per trajectory."""
    record_every: int = 20
    """Time steps between records."""
    spin_up_steps: int = 500
    """Steps before the first record (the wake starts shedding)."""
    inflow_range: tuple[float, float] = (0.85, 1.15)
    """Each trajectory's inflow speed is drawn uniformly from this range."""
    initial_vorticity: float = 0.05
    """Standard deviation of the random initial vorticity (breaks the wake's symmetry)."""
    seed: int = 0
    """Seed of inflow speeds and initial fields."""

    @property
    def record_dt(self) -> float:
        return self.record_every * self.flow.dt


def ensure_dataset(
    path: str | os.PathLike[str],
    config: MeshDataConfig,
    mode: GenerateMode = GenerateMode.auto,
    anywhere: bool = True,
) -> Path:
    """Return ``path``, generating it first if ``mode`` allows and it is missing or an
    outdated file of ours (NOTE [Whose data file is it]); ``anywhere=False`` generates only
    under ``data/generated/``. Call it on one rank only."""
    path = Path(path)
    reason = generation_reason(
        path, mode, CREATED_BY, lambda stored: outdated_reason(stored, config), anywhere
    )
    return path if reason is None else generate(path, config)


def outdated_reason(stored: Mapping[str, Any], config: MeshDataConfig) -> str | None:
    """Why a file of ours with attributes ``stored`` holds other data than ``config``, or
    None if it holds the data of ``config``."""
    if stored.get("solver_version") != SOLVER_VERSION:
        return (
            f"attribute 'solver_version' is {stored.get('solver_version')!r}, expected "
            f"{SOLVER_VERSION!r}"
        )
    if stored.get("config") != _config_json(config):
        return "attribute 'config' differs from data.dataset"
    return None


def _config_json(config: MeshDataConfig) -> str:
    return json.dumps(dataclasses.asdict(config), sort_keys=True)


def generate(path: str | os.PathLike[str], config: MeshDataConfig) -> Path:
    """Simulate ``config`` and write the dataset to ``path`` (atomically: a partial file is
    never left under that name), replacing a file of ours there, never one of the user's."""
    path = Path(path)
    mesh = cylinder_mesh(config.flow.circles, config.mesh)
    solver = CylinderFlow(config.flow)
    generator = torch.Generator().manual_seed(config.seed)
    low, high = config.inflow_range
    inflow = low + (high - low) * torch.rand(
        config.trajectories, generator=generator, dtype=torch.float64
    )
    noise = torch.randn(
        config.trajectories,
        config.flow.nx,
        config.flow.ny,
        generator=generator,
        dtype=torch.float64,
    )
    state = solver.advance(
        solver.spectral(config.initial_vorticity * noise), inflow, config.spin_up_steps
    )
    records = []
    for record in range(config.records):
        if record:
            state = solver.advance(state, inflow, config.record_every)
        records.append(solver.sample(state, inflow, mesh.positions).float())
    fields = torch.stack(records, 1).numpy()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = temporary_beside(path)
    try:
        _write(partial, mesh, inflow, fields, config)
        replace_if_ours(partial, path, CREATED_BY)
    finally:
        partial.unlink(missing_ok=True)
    return path


def _write(
    path: Path,
    mesh: TriangleMesh,
    inflow: torch.Tensor,
    fields: np.ndarray,
    config: MeshDataConfig,
) -> None:
    with h5py.File(path, "w") as file:
        file["positions"] = mesh.positions.numpy()
        file["triangles"] = mesh.triangles.numpy()
        file["edge_index"] = mesh.edge_index.numpy()
        file["node_type"] = mesh.node_type.numpy()
        file["inflow"] = inflow.numpy()
        file.create_dataset("fields", data=fields, dtype=np.float32)
        file.attrs["solver_version"] = SOLVER_VERSION
        file.attrs["record_dt"] = config.record_dt
        file.attrs["channels"] = list(CHANNELS)
        file.attrs["node_types"] = list(NODE_TYPES)
        file.attrs["config"] = _config_json(config)
        file.attrs["created_by"] = CREATED_BY
