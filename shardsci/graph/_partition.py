"""Splitting a graph's nodes into parts, and the numbering that makes each part contiguous.

A ShardTensor shard is a contiguous range of a dim, so a partitioned graph numbers its nodes
part by part (and, within a part, in their original order) and its edges by the part that
owns their destination. :class:`GraphPartition` holds that numbering. It is a pure function
of the graph and the part of every node, computed identically on every rank without
communication, so every check on it raises on every rank alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

__all__ = ["GraphPartition", "partition_nodes"]

Method = Literal["metis", "rcb"]


def partition_nodes(
    edge_index: torch.Tensor,
    num_nodes: int,
    parts: int,
    *,
    method: Method = "metis",
    coordinates: torch.Tensor | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """The part of every node: balanced parts with few edges between them.

    Parameters
    ----------
    edge_index : Tensor
        ``(2, E)`` source and destination node of every edge.
    num_nodes : int
        N; nodes without edges still get a part.
    parts : int
        Number of parts P.
    method : {"metis", "rcb"}
        ``"metis"``: METIS k-way partitioning of the undirected graph (``pymetis``);
        ``"rcb"``: recursive coordinate bisection of ``coordinates``, the longest extent halved
        at the node count's proportional split, recursively (P need not be a power of 2).
    coordinates : Tensor, optional
        ``(N, d)`` node positions, for ``"rcb"``.
    seed : int
        METIS's random seed; the same seed gives the same partition.

    Returns
    -------
    Tensor
        ``(N,)`` int64 part in ``[0, P)`` of every node.
    """
    _check_edge_index(edge_index, num_nodes)
    if parts < 1:
        raise ValueError(f"cannot partition a graph into {parts} parts; expected parts >= 1")
    if parts == 1 or num_nodes == 0:
        return torch.zeros(num_nodes, dtype=torch.int64)
    if method == "metis":
        return _metis(edge_index, num_nodes, parts, seed)
    if method == "rcb":
        if coordinates is None or tuple(coordinates.shape[:1]) != (num_nodes,):
            shape = None if coordinates is None else tuple(coordinates.shape)
            raise ValueError(
                f"recursive coordinate bisection needs coordinates of shape ({num_nodes}, d), "
                f"got {shape}"
            )
        part = torch.empty(num_nodes, dtype=torch.int64)
        _bisect(coordinates.double(), torch.arange(num_nodes), 0, parts, part)
        return part
    raise ValueError(f"unknown partition method {method!r}; expected 'metis' or 'rcb'")


def _metis(edge_index: torch.Tensor, num_nodes: int, parts: int, seed: int) -> torch.Tensor:
    import pymetis

    src, dst = edge_index.cpu().numpy()
    keep = src != dst
    pairs = np.unique(
        np.concatenate([np.stack([src[keep], dst[keep]], 1), np.stack([dst[keep], src[keep]], 1)]),
        axis=0,
    )
    xadj = np.zeros(num_nodes + 1, dtype=np.int64)
    np.add.at(xadj, pairs[:, 0] + 1, 1)
    options = pymetis.Options(seed=seed)
    adjacency = pymetis.CSRAdjacency(np.cumsum(xadj), pairs[:, 1])
    _, membership = pymetis.part_graph(parts, adjacency, options=options)
    return torch.as_tensor(np.asarray(membership), dtype=torch.int64)


def _bisect(
    coordinates: torch.Tensor, nodes: torch.Tensor, first: int, parts: int, out: torch.Tensor
) -> None:
    if parts == 1:
        out[nodes] = first
        return
    points = coordinates[nodes]
    extent = points.amax(0) - points.amin(0) if len(nodes) else torch.zeros(points.shape[1])
    axis = int(torch.argmax(extent))
    order = nodes[torch.argsort(points[:, axis], stable=True)]
    left = parts // 2
    split = len(nodes) * left // parts
    _bisect(coordinates, order[:split], first, left, out)
    _bisect(coordinates, order[split:], first + left, parts - left, out)


def _check_edge_index(
    edge_index: torch.Tensor, num_nodes: int, covered_by: str | None = None
) -> None:
    if edge_index.ndim != 2 or edge_index.shape[0] != 2 or edge_index.is_floating_point():
        raise ValueError(
            f"edge_index must be an integer tensor of shape (2, E), got {edge_index.dtype} of "
            f"shape {tuple(edge_index.shape)}"
        )
    if edge_index.numel() and (edge_index.min() < 0 or edge_index.max() >= num_nodes):
        bad = int(edge_index[(edge_index < 0) | (edge_index >= num_nodes)][0])
        if covered_by is not None and bad >= 0:
            raise ValueError(
                f"{covered_by} does not cover every node: edge_index holds node {bad}, but "
                f"the partition gives parts to nodes [0, {num_nodes}) only"
            )
        raise ValueError(
            f"edge_index holds node {bad}, outside the graph's {num_nodes} nodes; expected "
            f"node ids in [0, {num_nodes})"
        )


@dataclass(frozen=True, eq=False)
class GraphPartition:
    """A graph numbered part by part: part ``k`` owns a contiguous range of nodes, and the edges
    whose destination it owns, also contiguous.

    Attributes
    ----------
    node_order : Tensor
        ``(N,)`` original id of the node at each new position.
    node_sizes : tuple of int
        Nodes owned by each part (any may be 0).
    edge_order : Tensor
        ``(E,)`` original position of the edge at each new position.
    edge_sizes : tuple of int
        Edges owned by each part: those ending at its nodes.
    edge_index : Tensor
        ``(2, E)`` edges in the new order, between new node ids.
    halo_counts : tuple of tuple of int
        ``halo_counts[r][k]``: distinct source nodes of part ``r``'s edges that part ``k``
        owns (0 on the diagonal), the rows a gather of source features brings part ``r`` from
        part ``k``.
    local_edge_index : Tensor
        ``(2, E)`` each edge's source and destination as positions in its part's *extended*
        rows ``[owned | halo]``, the halo ordered by new node id.
    send_rows : Tensor
        Part by part, the positions among its owned nodes of the rows the other parts
        receive from it, grouped by receiving part in order: part ``k``'s run has
        ``sum_r halo_counts[r][k]`` entries. With the two above, every part's halo plan
        (NOTE [A partitioned graph's halo plan comes from its partition] in ``_graph``).
    """

    node_order: torch.Tensor
    node_sizes: tuple[int, ...]
    edge_order: torch.Tensor
    edge_sizes: tuple[int, ...]
    edge_index: torch.Tensor
    halo_counts: tuple[tuple[int, ...], ...]
    local_edge_index: torch.Tensor
    send_rows: torch.Tensor

    @classmethod
    def build(
        cls,
        edge_index: torch.Tensor,
        parts: torch.Tensor,
        num_parts: int,
        *,
        num_nodes: int | None = None,
    ) -> GraphPartition:
        """Number a graph by ``parts``.

        Parameters
        ----------
        edge_index : Tensor
            ``(2, E)`` source and destination of every edge, original node ids.
        parts : Tensor
            ``(N,)`` the part of every node, in ``[0, num_parts)``.
        num_parts : int
            P, e.g. the ranks along the mesh axis that will hold the graph.
        num_nodes : int, optional
            N, checked against ``parts``; default ``len(parts)``.

        Raises
        ------
        ValueError
            If ``parts`` does not give every node one part in ``[0, num_parts)`` (too few or
            too many entries, a part outside the range, an edge at a node it does not cover)
            or ``edge_index`` is malformed. Every rank holds the same inputs, so every rank
            raises.
        """
        parts = torch.as_tensor(parts)
        _check_parts(parts, num_parts)
        if num_nodes is not None and parts.shape[0] != num_nodes:
            raise ValueError(
                f"the partition does not cover every node: parts gives {parts.shape[0]} "
                f"node(s) a part, the graph has {num_nodes}"
            )
        num_nodes = parts.shape[0]
        _check_edge_index(edge_index, num_nodes, covered_by="the partition")
        edge_index = edge_index.to(torch.int64).cpu()
        parts = parts.to(torch.int64).cpu()
        node_order = torch.argsort(parts, stable=True)
        new_id = torch.empty_like(node_order)
        new_id[node_order] = torch.arange(num_nodes)
        renumbered = new_id[edge_index]
        edge_order = torch.argsort(renumbered[1], stable=True)
        node_sizes = tuple(torch.bincount(parts, minlength=num_parts).tolist())
        edge_sizes = tuple(torch.bincount(parts[edge_index[1]], minlength=num_parts).tolist())
        edge_index = renumbered[:, edge_order]
        halo_counts, local_edge_index, send_rows = _halo_plans(edge_index, node_sizes, edge_sizes)
        return cls(
            node_order=node_order,
            node_sizes=node_sizes,
            edge_order=edge_order,
            edge_sizes=edge_sizes,
            edge_index=edge_index,
            halo_counts=halo_counts,
            local_edge_index=local_edge_index,
            send_rows=send_rows,
        )

    @property
    def num_nodes(self) -> int:
        return self.node_order.shape[0]

    @property
    def num_edges(self) -> int:
        return self.edge_order.shape[0]

    def node_range(self, part: int) -> slice:
        """New ids of the nodes part ``part`` owns."""
        start = sum(self.node_sizes[:part])
        return slice(start, start + self.node_sizes[part])

    def edge_range(self, part: int) -> slice:
        """New positions of the edges part ``part`` owns."""
        start = sum(self.edge_sizes[:part])
        return slice(start, start + self.edge_sizes[part])

    def halo_sizes(self) -> tuple[int, ...]:
        """Distinct remote source nodes of each part's edges: the rows a gather of source
        features must bring to it, the lower bound of a halo exchange."""
        return tuple(sum(row) for row in self.halo_counts)

    def send_range(self, part: int) -> slice:
        """Positions in :attr:`send_rows` of the rows part ``part`` sends."""
        sent = [sum(row[k] for row in self.halo_counts) for k in range(len(self.node_sizes))]
        start = sum(sent[:part])
        return slice(start, start + sent[part])


def _halo_plans(
    edge_index: torch.Tensor, node_sizes: tuple[int, ...], edge_sizes: tuple[int, ...]
) -> tuple[tuple[tuple[int, ...], ...], torch.Tensor, torch.Tensor]:
    """Every part's halo plan (``GraphPartition``'s ``halo_counts``, ``local_edge_index``
    and ``send_rows``) from the numbered edges, on the host, with no communication."""
    parts = len(node_sizes)
    starts = torch.tensor([0, *node_sizes]).cumsum(0)
    edge_starts = [sum(edge_sizes[:k]) for k in range(parts + 1)]
    halos, owners, counts, local = [], [], [], []
    for part in range(parts):
        src, dst = edge_index[:, edge_starts[part] : edge_starts[part + 1]]
        first, owned = int(starts[part]), node_sizes[part]
        mine = (src >= first) & (src < first + owned)
        halo = torch.unique(src[~mine])
        owner = torch.searchsorted(starts[1:], halo, right=True)
        halos.append(halo)
        owners.append(owner)
        counts.append(tuple(torch.bincount(owner, minlength=parts).tolist()))
        source = torch.where(mine, src - first, owned + torch.searchsorted(halo, src))
        local.append(torch.stack([source, dst - first]))
    sent = [
        halos[r][owners[r] == k] - starts[k] for k in range(parts) for r in range(parts) if r != k
    ]
    return (
        tuple(counts),
        torch.cat(local, 1),
        torch.cat(sent) if sent else edge_index.new_empty(0),
    )


def _check_parts(parts: torch.Tensor, num_parts: int) -> None:
    if parts.ndim != 1 or parts.is_floating_point():
        raise ValueError(
            f"parts must be an integer tensor (N,) giving every node's part, got {parts.dtype} "
            f"of shape {tuple(parts.shape)}"
        )
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    outside = (parts < 0) | (parts >= num_parts)
    if outside.any():
        node = int(outside.nonzero()[0, 0])
        raise ValueError(
            f"the partition does not cover every node: node {node} is in part "
            f"{int(parts[node])}, expected a part in [0, {num_parts})"
        )
