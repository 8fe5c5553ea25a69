"""The mesh CFD recipe's data: velocity pairs (t, t + 1) on the cylinders' triangle mesh, in
each rank's part of its graph.

The dataset is read from the user's file, or from ours, generated before (``Recipe.prepare`` on
rank 0: ``meshfile.prepare``). Every rank reads the triangle mesh's connectivity (small) and
partitions its graph the same way (METIS or recursive coordinate bisection, one part per rank
of the DeviceMesh's domain axis); then it reads only its own nodes' rows of the fields
(``shardsci.graph.read_rows``), all in one opening of the file. Normalisation statistics are
combined from a few sums per rank. Without a domain axis the whole graph is one part and the
tensors are plain.

A sample is the mesh's node features at time t, ``(N, F_v)`` with F_v = 2 normalised velocity
components and a 4-way node-type one-hot, and the edges' features, ``(E, 3)``: the relative
position of the two ends and its length, in units of the mean edge length. The target is the
normalised change of the velocity to t + 1. A batch stacks samples on a batch dim after the
node (or edge) dim: ``(N, B, F)``.
"""

from __future__ import annotations

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig

from shardsci.data import HeldOutPairs, NextStepPairs
from shardsci.graph import GraphPartition, PartitionedGraph, partition_nodes, read_rows
from shardsci.recipes.mesh_cfd.mesh import NODE_TYPES
from shardsci.training import Parallelism, RunContext

__all__ = ["SAMPLE_DIM", "Batch", "MeshData"]

Batch = list[torch.Tensor]
"""Node velocities ``(N, B, 2)`` at t, t + 1, ..., t + ``train.rollout.steps``."""
"""((node features, edge features, edge index), target change)."""

SAMPLE_DIM = 1
"""The batch dim of node and edge tensors ``(N, B, F)``."""


class MeshData:
    """Training and held-out samples on this rank's part of the graph.

    Parameters
    ----------
    cfg : DictConfig
        The run config: ``data`` (``recipes/mesh_cfd/config.py``), ``train.global_batch``,
        ``train.seed``.
    run : RunContext
        This rank's place in the run: which ranks share a batch part (data parallel) and which
        split the graph.
    """

    def __init__(self, cfg: DictConfig, run: RunContext) -> None:
        config, parallelism = cfg.data, run.parallelism
        self.device = run.device
        with h5py.File(config.path, "r") as file:
            edge_index = torch.from_numpy(file["edge_index"][:])
            positions = torch.from_numpy(file["positions"][:])
            node_type = torch.from_numpy(file["node_type"][:])
            self.triangles = torch.from_numpy(file["triangles"][:])
            self.positions = positions
            trajectories, self.n_times = file["fields"].shape[:2]
            self.graph, self.partition = _partitioned(
                edge_index, positions, parallelism, config.partition.value
            )
            nodes = self.graph.local_nodes if self.graph else self.partition.node_order
            velocity = read_rows(file["fields"], nodes, dim=2)[..., :2]
        test = config.test_trajectories
        self.train_trajectories = list(range(trajectories - test))
        dp = {"dp_rank": parallelism.dp_rank, "dp_size": parallelism.dp_size}
        self.training_pairs = NextStepPairs(
            tuple(self.train_trajectories),
            self.n_times,
            cfg.train.global_batch,
            cfg.train.seed,
            horizon=cfg.train.rollout.steps,
            **dp,
        )
        self.held_out = HeldOutPairs(
            tuple(range(trajectories - test, trajectories)), self.n_times, **dp
        )
        self.velocity = torch.from_numpy(np.ascontiguousarray(velocity))  # (S, T, N_k, 2)
        self.mean, self.std, self.change_std = self._statistics()
        self.node_type = F.one_hot(node_type[nodes], len(NODE_TYPES)).float()
        self.edge_features = self._edge_features(positions)
        self.cells_per_sample = positions.shape[0]

    # ------------------------------------------------------------------ samples
    def train_batch(self, step: int) -> Batch:
        """This data-parallel rank's share of global batch ``step`` (``NextStepPairs``): the
        velocities at t, t + 1, ..., t + ``train.rollout.steps``."""
        pairs = self.training_pairs
        return self.velocities(pairs.batch(step).inputs, pairs.horizon)

    def velocities(self, pairs: np.ndarray, steps: int) -> list[torch.Tensor]:
        """The velocities ``(N, B, 2)`` of the (trajectory, time) ``pairs`` ``(b, 2)`` at t,
        t + 1, ..., t + steps, as node tensors."""
        b, t = torch.from_numpy(pairs[:, 0]), torch.from_numpy(pairs[:, 1])
        return [
            self.node_tensor(self.velocity[b, t + k].transpose(0, 1).contiguous())
            for k in range(steps + 1)
        ]

    def inputs(self, velocity: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Model inputs for node velocities ``(N, B, 2)`` in physical units."""
        batch = velocity.shape[1]
        types = self.node_tensor(self.node_type[:, None].expand(-1, batch, -1).contiguous())
        nodes = torch.cat([(velocity - self.mean) / self.std, types], -1)
        edges = self.edge_tensor(self.edge_features[:, None].expand(-1, batch, -1).contiguous())
        edge_index = self.graph.edge_index if self.graph else self.partition.edge_index
        return nodes, edges, edge_index.to(self.device)

    def advanced(self, velocity: torch.Tensor, change: torch.Tensor) -> torch.Tensor:
        """The velocity one record later, from the model's normalised change."""
        return velocity + change * self.change_std

    # ------------------------------------------------------------------ node and edge tensors
    def node_tensor(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's node rows ``(N_k, ...)`` as the graph's node ShardTensor (or plain)."""
        local = local.to(self.device)
        return self.graph.nodes_from_local(local) if self.graph else local

    def edge_tensor(self, local: torch.Tensor) -> torch.Tensor:
        local = local.to(self.device)
        return self.graph.edges_from_local(local) if self.graph else local

    def in_original_order(self, nodes: torch.Tensor) -> torch.Tensor:
        """The whole node tensor in the file's node order (a collective over the graph's
        ranks)."""
        if self.graph is not None:
            return self.graph.to_original(nodes)
        return torch.empty_like(nodes).index_copy_(0, self.partition.node_order, nodes)

    # ------------------------------------------------------------------ helpers
    def _statistics(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-component mean and standard deviation of the training velocity, and the
        standard deviation of its change over one record, over every node of the graph."""
        train = self.velocity[self.train_trajectories].double()
        change = train[:, 1:] - train[:, :-1]
        sums = torch.stack(
            [
                train.sum((0, 1, 2)),
                train.square().sum((0, 1, 2)),
                change.square().sum((0, 1, 2)),
                torch.tensor([train[..., 0].numel(), change[..., 0].numel()], dtype=torch.float64),
            ]
        )
        if self.graph is not None:
            sums = sums.to(self.device)  # the group's device: NCCL takes no CPU tensors
            dist.all_reduce(sums, group=self.graph.group.group)
            sums = sums.cpu()
        count, change_count = sums[3]
        mean = sums[0] / count
        std = (sums[1] / count - mean.square()).sqrt()
        change_std = (sums[2] / change_count).sqrt()
        return mean.float(), std.float(), change_std.float()

    def _edge_features(self, positions: torch.Tensor) -> torch.Tensor:
        """``(E_k, 3)``: relative position of each local edge's ends and its length, in units
        of the mean edge length of the whole mesh."""
        ordered = positions[self.partition.node_order]
        src, dst = self.partition.edge_index
        scale = (ordered[dst] - ordered[src]).norm(dim=1).mean()
        part = self.graph.part if self.graph is not None else 0
        src, dst = self.partition.edge_index[:, self.partition.edge_range(part)]
        offset = (ordered[dst] - ordered[src]) / scale
        return torch.cat([offset, offset.norm(dim=1, keepdim=True)], 1).float()


def _partitioned(
    edge_index: torch.Tensor, positions: torch.Tensor, parallelism: Parallelism, method: str
) -> tuple[PartitionedGraph | None, GraphPartition]:
    """The graph split over the DeviceMesh's domain axis (None without one), and its
    partition. The recipe's one spatial dim (``Recipe.spatial_dims``) makes that at most one
    axis."""
    domain = parallelism.domain_mesh
    parts = domain.size() if domain is not None else 1
    assignment = partition_nodes(
        edge_index, positions.shape[0], parts, method=method, coordinates=positions
    )
    partition = GraphPartition.build(edge_index, assignment, parts)
    return (PartitionedGraph(partition, domain) if domain is not None else None), partition
