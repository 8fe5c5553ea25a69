"""Gathers and scatters along a sharded dim against the single-process reference, forward and
gradients, float64; the bytes a gather moves against the halo lower bound."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from shardsci import ShardTensor, gather_policy
from shardsci.tensor._api import from_local_spec
from shardsci.testing import (
    Layout,
    check_against_reference,
    counted_comm,
    get_mesh,
    run_on_ranks,
)

FEATURES = 3


@dataclass(frozen=True)
class Graph:
    """Nodes split over a mesh in ``node_sizes``; edges sorted by the rank owning their
    destination, split in ``edge_sizes``."""

    name: str
    mesh: tuple[int, ...]
    node_placements: tuple
    node_sizes: tuple[int, ...]
    edges: int

    @property
    def world(self) -> int:
        return int(torch.tensor(self.mesh).prod())

    @property
    def nodes(self) -> int:
        return sum(self.node_sizes)

    def __str__(self) -> str:
        return self.name

    def edge_index(self) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        """(src, dst, edge sizes): random edges, each rank's edges ending at nodes it owns."""
        generator = torch.Generator().manual_seed(7)
        src = torch.randint(0, self.nodes, (self.edges,), generator=generator)
        dst = torch.randint(0, self.nodes, (self.edges,), generator=generator)
        order = torch.argsort(dst, stable=True)
        src, dst = src[order], dst[order]
        owners = torch.searchsorted(torch.tensor(self.node_sizes).cumsum(0), dst, right=True)
        sizes = torch.bincount(owners, minlength=len(self.node_sizes))
        return src, dst, tuple(sizes.tolist())

    def node_layout(self) -> Layout:
        return Layout(self.node_placements, {0: self.node_sizes})

    def edge_layout(self, sizes: tuple[int, ...]) -> Layout:
        return Layout(self.node_placements, {0: sizes})


GRAPHS = [
    Graph("2r-9/4", (2,), (Shard(0),), (9, 4), 30),
    Graph("4r-5/0/7/3", (4,), (Shard(0),), (5, 0, 7, 3), 40),
    Graph("2x2-both-axes", (2, 2), (Shard(0), Shard(0)), (2, 6, 0, 5), 30),
    Graph("2x2-inner-axis", (2, 2), (Replicate(), Shard(0)), (4, 8), 25),
]


def _dst_expanded(dst: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    return dst.unsqueeze(-1).expand_as(e)


# name -> fn(x, e, src, dst); x (N, F) nodes, e (E, F) edge values, src/dst (E,) global ids
OPS = {
    "getitem_src": lambda x, e, src, dst: x[src] * e,
    "getitem_dst": lambda x, e, src, dst: x[dst] + x[src],
    "index_select": lambda x, e, src, dst: x.index_select(0, src).sin(),
    "gather": lambda x, e, src, dst: x.gather(0, _dst_expanded(src, e)),
    "index_add_remote": lambda x, e, src, dst: torch.zeros_like(x).index_add_(0, src, e),
    "index_add_alpha": lambda x, e, src, dst: torch.index_add(x, 0, src, e, alpha=2.0),
    "index_add_owned": lambda x, e, src, dst: x.index_add(0, dst, e * x[src]),
    "scatter_add": lambda x, e, src, dst: x.scatter_add(0, _dst_expanded(src, e), e),
    "sum_exclude_self": lambda x, e, src, dst: x.scatter_reduce(
        0, _dst_expanded(src, e), e, "sum", include_self=False
    ),
    "mean_remote": lambda x, e, src, dst: x.scatter_reduce(0, _dst_expanded(src, e), e, "mean"),
    "mean_exclude_self": lambda x, e, src, dst: torch.zeros_like(x).scatter_reduce_(
        0, _dst_expanded(src, e), e, "mean", include_self=False
    ),
    "amax_owned": lambda x, e, src, dst: x.scatter_reduce(
        0, _dst_expanded(dst, e), e * x[src], "amax", include_self=False
    ),
    "amax_in_place": lambda x, e, src, dst: torch.zeros_like(x).scatter_reduce_(
        0, _dst_expanded(dst, e), e * x[src], "amax", include_self=False
    ),
    "amax_remote": lambda x, e, src, dst: x.scatter_reduce(
        0, _dst_expanded(src, e), e, "amax", include_self=False
    ),
    "amin_remote_ties": lambda x, e, src, dst: x.round().scatter_reduce(
        0, _dst_expanded(src, e), e - e.detach() + e.detach().round().clamp(-1, 1), "amin"
    ),
    "amin_owned": lambda x, e, src, dst: x.scatter_reduce(0, _dst_expanded(dst, e), e, "amin"),
}


def _op_body(graph: Graph, name: str) -> None:
    mesh = get_mesh(graph.mesh)
    src, dst, edge_sizes = graph.edge_index()
    x = torch.randn(graph.nodes, FEATURES, dtype=torch.float64)
    e = torch.randn(len(src), FEATURES, dtype=torch.float64)
    edges = graph.edge_layout(edge_sizes)
    # A gather gives one row per edge, laid out like the edges; a scatter one per node.
    per_edge = len(src) != graph.nodes
    check_against_reference(
        OPS[name],
        [x, e, src, dst],
        [graph.node_layout(), edges, edges, edges],
        mesh,
        out_layouts=[lambda shape: edges if per_edge and shape[0] == len(src) else None],
        what=name,
    )


@pytest.mark.parametrize("graph", GRAPHS, ids=str)
@pytest.mark.parametrize("name", list(OPS))
def test_sharded_index(graph: Graph, name: str) -> None:
    run_on_ranks(graph.world, _op_body, graph, name)


# name -> fn(x, idx) with a plain (replicated) index
REPLICATED = {
    "getitem": lambda x, idx: x[idx] * 2,
    "getitem_negative": lambda x, idx: x[-idx - 1],
    "getitem_2d": lambda x, idx: x[idx.reshape(2, -1)],
    "index_select": lambda x, idx: x.index_select(0, idx),
    "index_select_dim1": lambda x, idx: x.t().index_select(1, idx).t().contiguous(),
    "gather": lambda x, idx: x.gather(0, idx[:, None].expand(-1, FEATURES)),
}


# name -> the rows a selection through a 1-D index reads, in order: its output is split by
# its entries' owners (NOTE [A selection through a replicated index is split by its entries'
# owners]); the others' outputs are replicated
SPLIT_BY_OWNERS = {
    "getitem": lambda idx, n: idx,
    "getitem_negative": lambda idx, n: n - idx - 1,
    "index_select": lambda idx, n: idx,
    "index_select_dim1": lambda idx, n: idx,
}


def _by_owners(graph: Graph, rows: torch.Tensor) -> Layout:
    """The nodes' layout with each rank holding as many entries as name its rows."""
    owners = torch.searchsorted(torch.tensor(graph.node_sizes).cumsum(0), rows, right=True)
    counts = torch.bincount(owners, minlength=len(graph.node_sizes))
    return Layout(graph.node_placements, {0: tuple(counts.tolist())})


def _replicated_body(graph: Graph, name: str) -> None:
    mesh = get_mesh(graph.mesh)
    x = torch.randn(graph.nodes, FEATURES, dtype=torch.float64)
    idx = torch.tensor([0, graph.nodes - 1, 3, 3, 1, graph.nodes - 2])
    # A 2-D index or a gather gives a replicated output: a replicated read, which the guard
    # counts (NOTE [Gathers an op was not asked to make]); a 1-D selection fetches rows only.
    rows = SPLIT_BY_OWNERS.get(name)
    expected = (
        Layout((Replicate(),) * len(graph.mesh)) if rows is None
        else _by_owners(graph, rows(idx, graph.nodes))
    )  # fmt: skip
    with gather_policy("allow" if rows is None else "error"):
        check_against_reference(
            REPLICATED[name],
            [x, idx],
            [graph.node_layout(), None],
            mesh,
            out_layouts=[expected],
            what=name,
        )


@pytest.mark.parametrize("name", list(REPLICATED))
def test_replicated_index(name: str) -> None:
    graph = GRAPHS[1]
    run_on_ranks(graph.world, _replicated_body, graph, name)


# ---------------------------------------------------------------------------- bytes
def _bytes_body(graph: Graph) -> dict[str, int]:
    mesh = get_mesh(graph.mesh)
    src, _, edge_sizes = graph.edge_index()
    x_whole = torch.randn(graph.nodes, FEATURES, dtype=torch.float64)
    x_spec = graph.node_layout().spec(mesh, x_whole)
    src_spec = graph.edge_layout(edge_sizes).spec(mesh, src)
    x = from_local_spec(x_spec.narrow(x_whole).clone().requires_grad_(), x_spec)
    index = from_local_spec(src_spec.narrow(src), src_spec)
    x[index]  # builds and caches the plan
    with counted_comm("gather") as stats:
        y = x[index]
        y.to_local().sum().backward()
    return {
        "gather": stats.received["gather"],
        "scatter": stats.sent["scatter"],
        "plan": stats.calls["gather_plan"],
        "calls": stats.calls["gather"],
    }


def _halo_lower_bound(graph: Graph, rank: int) -> int:
    """Bytes of the distinct remote rows rank ``rank``'s edges read, computed from the whole
    graph independently of the plan."""
    src, _, edge_sizes = graph.edge_index()
    flat = rank if graph.node_placements[0] == Shard(0) else rank % graph.mesh[-1]
    start = sum(edge_sizes[:flat])
    mine = src[start : start + edge_sizes[flat]]
    lo = sum(graph.node_sizes[:flat])
    hi = lo + graph.node_sizes[flat]
    remote = torch.unique(mine[(mine < lo) | (mine >= hi)])
    return remote.numel() * FEATURES * 8


@pytest.mark.parametrize("graph", GRAPHS[:3], ids=str)
def test_gather_moves_the_halo_lower_bound(graph: Graph) -> None:
    results = run_on_ranks(graph.world, _bytes_body, graph)
    for rank, got in enumerate(results):
        bound = _halo_lower_bound(graph, rank)
        assert got["gather"] == bound, (rank, got, bound)
        assert got["plan"] == 0, "the plan is built once per index and reused"
        assert got["calls"] == (1 if any(r["gather"] for r in results) else 0)
    assert sum(r["scatter"] for r in results) == sum(r["gather"] for r in results)


def _bad_index_body(value: int) -> None:
    mesh = get_mesh((2,))
    rank = dist.get_rank()
    x = ShardTensor.from_local(torch.ones(3 + rank, 2), mesh, [Shard(0)], {0: (3, 4)})
    local = torch.tensor([0, 1, value]) if rank == 1 else torch.tensor([0, 6])
    index = ShardTensor.from_local(local, mesh, [Shard(0)], {0: (2, 3)})
    try:
        x[index]
    except IndexError as error:
        return str(error)
    return "no error"


def test_out_of_range_index_raises_on_every_rank() -> None:
    messages = run_on_ranks(2, _bad_index_body, 7)
    for message in messages:
        assert "index value 7 on rank 1 of the group is out of range for a dim of size 7" in message


def _empty_rank_views_body() -> None:
    """On a rank whose shard is empty, a view (``edge_index[0]``) is still a view of its base:
    gather plans are cached per storage, and a fresh tensor on that rank alone would rebuild
    the plan there, a collective no other rank joins."""
    mesh = get_mesh((2,))
    edge_index = torch.tensor([[0, 1, 2], [1, 2, 0]])
    edges = ShardTensor.from_local(
        edge_index[:, :3] if dist.get_rank() == 0 else edge_index[:, :0], mesh, [Shard(1)]
    )
    src = edges[0]
    same_storage = src.local.untyped_storage()._cdata == edges.local.untyped_storage()._cdata
    assert same_storage, "the view is a new tensor"
    nodes = ShardTensor.from_local(
        torch.randn(2 if dist.get_rank() == 0 else 1, FEATURES), mesh, [Shard(0)]
    )
    for _ in range(3):  # every call after the first hits the plan built with the first
        nodes[edges[0]].to_local().sum()


def test_a_view_of_an_empty_shard_keeps_its_base() -> None:
    run_on_ranks(2, _empty_rank_views_body)
