"""Weak and strong scaling of every zoo model's training step on up to 512 GPUs, projected from
one measured small step per model.

# NOTE [The cost model]
Measured here, per model, on real gloo ranks (``measure``), exchanges issued as the target
machine's backend issues them (NOTE [Measured as the target issues it]): one training step
(forward, a mean-square loss, backward, gradients reduced by ``domain_parallel``) at several
small local shapes, its traffic counted by ``shardsci.testing.count_traffic`` per collective kind (calls,
bytes received by the busiest rank, rounds of point-to-point messages), and the gradient
all-reduces apart (the step's traffic beyond the same step under ``no_sync()``). Each kind's
bytes are fitted over the shapes as a linear function of the model's size basis (``basis``: a
field's local rows, columns and their product; a graph's square root of nodes per rank, and
nodes), which holds faces (halos), volumes (attention keys and values), spectra truncated along
one dim (the FNO's transposes) and constants (statistics, the loss) alike; the fit must
reproduce every measured shape (``FIT_TOLERANCE``). FLOPs are counted as the dry run counts
them (``shardsci.planning._work.WorkCounter``) on the plain model at three sizes, fitted as a
polynomial in the pixel (or node) count, so that global attention's quadratic term is kept;
so are the step's memory traffic (every non-view op's tensor arguments and results: kernels
unfused) and that of its ops without FLOPs. FFTs' FLOPs are counted apart (NOTE [FFT FLOPs are
counted apart]) and fitted as ``a p log2 p`` of the whole field, which a distributed FFT shares
evenly over the ranks. The runs of the step's strided copies (``WorkCounter.strided_runs``,
NOTE [Strided copies]) are fitted over the size basis. Compute is all of these priced by
``compute_s``, the dry run's own pricing (NOTE [One price per op], NOTE [Kernels without
FLOPs]). Host time per step is the aten ops the
ShardTensor step dispatches (NOTE [Ops per peer]), priced as the dry run prices them
(``ops_host_s``, NOTE [One price per op]), plus what issuing each
collective call and halo round costs the host's CPU (``collective_host_s``: per call, per
ring step and per byte received; an all-to-all per call and per other rank of its group, NOTE
[What an all-to-all posts]: a halo gloo sends as one all-to-all).

Projected (``project``) on ``Machine`` (every parameter with its source; ``--set
name=value`` overrides any), per rank: ``max(host, compute + communication)``, host time
assumed to overlap the device's work (kernels launched ahead), so the projection is optimistic
where the host stalls on a collective; ``host + compute + communication`` on a machine whose
host does not overlap its device (``host_overlaps_device``: a CPU, NOTE [Calibrating the
machine] in ``benchmarks/calibrate.py``). Communication, every kind on the critical path:

- halos (point-to-point rounds, ``p2p``): each round one message latency plus its bytes;
- all-reduces (statistics, the loss): the cheaper of ring and tree (NCCL's latency model);
- reduce-scatters: rings, ``P - 1`` steps, ``(P - 1) x piece`` bytes;
- all-to-alls (the FNO's transposes) and all-gathers (statistics, the FNO's spectral weights'
  gradients, keys and values): one kind, ``P - 1`` messages of the bytes received. The library
  issues a gather whose pieces do not divide evenly over ``P`` (12 kept modes over 8 ranks) as
  an all-to-all, so the kind torch's collective takes depends on ``P``: a law fitted per
  collective at ``P`` where the pieces divide (2, 4) mislabels the gathers at ``P`` where they
  do not (the FNO's held-out 8-rank step: its spectral weights' gradient gathers, 7.9 MB, came
  as all-to-alls);
- gradients: one all-reduce of every parameter's bytes (not overlapped with the backward:
  conservative).

Bytes at ``P`` ranks follow from bytes at the measured ``P_m``: an all-reduce's buffer is
``received x P_m / (2 (P_m - 1))``, an all-to-all's volume ``received x P_m / (P_m - 1)``. Attention over a sharded sequence (the ViT)
is measured both as an all-gather and as a ring; at ``P`` the library's rule (NOTE [Ring or
all-gather]: the gathered keys and values above ``gather_limit_bytes``) picks which is costed.
A link inside a node is NVLink; from ``2 x gpus_per_node`` ranks on, some neighbour of every
rank is on another node (InfiniBand).

Decompositions: the UNet in 2-D blocks of ``t x t`` (measured on 2x2, 2x4 and 4x2); the FNO, ViT and
Transolver in slabs along H (measured on 2 ranks; at ``P`` ranks a square field of
``N = t sqrt(P)`` has ``N / P`` rows per rank); the MeshGraphNet in METIS parts of ``n``
nodes of a 2-D Delaunay mesh (measured on 2 ranks). Weak-scaling efficiency at ``P``: the
step's compute over its projected time (the model's work per rank over what the step costs);
strong: ``P_0 T(P_0) / (P T(P))`` from ``P_0 = 8``.

Goals (issue 22): weak-scaling efficiency at least 0.9 at 512 GPUs at each model's
recommended tile (``RECOMMENDED``). Run ``python -m benchmarks.cost_model [--models unet fno]
[--set host_us_per_op=0 plain_host_us_per_op=0] [--check]`` (≈2 min here); JSON lines on stdout, fields in README.md.

# NOTE [Measured as the target issues it]
How a halo exchange is issued depends on the backend (NOTE [An exchange of messages as one
all-to-all where messages are slow] in ``shardsci/tensor/_collectives.py``): gloo, which these
measurements run on, sends each as one all-to-all over its axis's group, NCCL as messages to
the neighbours. Measured as gloo issues it and projected onto H100s, every halo was priced as
an all-to-all over its axis (``P - 1`` peers at ``P`` ranks) and the ops were fitted on no
messages: the UNet's weak efficiency at 512 GPUs read 0.007 with 27,226 ops a step
(2026-11-29, after halo20), against 0.034 with 3,828 before. So ``measure`` runs inside
``issued_as(machine.backend)``: for an H100 cluster the halos go as messages on these gloo
ranks, as they will on NCCL; for this machine (``calibrate_steps``, ``gloo_cpu``) as
all-to-alls. A saved measurement records its backend (``measurements`` refuses another).

# NOTE [Ops per peer]
A step's aten ops may grow with its ranks: a collective over ``P`` ranks that packs and
unpacks a piece per peer (a slice, a view, a copy into the send buffer, the same on receipt)
costs a few ops per peer. Until 2026-11-28 every redistribution did: the FNO at 128²
dispatched 513 aten ops on 1 rank, 982-988 on 2 and 1,482-1,488 on 4 (250 more per added
peer, from its 21 all-to-alls and gathers; its dry run at 512 ranks counted about 113,000).
Redistributions now pack and unpack once (NOTE [One pack and one unpack per collective] in
``shardsci/tensor/_box_packing.py``): the same step dispatches 509 / 1,007 / 1,047 / 1,042 ops
on 1 / 2 / 4 / 8 ranks (``step_profile``, 2026-11-28 15:08 UTC, load 12.8), the 2 -> 4 step
being an index and an index op per exchange once a rank's own piece lies between its peers';
this module's own runs count 1,010 (2 ranks) and 1,058 (4), which a law fitted on 2 and 4 ranks
extrapolated as ``986 + 24 (P - 1)`` (13,250 at 512 ranks, an overestimate: nothing grows from
4 to 8). The ops are therefore also counted at 8 ranks (``Geometry.op_meshes``) and the law was
fitted at the two largest rank counts, where a rank already has peers on both sides: on
2026-11-29 (03:46 UTC) 955 / 987 / 991 ops on 2 / 4 / 8 ranks gave ``984 + 1 (P - 1)`` (1,495
at 512 ranks) where the 2- and 4-rank fit gave ``939 + 16 (P - 1)`` (9,115). Collectives
outside redistribution (graph gathers, scans, rings) still pack per peer that sends or receives
something: the UNet's halos and the MeshGraphNet's graph exchanges grow with a rank's
neighbours (3,333 ops on 2x2 ranks, 3,696 on 2x4, 2026-11-29 04:34 UTC; 1,659 and 1,838 on 2
and 4 parts of 100 nodes, 19:40 UTC), which this
law extrapolates as if they grew with ``P``. So the UNet's ops are also counted on 4x4 blocks:
3,269 / 3,632 / 4,026 ops on 2x2 / 2x4 / 4x4 (2026-11-29 04:34 UTC) grow by 91 per added peer
from 4 to 8 ranks and by 49 from 8 to 16, and a law fitted at 4 and 8 ranks put 51,338 ops in
a step at 512 ranks where one fitted at 8 and 16 puts about 28,000 (still an overestimate
while a rank's neighbours are bounded and its statistics, all-gathered at 16 ranks here, are
all-reduced at 512). The MeshGraphNet's are counted on 16 parts too, since a METIS part of a
2-D mesh has a bounded number of neighbours: 2,127 / 2,174 ops on 8 / 16 parts of 100 nodes,
both with 6 peers, where 4 parts had 3 (2026-11-29 19:40 UTC, as NCCL issues them,
``benchmarks/records/2026-11-29-cost-model-remeasured/mgn_ops.json``; at 04:41, before main's
host cuts, 2,932 / 2,979): 2,148 ops at 512 ranks by the law below (5,893 by the law of 04:41,
42,286 by one that grew with every rank).
The ops, and those of them the communication modules dispatch
(``WorkCounter.communication_ops``), are therefore fitted as ``fixed + a messages + b peers``
(``op_laws``) over the runs of more than 2 ranks (at 2 a rank has one side: the FNO's index op
per exchange is missing there), where ``messages`` are the step's point-to-point messages
(bounded by a rank's neighbours: NOTE [A rank's messages are bounded by its neighbours]) and
``peers`` the ranks its all-to-alls and all-gathers hand a piece to (``pieces_from``, from
``count_traffic``'s spans): every other rank for a transpose or a gather, a bounded
neighbourhood for a graph part's exchange (``Fitted.peers_bound``: the most measured, where
some run's pieces skipped a rank). A term the runs do not vary is folded into the constant.
Per collective the packing is once (statistics are all-gathered into one tensor, or
all-reduced), so ``b`` is what is left per peer: the UNet's step, 3,170 / 3,500 / 3,498 /
3,828 ops on 2x2 / 2x4 / 4x2 / 4x4 blocks with 132 / 198 / 198 / 264 messages (2026-11-29
06:20 UTC), is 2,510 + 5.0 per message, nothing per peer, and 3,828 at 512 ranks (16x32, 264
messages) where ``fixed + per_peer (P - 1)`` fitted at 8 and 16 ranks put 24,226, and the
halo messages' law of calls 8,514 messages. Both laws
are data, measured by every run, so a change to the library's collectives moves them;
``ops_host_s`` prices them (NOTE [One price per op]): the communication ops at
``host_us_per_communication_op``.

Neither law holds on one rank: a one-rank mesh has no neighbour and no peer, issues no
collective, and its communication modules dispatch nothing, but the laws' constants hold the
ops each collective packs once whatever its group (2026-11-30, calib3: the UNet's law, fitted
on 4-16 ranks, put 3,035 ops in its 1-rank step, 1,579 of them communication ops, where the
step dispatches 1,352 and none, ``benchmarks/records/2026-11-30-predicted-vs-measured``;
priced 63 ms of host time, about 25 at the real counts). So every model's ops are also
counted on a one-rank mesh (``measure_model``: an ``ops_only`` run of ``ranks`` 1, kept out of
the laws' fit) and ``Fitted.op_count(1)`` is that count (``ops_on_one_rank``), with no
communication op; where a measurement lacks it (saved before 2026-11-30 08:00 UTC), the
laws' ops less their communication ops (1,456 for that UNet).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from benchmarks._common import (
    Goal,
    emit,
    emit_summary,
    least_squares,
    on_ranks,
    parse_arguments,
    rank_pools,
    step_traffic,
)
from benchmarks.compile import CASES, _mesh_graph
from shardsci import Shard, ShardTensor, attention_exchange
from shardsci.graph import GraphPartition, partition_nodes
from shardsci.parallel import domain_parallel
from shardsci.planning._machine import (
    DISPATCH_PATHS,
    Machine,
    all_gather_s,
    all_reduce_s,
    collective_host_s,
    collective_s,
    compute_s,
    ops_host_s,
    override,
    span_nodes,
)
from shardsci.planning._work import FLOP_FREE_FAMILIES, WorkCounter
from shardsci.tensor._collectives import issued_as
from shardsci.tensor._options import (
    attention_exchange_choice,
    normalization_statistics,
    statistics_all_reduced,
)
from shardsci.testing import Span, Traffic, count_traffic, get_mesh

GPUS = (8, 16, 32, 64, 128, 256, 512)
FIT_TOLERANCE = 0.02  # of the largest measured bytes of a kind
WEAK_GOAL = 0.9
STRONG_FLOOR = 0.5


# --------------------------------------------------------------------------- the models
@dataclass(frozen=True)
class Geometry:
    """How a model is split: the ``meshes`` and local ``shapes`` it is measured at, the size
    ``basis`` its bytes are fitted on, the local shape at ``P`` ranks for weak scaling at a
    tile ``t`` (``weak(P, t)``) and strong scaling of a whole field ``N`` (``strong(P, N)``),
    the ``pixels`` (or nodes) of a local shape, and the ``grid`` of ranks at ``P`` (one size
    per mesh axis, ``AXES`` named), which prices a collective over some of the axes (NOTE
    [Collectives over one axis])."""

    meshes: tuple[tuple[int, ...], ...]
    shapes: tuple[tuple[int, ...], ...]
    basis: Callable[[tuple[float, ...]], list[float]]
    weak: Callable[[int, float], tuple[float, ...]]
    strong: Callable[[int, float], tuple[float, ...]]
    pixels: Callable[[tuple[float, ...]], float]
    grid: Callable[[int], tuple[int, ...]] = lambda p: (p,)
    op_meshes: tuple[tuple[int, ...], ...] = ()
    """Meshes beyond ``meshes`` where only the step's aten ops are counted (at the first of
    ``shapes``): the ops' growth with the messages and the peers is fitted on the runs of
    more than 2 ranks (NOTE [Ops per peer])."""


AXES = ("h", "w")
"""The names of the domain's mesh axes, outermost first."""


def _block_grid(ranks: int) -> tuple[int, int]:
    """The rows and columns of a block of ``ranks``: as square as powers of 2 allow (2x4
    for 8)."""
    rows = 2 ** (int(math.log2(ranks)) // 2)
    return rows, ranks // rows


def _field_basis(shape: tuple[float, ...]) -> list[float]:
    rows, cols = shape
    return [1.0, rows, cols, rows * cols]


def _graph_basis(shape: tuple[float, ...]) -> list[float]:
    (nodes,) = shape
    return [1.0, math.sqrt(nodes), nodes]


_SLAB = Geometry(
    meshes=((2,), (4,)),
    shapes=((16, 32), (32, 32), (16, 64), (32, 64)),
    basis=_field_basis,
    weak=lambda p, t: (t / math.sqrt(p), t * math.sqrt(p)),
    strong=lambda p, n: (n / p, n),
    pixels=lambda s: s[0] * s[1],
    op_meshes=((8,),),
)
_BLOCK = Geometry(
    meshes=((2, 2), (2, 4), (4, 2)),  # each axis at two sizes: NOTE [Collectives over one axis]
    shapes=((16, 16), (32, 16), (16, 32), (32, 32)),
    basis=_field_basis,
    weak=lambda p, t: (t, t),
    strong=lambda p, n: (n / math.sqrt(p), n / math.sqrt(p)),
    pixels=lambda s: s[0] * s[1],
    grid=_block_grid,
    op_meshes=((4, 4),),
)
_GRAPH = Geometry(
    meshes=((2,), (4,)),
    shapes=((100,), (400,), (1600,)),
    basis=_graph_basis,
    weak=lambda p, t: (t,),
    strong=lambda p, n: (n / p,),
    pixels=lambda s: s[0],
    op_meshes=((8,), (16,)),
)
GEOMETRY = {
    "unet": _BLOCK,
    "fno": _SLAB,
    "vit": _SLAB,
    "transolver": _SLAB,
    "meshgraphnet": _GRAPH,
}
# The tile per GPU the goal is stated at (H = W, or nodes) and the largest field of the strong
# scaling projection (H = W, or nodes).
RECOMMENDED = {"unet": 512, "fno": 512, "vit": 512, "transolver": 512, "meshgraphnet": 100_000}
LARGEST = {"unet": 8192, "fno": 8192, "vit": 8192, "transolver": 8192, "meshgraphnet": 50_000_000}
GRAPH_BATCH = 1
P2P = ("p2p", "p2p_rounds")
PIECEWISE = ("all_to_all", "all_gather")
"""The collectives that hand each peer its own piece (NOTE [Ops per peer])."""


def laws(kind: str, ranks: int) -> list[float]:
    """How a kind's bytes grow with the ranks ``P`` of its group: a collective's with ``P - 1``
    (a piece per rank: statistics, keys and values) or ``(P - 1) / P`` (a fixed whole: an
    all-reduced buffer, a transposed volume); messages' stay fixed (halos) or grow with
    ``P - 1`` (a ring)."""
    if kind in P2P:
        return [1.0, ranks - 1.0]
    return [ranks - 1.0, (ranks - 1.0) / ranks]


# NOTE [Collectives over one axis]
# A collective over one axis of a block (a row's all-reduce, a transpose within a column)
# connects that axis's ranks, not the whole domain's (NOTE [The span of a collective] in
# ``shardsci/testing/_traffic.py``). ``measure`` labels each collective by the mesh axes its
# ranks differ along (``kind@h``, ``kind@w``; the bare kind where it spans the whole domain, or
# is a message), each label's calls and bytes are fitted over the size of its own group at the
# measured mesh (``group_size``), and projected at ``P`` over the group of rank 0 along those
# axes of ``Geometry.grid(P)``, its nodes counted as the ranks lie (``span_nodes``): a block's
# row on one node, its column across nodes once a row fills one.
def kind_of(label: str) -> str:
    """The collective kind of a label: ``"all_reduce@h"`` -> ``"all_reduce"``."""
    return label.partition("@")[0]


def group_size(label: str, mesh_shape: tuple[int, ...]) -> int:
    """Ranks of one ``label``'s group on a domain mesh of ``mesh_shape`` (axes ``AXES``)."""
    axes = label.partition("@")[2]
    sizes = dict(zip(AXES, mesh_shape))
    return math.prod(sizes[a] for a in axes.split("+")) if axes else math.prod(mesh_shape)


def projected_group(machine: Machine, name: str, label: str, ranks: int) -> tuple[int, int | None]:
    """Ranks and nodes of one ``label``'s group at ``ranks`` ranks of model ``name``: that of
    rank 0 along the label's axes of its grid; nodes ``None`` (consecutive ranks) for the whole
    domain."""
    axes = label.partition("@")[2]
    if not axes:
        return ranks, None
    grid = GEOMETRY[name].grid(ranks)
    index = tuple(slice(None) if a in axes.split("+") else 0 for a in AXES[: len(grid)])
    members = torch.arange(ranks).view(grid)[index].flatten().tolist()
    return len(members), span_nodes(machine, members)


def span_label(span: Span, mesh: DeviceMesh, domain_axes: tuple[str, ...]) -> str:
    """``span``'s kind, with ``@`` and the ``domain_axes`` of ``mesh`` its ranks differ along
    where those are not all of them (a message keeps its kind: halos are priced as rounds)."""
    if span.kind in P2P:
        return span.kind
    coordinates = [(mesh.mesh == rank).nonzero()[0].tolist() for rank in span.ranks]
    names = mesh.mesh_dim_names
    varying = [names[a] for a in range(mesh.ndim) if len({c[a] for c in coordinates}) > 1]
    inside = [a for a in domain_axes if a in varying]
    return span.kind if len(inside) == len(domain_axes) else f"{span.kind}@{'+'.join(inside)}"


def call_laws(ranks: int) -> list[float]:
    """How a kind's calls (or rounds of messages) grow with ``P``: fixed, or ``P - 1`` (a
    ring's rounds)."""
    return [1.0, ranks - 1.0]


# NOTE [A rank's messages are bounded by its neighbours]
# A halo round sends to and receives from the rank's neighbours along each split dim: one
# at an end of that dim, two inside it, never more (corners travel in the second dim's round).
# The UNet's step (2026-11-29 06:20 UTC,
# ``benchmarks/records/2026-11-29-cost-model/ops_unet_before.jsonl``) sends 66, 132, 132
# messages on 2, 4, 8 slabs and 132, 198, 198, 264 on 2x2, 2x4, 4x2, 4x4 blocks: 33
# halo rounds a split dim, 2 messages (a send and a receive) per neighbour. A ring's messages
# do grow with ``P``: ``P - 1`` rounds of one send and one receive. So a step's messages are
# fitted as ``a neighbours + b (P - 1)`` (``message_laws``), not as calls are: the law
# ``c + d (P - 1)`` of the calls, fitted on 2x2 and 2x4, put 8,514 halo messages in the
# UNet's step at 512 ranks, where a rank of a 16x32 block sends 264.
def neighbours(grid: tuple[int, ...]) -> int:
    """The ranks a rank inside a ``grid`` of ranks exchanges halos with: two along each split
    dim of three or more ranks, one along a dim of two."""
    return sum(min(size - 1, 2) for size in grid)


def message_laws(grid: tuple[int, ...]) -> list[float]:
    """How a step's point-to-point messages grow on a ``grid`` of ranks: with the neighbours
    (halos), or with ``P - 1`` (a ring's rounds; NOTE [A rank's messages are bounded by its
    neighbours])."""
    return [float(neighbours(grid)), math.prod(grid) - 1.0]


def count_laws(label: str, mesh_shape: tuple[int, ...]) -> list[float]:
    """The law of ``label``'s calls on a domain mesh of ``mesh_shape``: ``message_laws`` for
    messages (which span the whole domain), ``call_laws`` over the label's group else."""
    if label == "p2p":
        return message_laws(mesh_shape)
    return call_laws(group_size(label, mesh_shape))


# --------------------------------------------------------------------------- measurement
def _graph_inputs(nodes_per_rank: int, mesh) -> tuple:
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(0)
    points = nodes_per_rank * world
    positions, edge_index = _mesh_graph(points)
    nodes = torch.randn(points, GRAPH_BATCH, 3, generator=generator)
    edges = torch.randn(edge_index.shape[1], GRAPH_BATCH, 3, generator=generator)
    parts = partition_nodes(edge_index, points, world, method="metis", coordinates=positions)
    partition = GraphPartition.build(edge_index, parts, world)
    node_start = sum(partition.node_sizes[:rank])
    edge_start = sum(partition.edge_sizes[:rank])
    node_rows = slice(node_start, node_start + partition.node_sizes[rank])
    edge_rows = slice(edge_start, edge_start + partition.edge_sizes[rank])
    return tuple(
        ShardTensor.from_local(t.contiguous(), mesh, [Shard(dim)], {0: sizes})
        for t, dim, sizes in (
            (nodes[partition.node_order][node_rows], 0, partition.node_sizes),
            (edges[partition.edge_order][edge_rows], 0, partition.edge_sizes),
            (partition.edge_index[:, edge_rows], 1, partition.edge_sizes),
        )
    )


def _field_inputs(shape: tuple[int, ...], mesh) -> tuple:
    """``(1, 1, rows x mesh rows, cols x mesh cols)``, split into ``shape`` blocks."""
    grid = tuple(mesh.shape) + (1,) * (2 - mesh.ndim)
    rows, cols = shape
    whole = torch.randn(
        1, 1, rows * grid[0], cols * grid[1], generator=torch.Generator().manual_seed(0)
    )
    i, j = (*mesh.get_coordinate(), 0)[:2]
    local = whole[:, :, i * rows : (i + 1) * rows, j * cols : (j + 1) * cols].contiguous()
    placements = [Shard(2), Shard(3)][: mesh.ndim]
    layout = {0: (rows,) * grid[0], 1: (cols,) * grid[1]}
    return (
        ShardTensor.from_local(local, mesh, placements, {k: layout[k] for k in range(mesh.ndim)}),
    )


def sharded_step(
    name: str, mesh_shape: tuple[int, ...], shape: tuple[int, ...]
) -> tuple[torch.nn.Module, Callable[[], None]]:
    """Rank body: the zoo model ``name`` under ``domain_parallel`` on a ``(1, *mesh_shape)``
    mesh ``(dp, h[, w])`` and its training step (forward, a mean-square loss, backward,
    gradients reduced) at this rank's local ``shape``."""
    torch.set_num_threads(1)
    axes = AXES[: len(mesh_shape)]
    full = get_mesh((1, *mesh_shape), ("dp", *axes))
    torch.manual_seed(0)
    model = domain_parallel(CASES[name].build(), full, dp_axis="dp", domain_axes=list(axes))
    mesh = full[axes] if len(axes) > 1 else full[axes[0]]
    args = _graph_inputs(shape[0], mesh) if name == "meshgraphnet" else _field_inputs(shape, mesh)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        out = model(*args)
        loss = (out * out).mean()
        (loss.full_tensor() if isinstance(loss, ShardTensor) else loss).backward()

    return model, step


def measure(
    name: str, mesh_shape: tuple[int, ...], shape: tuple[int, ...], exchange: str, backend: str
) -> dict:
    """Rank body: one step's traffic at this local ``shape`` by kind (``count_traffic``;
    ``gradient_all_reduce``: what the step issues beyond the same step under ``no_sync()``),
    attention exchanged by ``exchange``, exchanges issued as ``backend`` issues them (NOTE
    [Measured as the target issues it]), and the ops the step dispatches."""
    with issued_as(backend):
        return _measure(name, mesh_shape, shape, exchange)


def _measure(name: str, mesh_shape: tuple[int, ...], shape: tuple[int, ...], exchange: str) -> dict:
    model, step = sharded_step(name, mesh_shape, shape)
    axes = AXES[: len(mesh_shape)]
    mesh = get_mesh((1, *mesh_shape), ("dp", *axes))
    with attention_exchange(exchange):
        step()
        calls, received = step_traffic(step, model, lambda span: span_label(span, mesh, axes))
        with WorkCounter() as counter:
            step()
        with count_traffic() as traffic:
            step()
    calls, received = _gathers_as_all_to_alls(calls), _gathers_as_all_to_alls(received)
    return {
        "calls": dict(calls),
        "received": dict(received),
        "peers": len(pieces_from(traffic) - {dist.get_rank()}),
        "ops": counter.ops,
        "communication_ops": counter.communication_ops,
        "dispatch_calls": counter.dispatch_calls,
        "strided_runs": counter.strided_runs,
    }


def pieces_from(traffic: Traffic) -> set[int]:
    """The ranks this rank's all-to-alls and all-gathers move a piece to or from, itself
    included (an all-to-all's span names only the ranks whose pieces are not empty: NOTE
    [The span of a collective]): a graph part's neighbours, or the whole group."""
    return {r for span in traffic.calls_by_span if span.kind in PIECEWISE for r in span.ranks}


def _gathers_as_all_to_alls(by_label: dict[str, int]) -> Counter:
    """``by_label`` with the all-gathers counted as all-to-alls over the same axes (NOTE [The
    cost model]: torch issues a gather of pieces that do not divide evenly as an all-to-all,
    so which of the two one gather is counted under depends on ``P``)."""
    merged = Counter()
    for label, value in by_label.items():
        kind, at, axes = label.partition("@")
        merged[("all_to_all" if kind == "all_gather" else kind) + at + axes] += value
    return merged


def work(name: str, size: int) -> tuple[float, float, float, float, float]:
    """FLOPs, FFT FLOPs, complex matmul FLOPs, memory traffic and that of the ops without FLOPs
    (``WorkCounter``) of one plain training step at ``size``: H = W of a ``(1, 1, H, W)``
    field, or a graph's nodes."""
    counter = counted_step(name, size)
    return (
        float(counter.flops),
        float(counter.fft_flops),
        float(counter.complex_matmul_flops),
        float(counter.memory_bytes),
        float(counter.flop_free_bytes),
    )


def counted_step(name: str, size: int) -> WorkCounter:
    """The ``WorkCounter`` of one plain training step of ``name`` at ``size`` (``work``)."""
    torch.manual_seed(0)
    model = CASES[name].build()
    if name == "meshgraphnet":
        _, edge_index = _mesh_graph(size)
        args: tuple = (
            torch.randn(size, GRAPH_BATCH, 3),
            torch.randn(edge_index.shape[1], GRAPH_BATCH, 3),
            edge_index,
        )
    else:
        args = (torch.randn(1, 1, size, size),)
    with WorkCounter() as counter:
        out = model(*args)
        (out * out).mean().backward()
    return counter


FLOP_SIZES = {"meshgraphnet": (200, 400, 800), "field": (32, 64, 128)}


def _kron(a: list[float], b: list[float]) -> list[float]:
    return [x * y for x in a for y in b]


@dataclass
class Fitted:
    """One model's step, measured and fitted (NOTE [The cost model]): per kind, ``calls``
    (coefficients of ``call_laws``) and ``received`` bytes (of ``basis ⊗ laws``) of the busiest
    rank; FLOPs, memory traffic and that of the ops without FLOPs (``flop_free_memory``, NOTE
    [Kernels without FLOPs]) ``c + a p + b p²`` of a whole field of ``p`` pixels (nodes); FFT
    FLOPs ``a p log2 p`` (``fft_flops``: ``[a]``); complex matmul FLOPs ``c + a p``
    (``complex_matmul_flops``: ``[c, a]``; NOTE [Complex matmuls are counted apart]), all
    of them shared by the ranks (an FNO's retained modes split as its field); the aten ops of the
    ShardTensor step and those of them its communication modules dispatch (``ops`` and
    ``communication_ops``: coefficients of ``call_laws``, NOTE [Ops per peer]); the runs of
    its strided copies (``strided_runs``: coefficients of ``basis``, NOTE [Strided copies]);
    ``peers_bound``: the most peers a rank's pieces go to, ``None`` where they go to every
    rank (NOTE [Ops per peer]); ``dispatch_calls``: per dispatch path, coefficients of
    ``op_laws`` for its ShardTensor calls (NOTE [Host time by dispatch path]), ``None`` where
    the runs did not count them (saved before 2026-11-30); ``flop_free_memory_by_family``:
    ``flop_free_memory`` by family (NOTE [Kernels without FLOPs by family] in
    ``shardsci.planning._work``), each ``c + a p + b p²`` as it, ``None`` where not counted."""

    model: str
    calls: dict[str, list[float]]
    received: dict[str, list[float]]
    flops: list[float]
    memory: list[float]
    fft_flops: list[float]
    ops: list[float]
    communication_ops: list[float]
    strided_runs: list[float] = field(default_factory=list)
    peers_bound: float | None = None
    complex_matmul_flops: list[float] = field(default_factory=lambda: [0.0, 0.0])
    flop_free_memory: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    dispatch_calls: dict[str, list[float]] | None = None
    flop_free_memory_by_family: dict[str, list[float]] | None = None
    ops_on_one_rank: dict | None = None
    """The ops of the step on a one-rank mesh, counted (``ops``, ``dispatch_calls``; NOTE
    [Ops per peer]), ``None`` where not counted."""

    def count(self, kind: str, ranks: int) -> float:
        """Calls of ``kind`` (messages of ``"p2p"``) over a group of ``ranks``; the whole
        domain's grid at ``ranks`` for messages (NOTE [A rank's messages are bounded by its
        neighbours])."""
        law = message_laws(GEOMETRY[self.model].grid(ranks)) if kind == "p2p" else call_laws(ranks)
        return max(0.0, sum(c * x for c, x in zip(self.calls.get(kind, []), law)))

    def op_count(self, ranks: int) -> tuple[float, float]:
        """Aten ops of the busiest rank's step at ``ranks``, and those of them its
        communication modules dispatch (NOTE [Ops per peer]): on one rank the ops counted
        there, else the laws' less their communication ops, and no communication op."""
        ops, communication = (
            self._by_op_laws(law, ranks) for law in (self.ops, self.communication_ops)
        )
        if ranks == 1:
            if self.ops_on_one_rank is not None:
                return float(self.ops_on_one_rank["ops"]), 0.0
            return max(0.0, ops - communication), 0.0
        return ops, min(ops, communication)

    def dispatch_count(self, ranks: int) -> dict[str, float] | None:
        """The busiest rank's ShardTensor calls by dispatch path at ``ranks`` (NOTE [Host time
        by dispatch path]), ``None`` where not counted."""
        if self.dispatch_calls is None:
            return None
        counted = (self.ops_on_one_rank or {}).get("dispatch_calls")
        if ranks == 1 and counted is not None:
            return {path: float(counted.get(path, 0)) for path in self.dispatch_calls}
        return {path: self._by_op_laws(law, ranks) for path, law in self.dispatch_calls.items()}

    def _by_op_laws(self, law: list[float], ranks: int) -> float:
        """A count fitted by ``op_laws`` (``law``: its coefficients) at ``ranks``."""
        peers = ranks - 1.0 if self.peers_bound is None else min(ranks - 1.0, self.peers_bound)
        row = op_laws(self.count("p2p", ranks), peers)
        return max(0.0, sum(c * x for c, x in zip(law, row)))

    def bytes(self, kind: str, ranks: int, shape: tuple[float, ...]) -> float:
        row = _kron(GEOMETRY[self.model].basis(shape), laws(kind_of(kind), ranks))
        return max(0.0, sum(c * x for c, x in zip(self.received.get(kind, []), row)))

    def per_rank(self, coefficients: list[float], ranks: int, shape: tuple[float, ...]) -> float:
        """FLOPs (``self.flops``) or memory bytes (``self.memory``, ``self.flop_free_memory``)
        per rank: the whole field's over the ranks, plus the constant (the parameters' share)
        on every rank."""
        constant, linear, quadratic = coefficients
        whole = GEOMETRY[self.model].pixels(shape) * ranks
        return constant + (linear * whole + quadratic * whole**2) / ranks

    def flop_free_by_family(self, ranks: int, shape: tuple[float, ...]) -> dict[str, float] | None:
        """The flop-free bytes per rank by family (``per_rank`` of each), ``None`` where the
        families were not counted."""
        if self.flop_free_memory_by_family is None:
            return None
        return {
            family: self.per_rank(coefficients, ranks, shape)
            for family, coefficients in self.flop_free_memory_by_family.items()
        }

    def strided(self, shape: tuple[float, ...]) -> float:
        """Runs of the busiest rank's strided copies at the local ``shape``."""
        row = GEOMETRY[self.model].basis(shape)
        return max(0.0, sum(c * x for c, x in zip(self.strided_runs, row)))

    def fft_per_rank(self, ranks: int, shape: tuple[float, ...]) -> float:
        """FFT FLOPs per rank: the whole field's, shared evenly by the ranks."""
        whole = GEOMETRY[self.model].pixels(shape) * ranks
        return self.fft_flops[0] * _p_log_p(whole) / ranks

    def complex_matmul_per_rank(self, ranks: int, shape: tuple[float, ...]) -> float:
        """Complex matmul FLOPs per rank: the whole field's, shared evenly by the ranks."""
        constant, linear = self.complex_matmul_flops
        return (constant + linear * GEOMETRY[self.model].pixels(shape) * ranks) / ranks

    def host_s(self, machine: Machine, ranks: int, shape: tuple[float, ...]) -> float:
        """Host seconds per step at ``ranks`` with local ``shape``: the ops as ``ops_host_s``
        prices them (NOTE [One price per op]), and the collectives and halo rounds it issues
        with the bytes they bring (``collective_host_s``)."""
        issued = 0.0
        for kind in self.received:
            group, _ = projected_group(machine, self.model, kind, ranks)
            calls = self.count("p2p_rounds" if kind == "p2p" else kind, group)
            received = self.bytes(kind, group, shape)
            issued += collective_host_s(machine, kind_of(kind), group, calls, received)
        ops, communication = self.op_count(ranks)
        calls = self.dispatch_count(ranks)
        return ops_host_s(machine, ops, communication, True, calls) + issued


def op_laws(messages: float, peers: float) -> list[float]:
    """How a step's aten ops grow (NOTE [Ops per peer]): a constant, a few per message
    (``messages``), a few per peer a collective hands a piece to (``peers``)."""
    return [1.0, messages, peers]


def _polynomial(pixels: list[float], values: list[float]) -> list[float]:
    """``[c, a, b]`` of ``c + a p + b p²`` fitted to ``values`` at ``pixels``; ``b = 0`` where
    the quadratic term would be negative, and then ``c = 0`` where the constant would be."""
    coefficients = least_squares([[1.0, p, p * p] for p in pixels], values)
    if coefficients[2] < 0:
        coefficients = [*least_squares([[1.0, p] for p in pixels], values), 0.0]
    if coefficients[0] < 0:
        coefficients = [0.0, least_squares([[p] for p in pixels], values)[0], 0.0]
    return coefficients


def _p_log_p(pixels: float) -> float:
    return pixels * math.log2(max(pixels, 1.0))


def fit(
    name: str,
    runs: list[dict],
    flop_sizes: list[int],
    flop_values: list[float],
    memory_values: list[float] | None = None,
    fft_values: list[float] | None = None,
    complex_matmul_values: list[float] | None = None,
    flop_free_memory_values: list[float] | None = None,
    flop_free_memory_by_family: dict[str, list[float]] | None = None,
) -> tuple:
    """``Fitted`` from ``runs`` (``ranks``, ``shape``, ``calls``, ``received``, ``peers``,
    ``ops``; ``ops_only``: a run whose ops alone are fitted) and the FLOPs, memory traffic,
    FFT FLOPs and complex matmul FLOPs at ``flop_sizes`` (none where not given); and per kind the worst misfit over the
    runs, relative to the kind's largest measured bytes. The memory traffic of the ops without
    FLOPs (``flop_free_memory_values``) likewise, and by family
    (``flop_free_memory_by_family``: family -> bytes at ``flop_sizes``). The ops' law is
    fitted to the runs of more than 2 ranks (NOTE [Ops per peer])."""
    basis = GEOMETRY[name].basis
    runs, all_runs = [r for r in runs if not r.get("ops_only")], runs
    kinds = sorted({k for r in runs for k in (*r["received"], *r["calls"])})
    calls, received, misfit = {}, {}, {}
    for kind in kinds:
        meshes = [tuple(r.get("mesh", [r["ranks"]])) for r in runs]
        groups = [group_size(kind, mesh) for mesh in meshes]
        calls[kind] = least_squares(
            [count_laws(kind, mesh) for mesh in meshes],
            [float(r["calls"].get(kind, 0)) for r in runs],
        )
        if kind == "p2p_rounds":
            continue
        rows = [_kron(basis(r["shape"]), laws(kind_of(kind), g)) for r, g in zip(runs, groups)]
        values = [float(r["received"].get(kind, 0)) for r in runs]
        received[kind] = least_squares(rows, values)
        fitted = [sum(c * x for c, x in zip(received[kind], row)) for row in rows]
        misfit[kind] = max(abs(f - v) for f, v in zip(fitted, values)) / max(max(values), 1.0)
    pixels = [s if name == "meshgraphnet" else s * s for s in flop_sizes]
    flops = _polynomial(pixels, flop_values)
    memory, flop_free_memory = (
        _polynomial(pixels, values) if values else [0.0, 0.0, 0.0]
        for values in (memory_values, flop_free_memory_values)
    )
    fft_flops = least_squares([[_p_log_p(p)] for p in pixels], fft_values) if fft_values else [0.0]
    complex_matmul = (
        least_squares([[1.0, p] for p in pixels], complex_matmul_values)
        if complex_matmul_values
        else [0.0, 0.0]
    )
    op_runs = [r for r in all_runs if r["ranks"] > 2]
    rows = [op_laws(float(r["calls"].get("p2p", 0)), float(r["peers"])) for r in op_runs]
    # A term the runs do not vary cannot be told from the constant: it is folded into it.
    varying = [i == 0 or len({row[i] for row in rows}) > 1 for i in range(len(rows[0]))]
    rows = [[x if keep else 0.0 for x, keep in zip(row, varying)] for row in rows]
    ops, communication_ops = (
        least_squares(rows, [float(r[key]) for r in op_runs])
        for key in ("ops", "communication_ops")
    )
    dispatch_calls = None
    if all("dispatch_calls" in r for r in op_runs):
        dispatch_calls = {
            path: least_squares(rows, [float(r["dispatch_calls"].get(path, 0)) for r in op_runs])
            for path in DISPATCH_PATHS
        }
    one_rank = [r for r in all_runs if r["ranks"] == 1]
    ops_on_one_rank = (
        {"ops": one_rank[0]["ops"], "dispatch_calls": one_rank[0].get("dispatch_calls")}
        if one_rank
        else None
    )
    bounded = any(r["peers"] < r["ranks"] - 1 for r in op_runs)
    peers_bound = max(float(r["peers"]) for r in op_runs) if bounded else None
    strided = least_squares(
        [basis(r["shape"]) for r in runs], [float(r.get("strided_runs", 0)) for r in runs]
    )
    fitted = Fitted(
        name,
        calls,
        received,
        flops,
        memory,
        fft_flops,
        ops,
        communication_ops,
        strided,
        peers_bound,
        complex_matmul,
        flop_free_memory,
        dispatch_calls,
        None
        if flop_free_memory_by_family is None
        else {
            family: _polynomial(pixels, values)
            for family, values in flop_free_memory_by_family.items()
        },
        ops_on_one_rank,
    )
    return fitted, misfit


def measure_model(name: str, backend: str) -> dict:
    """Every run of ``name`` (each exchange, mesh and shape), its exchanges issued as
    ``backend`` issues them, and its FLOPs, as JSON."""
    geometry = GEOMETRY[name]
    exchanges = ("all_gather", "ring") if name == "vit" else ("auto",)
    runs: dict[str, list[dict]] = {}
    for exchange in exchanges:
        runs[exchange] = []
        for mesh_shape in geometry.meshes:
            for shape in geometry.shapes:
                per_rank = on_ranks(
                    math.prod(mesh_shape), measure, name, mesh_shape, shape, exchange, backend
                )
                busiest = max(per_rank, key=lambda r: sum(r["received"].values()))
                runs[exchange].append(
                    {
                        "ranks": math.prod(mesh_shape),
                        "mesh": list(mesh_shape),
                        "shape": list(shape),
                        **busiest,
                    }
                )
        # the ops on one rank (NOTE [Ops per peer]): no law of more ranks reaches them; at
        # the largest shape, the whole field there (the FNO's modes need 24 rows)
        one_rank = (1,) * len(geometry.meshes[0])
        for mesh_shape in (*geometry.op_meshes, one_rank):
            shape = geometry.shapes[-1 if mesh_shape == one_rank else 0]
            per_rank = on_ranks(
                math.prod(mesh_shape), measure, name, mesh_shape, shape, exchange, backend
            )
            runs[exchange].append(
                {
                    "ranks": math.prod(mesh_shape),
                    "mesh": list(mesh_shape),
                    "shape": list(shape),
                    "ops_only": True,
                    **max(per_rank, key=lambda r: r["ops"]),
                }
            )
    sizes = FLOP_SIZES.get(name, FLOP_SIZES["field"])
    return {"backend": backend, "runs": runs, "flop_sizes": list(sizes), **work_at(name, sizes)}


def measurements(name: str, saved: dict, backend: str) -> dict:
    """``name``'s measurements with its exchanges issued as ``backend`` issues them:
    ``saved``'s (``measure_model``'s JSON by model) where it holds them, else measured now.

    Raises
    ------
    SystemExit
        One line where ``saved`` holds ``name`` measured as another backend issues its
        exchanges, or without saying which (saved before 2026-11-29 17:00 UTC).
    """
    if name not in saved:
        return measure_model(name, backend)
    if saved[name].get("backend") != backend:
        raise SystemExit(
            f"{name}: the saved measurements issue exchanges as "
            f"{saved[name].get('backend', 'an unrecorded backend')}, this machine's runs as "
            f"{backend}: measure again without them"
        )
    return recounted(name, saved[name])


def work_at(name: str, sizes: list[int]) -> dict:
    """``work`` of ``name`` at each of ``sizes``, by field of ``measure_model``'s JSON, and
    the flop-free traffic by family (``flop_free_memory_bytes_by_family``: family -> bytes at
    each size, NOTE [Kernels without FLOPs by family] in ``shardsci.planning._work``)."""
    keys = ("flops", "fft_flops", "complex_matmul_flops", "memory_bytes", "flop_free_memory_bytes")
    counters = [counted_step(name, s) for s in sizes]
    values = [
        (c.flops, c.fft_flops, c.complex_matmul_flops, c.memory_bytes, c.flop_free_bytes)
        for c in counters
    ]
    result: dict = {k: [float(v) for v in column] for k, column in zip(keys, zip(*values))}
    result["flop_free_memory_bytes_by_family"] = {
        family: [float(c.flop_free_bytes_by_family.get(family, 0)) for c in counters]
        for family in FLOP_FREE_FAMILIES
    }
    return result


def recounted(name: str, measured: dict) -> dict:
    """``measured`` (``measure_model``'s JSON, perhaps a saved one) with the traffic of the
    ops without FLOPs, in all and by family, counted on the plain model where it lacks them
    (saved before 2026-11-29 09:21 UTC, or the families before 2026-11-30 07:00; NOTE
    [Kernels without FLOPs]): seconds, no ranks."""
    if "flop_free_memory_bytes_by_family" in measured:
        return measured
    counted = work_at(name, measured["flop_sizes"])
    keys = ("flop_free_memory_bytes", "flop_free_memory_bytes_by_family")
    return {**measured, **{k: counted[k] for k in keys}}


def fitted_models(name: str, measured: dict) -> tuple[dict[str, Fitted], dict]:
    """Exchange -> ``Fitted``; and the misfits."""
    result, misfits = {}, {}
    for exchange, runs in measured["runs"].items():
        result[exchange], misfits[exchange] = fit(
            name,
            runs,
            measured["flop_sizes"],
            measured["flops"],
            measured["memory_bytes"],
            measured["fft_flops"],
            measured.get("complex_matmul_flops"),
            measured.get("flop_free_memory_bytes"),
            measured.get("flop_free_memory_bytes_by_family"),
        )
    return result, misfits


# --------------------------------------------------------------------------- projection
def choose_exchange(models: dict[str, Fitted], ranks: int, shape: tuple[float, ...]) -> str:
    """NOTE [Ring or all-gather] at ``ranks``: ring when the keys and values one attention
    call gathers exceed ``gather_limit_bytes``. Those are the collectives' bytes the
    ``all_gather`` exchange adds over the ring's (an uneven all-gather is issued as an
    all-to-all), per added call, times ``P / (P - 1)``."""
    if set(models) != {"all_gather", "ring"}:
        return next(iter(models))
    kinds = [k for k in models["all_gather"].received if k not in P2P]

    def collectives(fitted: Fitted) -> tuple[float, float]:
        nbytes = sum(fitted.bytes(k, ranks, shape) for k in kinds)
        return nbytes, sum(fitted.count(k, ranks) for k in kinds)

    (gathered, gather_calls), (ringed, ring_calls) = (
        collectives(models["all_gather"]),
        collectives(models["ring"]),
    )
    whole = (gathered - ringed) / max(gather_calls - ring_calls, 1.0) * ranks / max(ranks - 1, 1)
    limit = attention_exchange_choice().gather_limit_bytes
    return "ring" if ranks > 1 and whole > limit else "all_gather"


# --------------------------------------------------------------------------- statistics
# The kind that carries a model's normalisation statistics at the measured rank counts (the
# library's all-gather there, counted with the all-to-alls: the UNet has no other), costed at
# ``P`` ranks as the combination the library's rule picks (NOTE [Normalisation statistics
# across shards]).
STATISTICS = {"unet": "all_to_all"}


def statistics_crossover(machine: Machine, row_bytes: float = 32.0, largest: int = 2**16) -> int:
    """The smallest group from which two all-reduces of ``row_bytes`` (one statistic of every
    row) cost less on ``machine`` than one all-gather of twice that per rank: the library's
    ``all_reduce_from_ranks`` for that machine; ``largest + 1`` if none up to ``largest``."""
    for ranks in range(2, largest + 1):
        gathered = all_gather_s(machine, ranks, 2 * row_bytes)
        if 2 * all_reduce_s(machine, ranks, row_bytes) < gathered:
            return ranks
    return largest + 1


def statistics_s(machine: Machine, ranks: int, calls: float, received: float) -> float:
    """Seconds of ``calls`` normalisations' statistics over groups of ``ranks``, whose
    all-gathers would receive ``received`` bytes in all: the library's rule, with the
    crossover of ``machine`` at these statistics' size, picks one all-gather or two
    all-reduces per call."""
    if ranks == 1 or calls == 0:
        return 0.0
    piece = received / calls / (ranks - 1)
    crossover = statistics_crossover(machine, piece / 2, largest=max(ranks, 2))
    with normalization_statistics(all_reduce_from_ranks=crossover):
        if statistics_all_reduced(ranks):
            return calls * 2 * all_reduce_s(machine, ranks, piece / 2)
    return calls * all_gather_s(machine, ranks, piece)


def step_s(machine: Machine, fitted: Fitted, ranks: int, shape: tuple[float, ...]) -> dict:
    """Seconds per step of each part (NOTE [The cost model]) at ``ranks`` with local
    ``shape``; ``total``: ``max(host, device)``."""
    parts = {
        "compute": compute_s(
            machine,
            flops=fitted.per_rank(fitted.flops, ranks, shape),
            fft_flops=fitted.fft_per_rank(ranks, shape),
            complex_matmul_flops=fitted.complex_matmul_per_rank(ranks, shape),
            memory_bytes=fitted.per_rank(fitted.memory, ranks, shape),
            flop_free_bytes=fitted.per_rank(fitted.flop_free_memory, ranks, shape),
            strided_runs=fitted.strided(shape),
            flop_free_bytes_by_family=fitted.flop_free_by_family(ranks, shape),
        )
    }
    if ranks > 1:
        for kind in fitted.received:
            group, nodes = projected_group(machine, fitted.model, kind, ranks)
            n = fitted.count(kind, group)
            rounds = fitted.count("p2p_rounds", group) if kind == "p2p" else n
            nbytes = fitted.bytes(kind, group, shape)
            if kind == STATISTICS.get(fitted.model):
                parts["statistics"] = statistics_s(machine, group, n, nbytes)
            else:
                parts[kind] = collective_s(machine, kind_of(kind), group, n, nbytes, rounds, nodes)
    parts["device"] = sum(parts.values())
    parts["host"] = fitted.host_s(machine, ranks, shape)
    parts["total"] = _total(machine, parts)
    return parts


def _total(machine: Machine, parts: dict) -> float:
    """A step's seconds: ``max(host, device)`` where the host launches ahead of a device
    (``host_overlaps_device``), else ``host + device`` (a CPU runs both on one core)."""
    if machine.host_overlaps_device:
        return max(parts["host"], parts["device"])
    return parts["host"] + parts["device"]


def best_step(machine: Machine, models: dict[str, Fitted], ranks: int, shape) -> tuple[str, dict]:
    exchange = choose_exchange(models, ranks, shape)
    return exchange, step_s(machine, models[exchange], ranks, shape)


def hybrid_step(machine: Machine, models: dict[str, Fitted], ranks: int, tile: float) -> dict:
    """A step at ``ranks`` GPUs as data parallelism over groups of one node's GPUs, each
    group splitting one sample's field (``tile`` per GPU): the domain's collectives at
    ``gpus_per_node`` ranks on NVLink, the gradients all-reduced over all ``ranks``."""
    name = next(iter(models.values())).model
    group = min(ranks, machine.gpus_per_node)
    shape = GEOMETRY[name].weak(group, tile)
    exchange, parts = best_step(machine, models, group, shape)
    fitted = models[exchange]
    if "gradient_all_reduce" in parts:
        calls = fitted.count("gradient_all_reduce", group)
        nbytes = fitted.bytes("gradient_all_reduce", group, shape)
        buffer = nbytes / max(calls, 1.0) * group / (2 * (group - 1))
        gradients = calls * all_reduce_s(machine, ranks, buffer)
        parts["device"] += gradients - parts["gradient_all_reduce"]
        parts["gradient_all_reduce"] = gradients
        parts["total"] = _total(machine, parts)
    return parts


def weak_efficiency(machine: Machine, models: dict[str, Fitted], ranks: int, tile: float) -> float:
    name = next(iter(models.values())).model
    _, parts = best_step(machine, models, ranks, GEOMETRY[name].weak(ranks, tile))
    return parts["compute"] / parts["total"] if parts["total"] > 0 else 0.0


def smallest_tile(machine: Machine, models: dict[str, Fitted], ranks: int, target: float):
    """The smallest tile keeping ``target`` at ``ranks``: powers of 2 from 16 to 2^15 (of 10
    from 10^2 to 10^8 nodes for a graph); ``None`` if none does."""
    name = next(iter(models.values())).model
    candidates = (
        [10**k for k in range(2, 9)] if name == "meshgraphnet" else [2**k for k in range(4, 16)]
    )
    for tile in candidates:
        if weak_efficiency(machine, models, ranks, tile) >= target:
            return tile
    return None


def _ms(parts: dict) -> dict:
    return {k: round(v * 1e3, 4) for k, v in parts.items()}


def project(machine: Machine, models: dict[str, Fitted]) -> dict:
    """Emit ``weak`` and ``strong`` records of one model; return its summary."""
    fitted = next(iter(models.values()))
    name, geometry = fitted.model, GEOMETRY[fitted.model]
    tile = RECOMMENDED[name]
    for ranks in GPUS:
        shape = geometry.weak(ranks, tile)
        exchange, parts = best_step(machine, models, ranks, shape)
        emit(
            "weak",
            model=name,
            gpus=ranks,
            tile=tile,
            local_shape=[round(s, 1) for s in shape],
            attention=exchange if len(models) > 1 else None,
            step_ms=_ms(parts),
            efficiency=round(parts["compute"] / parts["total"], 3),
        )
    weak, host_512 = parts["compute"] / parts["total"], parts["host"]
    no_host = dataclasses.replace(
        machine,
        host_us_per_op=0.0,
        plain_host_us_per_op=0.0,
        host_us_per_communication_op=0.0,
        host_us_per_collective=0.0,
        host_us_per_collective_step=0.0,
        host_us_per_all_to_all=0.0,
        host_us_per_all_to_all_peer=0.0,
        host_s_per_byte_received=0.0,
        host_calls_in_step_factor=0.0,
    )
    first, strong_limit, efficiency = None, None, 1.0
    for ranks in GPUS:
        shape = geometry.strong(ranks, LARGEST[name])
        _, parts = best_step(machine, models, ranks, shape)
        first = first or (ranks, parts["total"])
        efficiency = first[0] * first[1] / (ranks * parts["total"])
        if efficiency < STRONG_FLOOR and strong_limit is None:
            strong_limit = ranks
        emit(
            "strong",
            model=name,
            gpus=ranks,
            field=LARGEST[name],
            local_shape=[round(s, 1) for s in shape],
            step_ms=_ms(parts),
            efficiency_vs_8=round(efficiency, 3),
        )
    # What the host would have to cost for it to hide behind the device at 512 GPUs; and
    # the data-parallel alternative of domain groups of one node.
    _, device = best_step(no_host, models, 512, geometry.weak(512, tile))
    hybrid, hybrid_no_host = (hybrid_step(m, models, 512, tile) for m in (machine, no_host))
    emit("hybrid", model=name, gpus=512, tile=tile, step_ms=_ms(hybrid))
    return {
        "weak_efficiency_512": round(weak, 3),
        "weak_efficiency_512_without_host": round(weak_efficiency(no_host, models, 512, tile), 3),
        "tile_for_0.9": smallest_tile(machine, models, 512, WEAK_GOAL),
        "tile_for_0.9_without_host": smallest_tile(no_host, models, 512, WEAK_GOAL),
        "weak_efficiency_512_dp_over_nodes": round(hybrid["compute"] / hybrid["total"], 3),
        "weak_efficiency_512_dp_over_nodes_without_host": round(
            hybrid_no_host["compute"] / hybrid_no_host["total"], 3
        ),
        "strong_efficiency_512": round(efficiency, 3),
        "strong_below_0.5_at_gpus": strong_limit,
        "host_ms_per_step": round(host_512 * 1e3, 2),
        "host_us_per_op_to_hide": round(device["device"] / fitted.op_count(512)[0] * 1e6, 2),
        "ops_per_step_512": round(fitted.op_count(512)[0]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(GEOMETRY), choices=list(GEOMETRY))
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="NAME=VALUE", help="override a Machine field"
    )
    parser.add_argument("--load", help="project from this file's measurements (from --save)")
    parser.add_argument("--save", help="write the measurements to this JSON file")
    args = parse_arguments(parser, argv)
    try:
        machine = override(Machine(), args.set)
    except ValueError as error:
        raise SystemExit(f"--set {error}") from None
    emit("parameters", **asdict(machine))
    saved = json.loads(Path(args.load).read_text()) if args.load else {}
    summary, goals, measured_all = {}, [], {}
    with rank_pools():
        for name in args.models:
            measured = measurements(name, saved, machine.backend)
            measured_all[name] = measured
            models, misfits = fitted_models(name, measured)
            emit(
                "measured",
                model=name,
                **measured,
                misfit=misfits,
                fitted={k: asdict(v) for k, v in models.items()},
            )
            summary[name] = project(machine, models)
            goals.append(
                Goal(
                    f"{name}: weak-scaling efficiency at 512 GPUs at least {WEAK_GOAL} at "
                    f"{RECOMMENDED[name]} per GPU",
                    summary[name]["weak_efficiency_512"] >= WEAK_GOAL,
                )
            )
    if args.save:
        Path(args.save).write_text(json.dumps(measured_all))
    emit_summary(
        goals,
        args.check,
        **summary,
    )


if __name__ == "__main__":
    main()
