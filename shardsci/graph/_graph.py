"""A graph partitioned over one mesh axis: node and edge tensors as ShardTensors.

# NOTE [A partitioned graph is ShardTensors plus a halo plan]
Rank ``k`` of the graph's mesh axis owns the nodes of part ``k`` (a contiguous range of the
partition's node numbering, any size, empty included) and the edges ending at them. Node
features are ShardTensors sharded on their node dim with the part sizes, edge features
sharded on their edge dim with the edge counts, and the edge index is a ``(2, E)`` int64
ShardTensor sharded on dim 1 the same way, holding global (new) node ids. Nothing else
carries the partition, so a module written for one device runs on these unchanged:
``x[edge_index[0]]`` gathers source features through the gather handler, which finds the
halo plan cached for the edge index's storage (NOTE [Gathers along a sharded dim go through
a cached halo plan]), and ``zeros_like(x).index_add_(0, edge_index[1], messages)`` or
``scatter_reduce`` sums (or averages, maxes) messages into the destinations, which are always
local. The graph gives both rows their plans when it is created, so the only exchange a
message-passing layer makes is the one gather of its source features (and, in backward, its
adjoint).

# NOTE [A partitioned graph's halo plan comes from its partition]
Every rank holds the whole :class:`GraphPartition`, so it knows every part's edges, and with
them every part's halo: the partition computes each part's plan on the host when it is built
(``halo_counts``, ``local_edge_index``, ``send_rows``), the same on every rank, and building
the graph makes no collective (a gather plan of an arbitrary sharded index needs two exchanges,
which a fake process group would answer with uninitialised values). The graph copies its
part's rows of those tables, its edge index and its node and edge orders to the mesh's device
once, when it is built, and hands the plans to the gather handlers' cache
(``remember_plan``): every tensor a step and its halo exchanges then use is on the mesh's
device, which ``tests/test_meta_device.py`` checks on the ``meta`` device.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from shardsci.graph._partition import GraphPartition
from shardsci.tensor import ShardTensor
from shardsci.tensor._api import from_local_spec
from shardsci.tensor._collectives import axis_group
from shardsci.tensor._gather_plan import GatherPlan, remember_plan
from shardsci.tensor._spec import ShardTensorSpec

__all__ = ["PartitionedGraph"]


class PartitionedGraph:
    """A :class:`GraphPartition` laid out over one mesh axis: part ``k`` on its rank ``k``.

    Building one makes no collective: every rank derives every part's halo plan from the
    partition (NOTE [A partitioned graph's halo plan comes from its partition]).

    Parameters
    ----------
    partition : GraphPartition
        The same on every rank; its number of parts must equal the ranks along ``axis``.
    mesh : DeviceMesh
        Node and edge tensors are sharded over ``axis`` and replicated over the other axes.
    axis : int or str
        The mesh axis (index or name) the graph is split over.
    """

    def __init__(self, partition: GraphPartition, mesh: DeviceMesh, axis: int | str = 0) -> None:
        self.partition = partition
        self.mesh = mesh
        self.axis = _axis_index(mesh, axis)
        parts = mesh.shape[self.axis]
        if len(partition.node_sizes) != parts:
            raise ValueError(
                f"the partition has {len(partition.node_sizes)} parts but mesh axis "
                f"{self.axis} has {parts} ranks; expected one part per rank"
            )
        self.group = axis_group(mesh, (self.axis,))
        self.part = self.group.index
        self.device = _mesh_device(mesh)
        edges = partition.edge_range(self.part)
        local = partition.edge_index[:, edges].contiguous().to(self.device)
        spec = ShardTensorSpec.build(
            mesh,
            self._placements(1),
            (2, partition.num_edges),
            torch.int64,
            {1: partition.edge_sizes},
        )
        self.edge_index = from_local_spec(local, spec)
        self._node_order = partition.node_order.to(self.device)
        self._local_edges = partition.edge_order[edges].to(self.device)
        self._remember_plans(partition.local_edge_index[:, edges].contiguous().to(self.device))

    def _remember_plans(self, local_index: torch.Tensor) -> None:
        """Give the gather handlers the plans of ``edge_index[0]`` (sources: the halo) and
        ``edge_index[1]`` (destinations: all owned), ``local_index`` ``(2, E_k)``."""
        partition, me = self.partition, self.part
        sources = GatherPlan(
            self.group,
            partition.node_sizes[me],
            partition.halo_counts,
            partition.send_rows[partition.send_range(me)].to(self.device),
            local_index[0],
            negative=None,
        )
        nothing_moves = tuple((0,) * len(row) for row in partition.halo_counts)
        destinations = GatherPlan(
            self.group,
            partition.node_sizes[me],
            nothing_moves,
            local_index.new_empty(0),
            local_index[1],
            negative=None,
        )
        for row, plan in enumerate((sources, destinations)):
            remember_plan(self.edge_index[row]._local, partition.node_sizes, plan)

    # ------------------------------------------------------------------ sizes
    @property
    def num_nodes(self) -> int:
        return self.partition.num_nodes

    @property
    def num_edges(self) -> int:
        return self.partition.num_edges

    @property
    def local_nodes(self) -> torch.Tensor:
        """Original ids of the nodes this rank owns, in their new order (on the host, as the
        partition: e.g. to read them from a file)."""
        return self.partition.node_order[self.partition.node_range(self.part)]

    @property
    def local_edges(self) -> torch.Tensor:
        """Original positions of the edges this rank owns, in their new order (on the host)."""
        return self.partition.edge_order[self.partition.edge_range(self.part)]

    # ------------------------------------------------------------------ tensors
    def nodes(self, values: torch.Tensor) -> ShardTensor:
        """This rank's rows of ``values`` ``(N, ...)`` (original node order), as a ShardTensor
        ``(N, ...)`` in the partition's order. Differentiable; no communication."""
        self._check_rows(values, self.num_nodes, "node")
        rows = self._node_order[self.partition.node_range(self.part)]
        return self._wrap(values[rows.to(values.device)], self.partition.node_sizes)

    def edges(self, values: torch.Tensor) -> ShardTensor:
        """This rank's rows of ``values`` ``(E, ...)`` (original edge order), as a ShardTensor
        ``(E, ...)`` in the partition's order. Differentiable; no communication."""
        self._check_rows(values, self.num_edges, "edge")
        rows = self._local_edges.to(values.device)
        return self._wrap(values[rows], self.partition.edge_sizes)

    def nodes_from_local(self, local: torch.Tensor) -> ShardTensor:
        """Wrap this rank's node rows ``(N_k, ...)`` (e.g. read from a file by
        :attr:`local_nodes`). Differentiable. Every rank's row count is checked against the
        partition in one small all-gather, so a mismatch raises on every rank."""
        return self._from_local(local, self.partition.node_sizes, "node")

    def edges_from_local(self, local: torch.Tensor) -> ShardTensor:
        """Wrap this rank's edge rows ``(E_k, ...)``; checked like :meth:`nodes_from_local`."""
        return self._from_local(local, self.partition.edge_sizes, "edge")

    def to_original(self, nodes: ShardTensor) -> torch.Tensor:
        """The whole node tensor ``(N, ...)`` on every rank, in the original node order."""
        whole = nodes.full_tensor()
        return torch.empty_like(whole).index_copy_(0, self._node_order.to(whole.device), whole)

    # ------------------------------------------------------------------ helpers
    def _placements(self, dim: int) -> list:
        return [Shard(dim) if a == self.axis else Replicate() for a in range(self.mesh.ndim)]

    def _wrap(self, local: torch.Tensor, sizes: tuple[int, ...]) -> ShardTensor:
        shape = (sum(sizes), *local.shape[1:])
        spec = ShardTensorSpec.build(self.mesh, self._placements(0), shape, local.dtype, {0: sizes})
        return from_local_spec(local, spec)

    def _from_local(self, local: torch.Tensor, sizes: tuple[int, ...], what: str) -> ShardTensor:
        if local.ndim == 0:
            raise ValueError(f"{what} rows must have at least one dim, got a 0-d tensor")
        try:
            return ShardTensor.from_local(
                local, self.mesh, self._placements(0), {self.axis: sizes}, run_check=True
            )
        except ValueError as error:
            raise ValueError(
                f"{what} rows do not match the partition ({list(sizes)} {what}s per rank): {error}"
            ) from None

    def _check_rows(self, values: torch.Tensor, expected: int, what: str) -> None:
        if values.ndim == 0 or values.shape[0] != expected:
            raise ValueError(
                f"{what} values of shape {tuple(values.shape)} do not match the partition: "
                f"expected {expected} {what}s along dim 0"
            )


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    """This rank's device of ``mesh``: ``cuda:<current>`` on a CUDA mesh (as the trainer's
    ``Parallelism.device``), else the mesh's device type (``cpu``, ``meta``)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _axis_index(mesh: DeviceMesh, axis: int | str) -> int:
    if isinstance(axis, str):
        names = mesh.mesh_dim_names or ()
        if axis not in names:
            raise ValueError(f"mesh axis {axis!r} is not one of the mesh's axes {names}")
        return names.index(axis)
    if not 0 <= axis < mesh.ndim:
        raise ValueError(f"mesh axis {axis} is out of range for a {mesh.ndim}-D mesh")
    return axis
