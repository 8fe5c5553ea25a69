"""The mesh CFD data: a triangle mesh with holes, the flow past cylinders sampled on it, the
HDF5 file, and each rank reading only its partition's rows."""

from __future__ import annotations

import io
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from recipes.mesh_cfd.cylinder_flow import CylinderFlow, CylinderFlowConfig, obstacle_mask
from recipes.mesh_cfd.generate import MeshDataConfig, generate
from recipes.mesh_cfd.mesh import MeshConfig, cylinder_mesh
from shardsci.graph import GraphPartition, PartitionedGraph, partition_nodes, read_rows
from shardsci.testing import assert_all_ranks, get_mesh, run_on_ranks

SMALL = MeshDataConfig(
    flow=CylinderFlowConfig(nx=64, ny=32),
    mesh=MeshConfig(spacing=0.08, wall_spacing=0.04),
    trajectories=2,
    records=3,
    record_every=2,
    spin_up_steps=4,
)


def test_mesh_has_one_hole_per_cylinder() -> None:
    cylinders = CylinderFlowConfig().circles
    mesh = cylinder_mesh(cylinders, MeshConfig())
    undirected = mesh.edge_index.shape[1] // 2
    euler = mesh.positions.shape[0] - undirected + mesh.triangles.shape[0]
    assert euler == 1 - len(cylinders), "V - E + T = 1 - holes for a plane region with holes"
    for x, y, r in cylinders:
        distance = (mesh.positions - torch.tensor([x, y], dtype=torch.float64)).norm(dim=1)
        assert distance.min() >= r - 1e-12, "no node inside a cylinder"
        on_wall = (distance - r).abs() < 1e-9
        assert bool((mesh.node_type[on_wall] == 1).all()) and on_wall.sum() > 10
    a, b, c = (mesh.positions[mesh.triangles[:, k]] for k in range(3))
    area = 0.5 * ((b - a)[:, 0] * (c - a)[:, 1] - (b - a)[:, 1] * (c - a)[:, 0])
    assert bool((area > 0).all()), "triangles are counter-clockwise and not degenerate"


def test_flow_sampling_is_the_grid_field_and_cylinders_hold_still() -> None:
    config = CylinderFlowConfig()
    flow = CylinderFlow(config)
    generator = torch.Generator().manual_seed(0)
    noise = torch.randn(2, config.nx, config.ny, generator=generator, dtype=torch.float64)
    inflow = torch.tensor([0.9, 1.1], dtype=torch.float64)
    state = flow.advance(flow.spectral(0.05 * noise), inflow, 60)
    dx, dy = config.spacing
    cells = torch.tensor([[3, 5], [40, 17], [100, 60]])
    sampled = flow.sample(state, inflow, cells * torch.tensor([dx, dy], dtype=torch.float64))
    u, v = flow.velocity(state, inflow)
    w = flow.physical(state)
    on_grid = torch.stack([field[:, cells[:, 0], cells[:, 1]] for field in (u, v, w)], -1)
    torch.testing.assert_close(sampled, on_grid, rtol=1e-10, atol=1e-10)
    core = flow.solid > 0.999
    speed = torch.sqrt(u**2 + v**2)[:, core]
    assert float(speed.max()) < 0.15 * float(inflow.min()), "penalised cylinders hold the flow"
    assert float(torch.sqrt(u**2 + v**2).max()) > 1.0
    assert obstacle_mask(torch.tensor(0.4), torch.tensor(0.45), config) > 0.999


def test_rejects_unstable_settings() -> None:
    with pytest.raises(ValueError, match=r"dt=0.05 is too large for penalty_time=0.005"):
        CylinderFlowConfig(dt=0.05)
    with pytest.raises(ValueError, match=r"cylinder \(x=1.9, y=0.5, r=0.1\) must lie inside"):
        CylinderFlowConfig(cylinders=(1.9, 0.5, 0.1))


@pytest.fixture(scope="module")
def small_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("mesh_cfd") / "data.h5", SMALL)


def test_file_layout(small_file: Path) -> None:
    with h5py.File(small_file) as file:
        nodes = file["positions"].shape[0]
        assert file["fields"].shape == (2, 3, nodes, 3)
        assert file["fields"].chunks is None, "contiguous: a rank reads only its rows"
        assert file["edge_index"].shape[0] == 2 and file["inflow"].shape == (2,)
        assert file.attrs["record_dt"] == pytest.approx(2 * SMALL.flow.dt)
        assert list(file.attrs["channels"]) == ["u", "v", "vorticity"]
        assert np.isfinite(file["fields"][:]).all()
    assert not list(small_file.parent.glob("*.partial-*"))


class _RecordedFile(io.FileIO):
    """A read-only file that records the ``(offset, length)`` of every read."""

    def __init__(self, path: str) -> None:
        super().__init__(path, "r")
        self.reads: list[tuple[int, int]] = []

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        offset = self.tell()
        count = super().readinto(buffer) or 0
        self.reads.append((offset, count))
        return count


def _read_partition_body(path: str) -> int:
    with h5py.File(path) as file:
        edge_index = torch.from_numpy(file["edge_index"][:])
        positions = torch.from_numpy(file["positions"][:])
        whole = file["fields"][:]
        dataset = file["fields"]
        start, nbytes = dataset.id.get_offset(), dataset.id.get_storage_size()
    parts = partition_nodes(edge_index, positions.shape[0], 2, method="metis")
    graph = PartitionedGraph(GraphPartition.build(edge_index, parts, 2), get_mesh((2,)))
    recorded = _RecordedFile(path)
    with h5py.File(recorded, "r") as file:
        recorded.reads.clear()
        mine = read_rows(file["fields"], graph.local_nodes, dim=2)
    field_bytes = sum(
        min(offset + length, start + nbytes) - max(offset, start)
        for offset, length in recorded.reads
        if offset < start + nbytes and offset + length > start
    )
    assert_all_ranks(
        np.array_equal(mine, whole[:, :, graph.local_nodes.numpy()]),
        "read_rows returned other values than the file's rows of this rank's nodes",
    )
    assert_all_ranks(
        field_bytes == mine.nbytes, f"read {field_bytes} bytes of the field for {mine.nbytes}"
    )
    return len(graph.local_nodes)


def test_each_rank_reads_only_its_partition(small_file: Path) -> None:
    counts = run_on_ranks(2, _read_partition_body, str(small_file))
    with h5py.File(small_file) as file:
        assert sum(counts) == file["positions"].shape[0]
