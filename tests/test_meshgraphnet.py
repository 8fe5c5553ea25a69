"""MeshGraphNet: the single-device module, and the same module on a partitioned graph against
it (forward and every parameter gradient, float64), with the halo bytes per layer."""

from __future__ import annotations

import pytest
import torch
from scipy.spatial import Delaunay
from torch.distributed.tensor import Shard

from shardsci.graph import GraphPartition, PartitionedGraph, partition_nodes
from shardsci.models import MeshGraphNet, MeshGraphNetConfig
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    check_against_reference,
    counted_comm,
    get_mesh,
    run_on_ranks,
)

TINY = {"node_in": 3, "edge_in": 3, "node_out": 2, "hidden": 8, "processor_blocks": 2}


def _mesh_graph(points: int = 40, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Node positions ``(N, 2)`` and the edges of their Delaunay triangulation, both
    directions, ``(2, E)``."""
    generator = torch.Generator().manual_seed(seed)
    positions = torch.rand(points, 2, generator=generator, dtype=torch.float64)
    triangles = torch.as_tensor(Delaunay(positions.numpy()).simplices)
    pairs = torch.cat([triangles[:, [0, 1]], triangles[:, [1, 2]], triangles[:, [2, 0]]])
    pairs = torch.unique(torch.cat([pairs, pairs.flip(1)]), dim=0)
    return positions, pairs.t().contiguous()


def _features(positions: torch.Tensor, edge_index: torch.Tensor) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(1)
    nodes = torch.randn(positions.shape[0], 3, generator=generator, dtype=torch.float64)
    offset = positions[edge_index[1]] - positions[edge_index[0]]
    edges = torch.cat([offset, offset.norm(dim=1, keepdim=True)], dim=1)
    return nodes, edges


def _parts(name: str, positions: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
    """``metis-P``: METIS into P parts; ``rcb-empty``: 3 bisection parts on parts 0, 1, 3 of
    4, so part 2 owns no node."""
    if name.startswith("metis"):
        return partition_nodes(edge_index, positions.shape[0], int(name[-1]), method="metis")
    parts = partition_nodes(edge_index, positions.shape[0], 3, method="rcb", coordinates=positions)
    return torch.tensor([0, 1, 3])[parts]


# ---------------------------------------------------------------------------- one device
def test_output_shape_and_config() -> None:
    positions, edge_index = _mesh_graph()
    nodes, edges = _features(positions, edge_index)
    model = MeshGraphNet(dtype_free_config := MeshGraphNetConfig(**TINY)).double()
    assert model.config == dtype_free_config
    assert model(nodes, edges, edge_index).shape == (positions.shape[0], 2)
    assert len(model.processor) == 2


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"hidden": 0}, r"hidden must be a positive integer, got 0"),
        ({"aggregation": "min"}, r"aggregation must be one of \('sum', 'mean', 'max'\)"),
    ],
)
def test_rejects_config(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MeshGraphNetConfig(**overrides)


def test_rejects_mismatched_inputs() -> None:
    positions, edge_index = _mesh_graph()
    nodes, edges = _features(positions, edge_index)
    model = MeshGraphNet(**TINY).double()
    with pytest.raises(ValueError, match=r"edge features \(\d+, 3\) for \d+ edges and node"):
        model(nodes, edges[:-1], edge_index)
    with pytest.raises(ValueError, match=r"node features \(N, \*B, 3\), got shape \(40, 2\)"):
        model(nodes[:, :2], edges, edge_index)


def test_permutation_equivariant() -> None:
    """Renumbering nodes and edges (what a partition does) permutes the output alike."""
    positions, edge_index = _mesh_graph()
    nodes, edges = _features(positions, edge_index)
    torch.manual_seed(0)
    model = MeshGraphNet(**TINY, aggregation="mean").double()
    partition = GraphPartition.build(edge_index, _parts("rcb-empty", positions, edge_index), 4)
    out = model(nodes, edges, edge_index)
    renumbered = model(
        nodes[partition.node_order], edges[partition.edge_order], partition.edge_index
    )
    torch.testing.assert_close(renumbered, out[partition.node_order])


# ---------------------------------------------------------------------------- partitioned
def _sharded_body(parts_name: str, aggregation: str, batch: int) -> None:
    world = 2 if parts_name == "metis-2" else 4
    mesh = get_mesh((world,))
    positions, edge_index = _mesh_graph()
    partition = GraphPartition.build(edge_index, _parts(parts_name, positions, edge_index), world)
    nodes, edges = _features(positions, edge_index)
    if batch:
        nodes = torch.stack([nodes, nodes.flip(1)], 1)[:, :batch]
        edges = torch.stack([edges, -edges], 1)[:, :batch]
    torch.manual_seed(0)
    model = MeshGraphNet(**TINY, aggregation=aggregation).double()
    node_layout = Layout((Shard(0),), {0: partition.node_sizes})
    edge_layout = Layout((Shard(0),), {0: partition.edge_sizes})
    index_layout = Layout((Shard(1),), {1: partition.edge_sizes})
    check_against_reference(
        lambda m, x, e, index: m(x, e, index),
        [nodes[partition.node_order], edges[partition.edge_order], partition.edge_index],
        [node_layout, edge_layout, index_layout],
        mesh,
        module=model,
        out_layouts=[node_layout],
        what=f"{parts_name} {aggregation}",
    )


@pytest.mark.parametrize(
    ("parts_name", "aggregation", "batch"),
    [
        ("metis-2", "sum", 0),
        ("metis-2", "mean", 2),
        ("rcb-empty", "sum", 0),
        ("rcb-empty", "max", 2),
    ],
)
def test_partitioned_equals_single_device(parts_name: str, aggregation: str, batch: int) -> None:
    """Sharded == single device; ``batch`` > 0 adds a batch dim of that many samples."""
    world = 2 if parts_name == "metis-2" else 4
    run_on_ranks(world, _sharded_body, parts_name, aggregation, batch)


def _graph_api_body() -> dict[str, int]:
    mesh = get_mesh((4,))
    positions, edge_index = _mesh_graph()
    partition = GraphPartition.build(edge_index, _parts("rcb-empty", positions, edge_index), 4)
    graph = PartitionedGraph(partition, mesh)
    nodes, edges = _features(positions, edge_index)
    torch.manual_seed(0)
    model = MeshGraphNet(**TINY).double()
    reference = model(nodes, edges, edge_index)
    with counted_comm() as stats:
        out = model(graph.nodes(nodes), graph.edges(edges), graph.edge_index)
        out.to_local().sum().backward()
    assert_all_ranks(
        torch.allclose(graph.to_original(out.detach()), reference, atol=1e-12, rtol=1e-12),
        "the partitioned graph's output, in the original node order, differs from one device",
    )
    return {
        "gather": stats.received["gather"],
        "gather_calls": stats.calls["gather"],
        "scatter": stats.sent["scatter"],
        "plan_calls": stats.calls["gather_plan"],
        "halo": partition.halo_sizes()[graph.part],
        "nodes": partition.node_sizes[graph.part],
    }


def test_halo_bytes_per_layer_are_the_lower_bound() -> None:
    """Each processor block receives exactly the distinct remote source nodes' latents, once,
    and its backward returns the same bytes; plans were built with the graph."""
    results = run_on_ranks(4, _graph_api_body)
    assert [r["nodes"] for r in results].count(0) == 1
    blocks, row_bytes = TINY["processor_blocks"], TINY["hidden"] * 8
    for r in results:
        assert r["gather"] == blocks * r["halo"] * row_bytes, r
        assert r["gather_calls"] == blocks, r
        assert r["plan_calls"] == 0, r
    assert sum(r["scatter"] for r in results) == sum(r["gather"] for r in results)
    assert any(r["halo"] for r in results)
