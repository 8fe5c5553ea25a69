"""Graph partitions and partitioned graphs: numbering invariants, balance, and bad input raising
one clear error on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardsci.graph import GraphPartition, PartitionedGraph, partition_nodes
from shardsci.models import MeshGraphNet
from shardsci.tensor._gather_plan import gather_plan
from shardsci.testing import (
    assert_all_ranks,
    assert_raises_all_ranks,
    count_traffic,
    get_mesh,
    run_on_ranks,
)
from tests.test_meshgraphnet import TINY, _features, _mesh_graph, _parts


@pytest.mark.parametrize("method", ["metis", "rcb"])
@pytest.mark.parametrize("parts", [1, 3, 4])
def test_partitions_are_balanced_and_compact(method: str, parts: int) -> None:
    positions, edge_index = _mesh_graph(points=200)
    assignment = partition_nodes(
        edge_index, 200, parts, method=method, coordinates=positions, seed=3
    )
    again = partition_nodes(edge_index, 200, parts, method=method, coordinates=positions, seed=3)
    assert torch.equal(assignment, again), "the same inputs give the same partition"
    sizes = torch.bincount(assignment, minlength=parts)
    assert sizes.sum() == 200 and sizes.max() <= 1.1 * 200 / parts + 1, sizes
    cut = (assignment[edge_index[0]] != assignment[edge_index[1]]).float().mean()
    assert cut <= 0.25 * (parts - 1), f"{method}: {cut:.2f} of the edges cross parts"


def test_numbering_groups_nodes_and_edges_by_part() -> None:
    _, edge_index = _mesh_graph(points=60)
    parts = torch.tensor([2, 0, 3])[partition_nodes(edge_index, 60, 3, method="metis")]
    partition = GraphPartition.build(edge_index, parts, 4)
    assert partition.node_sizes[1] == 0 and partition.edge_sizes[1] == 0
    assert sorted(partition.node_order.tolist()) == list(range(60))
    new_parts = parts[partition.node_order]
    assert torch.equal(new_parts, torch.sort(new_parts).values), "nodes are grouped by part"
    new_id = torch.empty(60, dtype=torch.int64)
    new_id[partition.node_order] = torch.arange(60)
    assert torch.equal(partition.edge_index, new_id[edge_index[:, partition.edge_order]])
    for part in range(4):
        dst = partition.edge_index[1, partition.edge_range(part)]
        nodes = partition.node_range(part)
        assert bool(((dst >= nodes.start) & (dst < nodes.stop)).all()), "edges end at own nodes"


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("build", "match"),
    [
        (
            lambda e: GraphPartition.build(e, torch.zeros(39, dtype=torch.int64), 2),
            r"partition does not cover every node: edge_index holds node 39, but the "
            r"partition gives parts to nodes \[0, 39\) only",
        ),
        (
            lambda e: GraphPartition.build(e, torch.zeros(39, dtype=torch.int64), 2, num_nodes=40),
            r"partition does not cover every node: parts gives 39 node\(s\) a part, the graph "
            r"has 40",
        ),
        (
            lambda e: GraphPartition.build(e, torch.tensor([0] * 39 + [-1]), 2),
            r"partition does not cover every node: node 39 is in part -1, expected a part in "
            r"\[0, 2\)",
        ),
        (
            lambda e: partition_nodes(torch.cat([e, torch.tensor([[3], [40]])], 1), 40, 2),
            r"edge_index holds node 40, outside the graph's 40 nodes; expected node ids in "
            r"\[0, 40\)",
        ),
        (
            lambda e: partition_nodes(e, 40, 2, method="rcb"),
            r"recursive coordinate bisection needs coordinates of shape \(40, d\), got None",
        ),
    ],
)
def test_bad_partition_input(build, match: str) -> None:
    _, edge_index = _mesh_graph()
    with pytest.raises(ValueError, match=match):
        build(edge_index)


def _graph_on_two_ranks() -> tuple[PartitionedGraph, torch.Tensor, torch.Tensor]:
    positions, edge_index = _mesh_graph()
    parts = partition_nodes(edge_index, 40, 2, method="rcb", coordinates=positions)
    graph = PartitionedGraph(GraphPartition.build(edge_index, parts, 2), get_mesh((2,)))
    return graph, *_features(positions, edge_index)


def _bad_features_body() -> None:
    graph, nodes, _ = _graph_on_two_ranks()
    assert_raises_all_ranks(
        ValueError,
        r"node values of shape \(39, 3\) do not match the partition: expected 40 nodes",
        lambda: graph.nodes(nodes[:39]),
    )
    own = nodes[graph.local_nodes]
    local = own[:-1] if dist.get_rank() == 1 else own
    assert_raises_all_ranks(
        ValueError,
        r"node rows do not match the partition \(\[20, 20\] nodes per rank\)",
        lambda: graph.nodes_from_local(local),
    )
    three_parts = GraphPartition.build(graph.partition.edge_index, torch.arange(40) % 3, 3)
    assert_raises_all_ranks(
        ValueError,
        r"the partition has 3 parts but mesh axis 0 has 2 ranks; expected one part per rank",
        lambda: PartitionedGraph(three_parts, get_mesh((2,))),
    )


def test_bad_features_raise_on_every_rank() -> None:
    run_on_ranks(2, _bad_features_body)


def _bad_edge_index_body() -> None:
    graph, nodes, edges = _graph_on_two_ranks()
    model = MeshGraphNet(**TINY).double()
    x, e = graph.nodes(nodes), graph.edges(edges)
    index = graph.edge_index.clone()
    if dist.get_rank() == 1:
        index._local[0, -1] = 45
    assert_raises_all_ranks(
        IndexError,
        r"x\[index\]: index value 45 on rank 1 of the group is out of range for a dim of size 40",
        lambda: model(x, e, index),
    )
    assert_raises_all_ranks(
        ValueError,
        r"expects node features \(N, \*B, 3\), got shape \(40, 2\)",
        lambda: model(x[:, :2], e, graph.edge_index),
    )


def test_edge_index_past_the_node_count_raises_on_every_rank() -> None:
    run_on_ranks(2, _bad_edge_index_body)


# ---------------------------------------------------------------------------- halo plans
def _plans_from_the_partition_body() -> dict[str, int]:
    mesh = get_mesh((4,))
    positions, edge_index = _mesh_graph()
    partition = GraphPartition.build(edge_index, _parts("rcb-empty", positions, edge_index), 4)
    with count_traffic() as traffic:
        graph = PartitionedGraph(partition, mesh)
    for row in (0, 1):
        index = graph.edge_index[row]._local
        remembered = gather_plan(index, partition.node_sizes, graph.group, replicated=False)
        exchanged = gather_plan(index.clone(), partition.node_sizes, graph.group, replicated=False)
        assert exchanged is not remembered, "a new storage must build its plan by exchange"
        same = (
            remembered.owned == exchanged.owned
            and remembered.halo_counts == exchanged.halo_counts
            and torch.equal(remembered.send_rows, exchanged.send_rows)
            and torch.equal(remembered.local_index, exchanged.local_index)
            and remembered.negative is None
        )
        assert_all_ranks(same, f"row {row}: the partition's plan differs from the exchanged one")
    return {"collectives": traffic.collective_calls, "messages": traffic.messages}


def test_the_halo_plans_come_from_the_partition_with_no_collective() -> None:
    """Each rank's plans for the graph's sources and destinations, derived from the partition,
    equal those an exchange between the ranks builds (4 parts, one empty), and building the
    graph issues no collective (``count_traffic``)."""
    for counts in run_on_ranks(4, _plans_from_the_partition_body):
        assert counts == {"collectives": 0, "messages": 0}, counts
