"""MeshGraphNet on a partitioned mesh: halo bytes per layer against the lower bound, and the
training step time at 1, 2 and 4 ranks.

The graph is the flow-past-cylinders mesh of the mesh CFD recipe (``recipes/mesh_cfd/mesh.py``)
at a finer spacing, partitioned by METIS. One step is a forward, a backward and an AdamW
update of ``MeshGraphNet`` (float32, one thread per rank) on that graph with random node
features. At 1 rank the plain module runs on plain tensors; at 2 and 4 ranks the same module
runs on the ``PartitionedGraph``'s ShardTensors.

Records (JSON lines on stdout):

- ``graph_halo``, one per rank count: ``ranks``, ``nodes``, ``edges``, ``hidden``,
  ``blocks``; per rank ``nodes_per_rank``, ``halo_nodes`` (distinct remote source nodes of
  its edges, from the partition), ``halo_bytes_per_layer`` (bytes received in one forward,
  all of them by the gathers of neighbours' features, divided by the blocks, counted by
  ``shardsci.testing.count_traffic``) and ``lower_bound_bytes``
  (``halo_nodes × hidden × 4``); ``at_lower_bound`` (every rank equal); ``step_s_median``
  and ``step_s_min``/``step_s_max`` over the timed steps (wall time from a barrier to the
  slowest rank's end), ``cpu_s_median`` (the slowest rank's process time per step);
- ``summary``: speed-up of the median step at each rank count over 1 rank (``speedup_<N>``);
  goal: every rank's halo bytes at the lower bound.

Run ``python -m benchmarks.graph_halo [--spacing 0.015] [--steps 10] [--worlds 1 2 4]
[--check]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks._common import Goal, emit, emit_summary, on_ranks, parse_arguments, rank_pools
from shardsci.graph import GraphPartition, PartitionedGraph, partition_nodes
from shardsci.models import MeshGraphNet
from shardsci.recipes.mesh_cfd.cylinder_flow import CylinderFlowConfig
from shardsci.recipes.mesh_cfd.mesh import MeshConfig, cylinder_mesh
from shardsci.testing import count_traffic, get_mesh

HIDDEN = 64
BLOCKS = 6


def _inputs(spacing: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Edge index, node features ``(N, 3)`` and edge features ``(E, 3)`` of the mesh."""
    mesh = cylinder_mesh(
        CylinderFlowConfig().circles, MeshConfig(spacing=spacing, wall_spacing=spacing / 2)
    )
    edge_index = mesh.edge_index
    generator = torch.Generator().manual_seed(0)
    nodes = torch.randn(mesh.positions.shape[0], 3, generator=generator)
    offset = (mesh.positions[edge_index[1]] - mesh.positions[edge_index[0]]).float()
    edges = torch.cat([offset, offset.norm(dim=1, keepdim=True)], dim=1)
    return edge_index, nodes, edges


def _step_body(spacing: float, steps: int, warmup: int) -> dict[str, object]:
    world = dist.get_world_size()
    edge_index, nodes, edges = _inputs(spacing)
    torch.manual_seed(0)
    model = MeshGraphNet(node_in=3, edge_in=3, node_out=2, hidden=HIDDEN, processor_blocks=BLOCKS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    partition = GraphPartition.build(
        edge_index, partition_nodes(edge_index, nodes.shape[0], world, method="metis"), world
    )
    if world == 1:
        inputs = (nodes, edges, edge_index)
        halo_bytes = 0
    else:
        graph = PartitionedGraph(partition, get_mesh((world,)))
        inputs = (graph.nodes(nodes), graph.edges(edges), graph.edge_index)
        with torch.no_grad(), count_traffic() as traffic:
            model(*inputs)
        halo_bytes = traffic.received // BLOCKS

    def step() -> None:
        optimizer.zero_grad()
        out = model(*inputs)
        loss = (out.to_local() if world > 1 else out).square().sum()
        loss.backward()
        optimizer.step()

    wall, cpu = [], []
    for index in range(warmup + steps):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        elapsed_cpu = time.process_time() - start_cpu
        dist.barrier()
        if index >= warmup:
            wall.append(time.perf_counter() - start)
            cpu.append(elapsed_cpu)
    part = dist.get_rank()
    return {
        "nodes": partition.num_nodes,
        "edges": partition.num_edges,
        "nodes_per_rank": partition.node_sizes[part],
        "halo_nodes": partition.halo_sizes()[part],
        "halo_bytes_per_layer": halo_bytes,
        "wall": wall,
        "cpu": cpu,
    }


def lower_bound_bytes(halo_nodes: int) -> int:
    """The least bytes a layer receives: one float32 feature vector per distinct remote node
    its edges read."""
    return halo_nodes * HIDDEN * 4


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--spacing", type=float, default=0.015, help="mesh spacing (0.015: ~8k nodes)"
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps per rank count")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--worlds", nargs="+", type=int, default=[1, 2, 4], help="rank counts")
    args = parse_arguments(parser, argv)
    medians: dict[int, float] = {}
    at_bound = []
    with rank_pools():
        for world in args.worlds:
            ranks = on_ranks(world, _step_body, args.spacing, args.steps, args.warmup)
            wall = [max(r["wall"][i] for r in ranks) for i in range(args.steps)]
            cpu = [max(r["cpu"][i] for r in ranks) for i in range(args.steps)]
            bound = [lower_bound_bytes(r["halo_nodes"]) if world > 1 else 0 for r in ranks]
            measured = [r["halo_bytes_per_layer"] for r in ranks]
            medians[world] = statistics.median(wall)
            at_bound.append(measured == bound)
            emit(
                "graph_halo",
                ranks=world,
                nodes=ranks[0]["nodes"],
                edges=ranks[0]["edges"],
                hidden=HIDDEN,
                blocks=BLOCKS,
                nodes_per_rank=[r["nodes_per_rank"] for r in ranks],
                halo_nodes=[r["halo_nodes"] for r in ranks],
                halo_bytes_per_layer=measured,
                lower_bound_bytes=bound,
                at_lower_bound=measured == bound,
                step_s_median=round(medians[world], 4),
                step_s_min=round(min(wall), 4),
                step_s_max=round(max(wall), 4),
                cpu_s_median=round(statistics.median(cpu), 4),
            )
    emit_summary(
        [Goal("halo bytes per layer at the lower bound on every rank", all(at_bound))],
        args.check,
        **{
            f"speedup_{world}": round(medians[1] / median, 2)
            for world, median in medians.items()
            if world > 1 and 1 in medians
        },
    )


if __name__ == "__main__":
    main()
