"""Bytes moved by ShardTensor redistributions and ``scatter_tensor``, against the lower bound.

A float32 ``(B, C, H, W) = (2, 3, 131, 67)`` tensor with uneven shards is moved between
layouts on 4 ranks, as a 1-D mesh and as a (2, 2) mesh. Each rank counts its bytes with
``shardsci.testing.count_traffic``, from the collectives torch runs, independently of the
library's own count (NOTE [What a byte count means] for the byte model), and the benchmark
computes, from the two layouts alone, the lower bound it is held to (one Partial axis at
most):

- no Partial axis: each rank receives what its target shard lacks of its source shard, and
  every byte sent is received (total sent equals total received);
- Partial -> Shard along an axis of N ranks: each rank receives the N - 1 other partial
  copies of its target piece (a reduce-scatter that relays no partial sums; with uneven
  pieces a rank sends what the others' pieces need, so again only the total is bound);
- Partial -> Replicate: ``2 (N - 1) / N`` of the buffer, sent and received (an all-reduce);
- ``scatter_tensor``: each rank receives its piece; the source sends the sum of the others.

It also runs the round trip ``Shard(2) -> Shard(3) -> Shard(2)`` from H sizes 70/61 without
naming sizes on the way back, and, for context, what DTensor moves for the same transitions on
``torch.chunk`` sizes (counted the same way).

Goals: every case at the lower bound; the round trip restores the sizes. Run ``python -m
benchmarks.communication_volume [--cases REGEX] [--check]`` (``--cases``: only the cases whose
name matches); the JSON fields are listed in README.md.
"""

from __future__ import annotations

import argparse
import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from benchmarks._common import Goal, emit, emit_summary, on_ranks, parse_arguments, rank_pools
from shardsci import ShardTensor, scatter_tensor
from shardsci.testing import count_traffic, get_mesh

GLOBAL_SHAPE = (2, 3, 131, 67)
ITEMSIZE = torch.finfo(torch.float32).bits // 8
WORLD_SIZE = 4
SCATTER_SOURCE = 0

Box = tuple[tuple[int, int], ...]


def _chunk(extent: int, parts: int) -> tuple[int, ...]:
    """Shard sizes of ``torch.chunk``: ceil-sized pieces, then the rest, then zeros."""
    step = -(-extent // parts)
    return tuple(max(0, min(step, extent - k * step)) for k in range(parts))


@dataclass(frozen=True)
class Layout:
    """How a tensor lies on a mesh: a placement per mesh axis, and shard sizes.

    Each tensor dim is sharded by at most one mesh axis here (no nested sharding).

    Attributes
    ----------
    placements : tuple of Placement
        One per mesh axis.
    sizes : dict
        Mesh axis -> extents of the shards along the dim that axis shards, one per coordinate;
        every ``Shard`` axis has an entry.
    """

    placements: tuple[Placement, ...]
    sizes: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def box(self, coordinate: Sequence[int]) -> Box:
        """The region of the global tensor held at ``coordinate`` (a Partial axis holds all)."""
        box = [(0, extent) for extent in GLOBAL_SHAPE]
        for axis, placement in enumerate(self.placements):
            if isinstance(placement, Shard):
                sizes = self.sizes[axis]
                start = sum(sizes[: coordinate[axis]])
                box[placement.dim] = (start, start + sizes[coordinate[axis]])
        return tuple(box)

    def describe(self) -> str:
        return " ".join(
            f"{p}{list(self.sizes[axis])}" if axis in self.sizes else str(p)
            for axis, p in enumerate(self.placements)
        )


def _volume(box: Box) -> int:
    return math.prod(max(0, stop - start) for start, stop in box)


def _intersect(a: Box, b: Box) -> Box:
    return tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))


def _coordinates(mesh_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Mesh coordinates in rank order (the mesh is ``arange(world).view(mesh_shape)``)."""
    return list(itertools.product(*(range(n) for n in mesh_shape)))


# --------------------------------------------------------------------------- lower bounds
def redistribution_bound(
    mesh_shape: tuple[int, ...], source: Layout, target: Layout
) -> tuple[list[int] | None, list[int]]:
    """Least bytes each rank must send (None: only the total is bound) and receive."""
    partial_axes = [a for a, p in enumerate(source.placements) if isinstance(p, Partial)]
    coordinates = _coordinates(mesh_shape)
    if not partial_axes:
        received = [
            _volume(target.box(c)) - _volume(_intersect(target.box(c), source.box(c)))
            for c in coordinates
        ]
        return None, [n * ITEMSIZE for n in received]
    (axis,) = partial_axes
    ranks = mesh_shape[axis]
    if isinstance(target.placements[axis], Shard):
        received = [(ranks - 1) * _volume(target.box(c)) * ITEMSIZE for c in coordinates]
        return None, received
    moved = [2 * (ranks - 1) * _volume(source.box(c)) * ITEMSIZE // ranks for c in coordinates]
    return moved, moved


def scatter_bound(mesh_shape: tuple[int, ...], layout: Layout) -> tuple[list[int], list[int]]:
    """Bytes each rank must send and receive when rank ``SCATTER_SOURCE`` holds the tensor."""
    pieces = [_volume(layout.box(c)) * ITEMSIZE for c in _coordinates(mesh_shape)]
    received = [0 if r == SCATTER_SOURCE else n for r, n in enumerate(pieces)]
    sent = [sum(received) if r == SCATTER_SOURCE else 0 for r in range(len(pieces))]
    return sent, received


# --------------------------------------------------------------------------- rank bodies
def _local_shard(mesh_shape: tuple[int, ...], layout: Layout) -> torch.Tensor:
    """This rank's shard of a random global tensor (every rank draws the same one)."""
    whole = torch.randn(GLOBAL_SHAPE)
    box = layout.box(get_mesh(mesh_shape).get_coordinate())
    return whole[tuple(slice(start, stop) for start, stop in box)].contiguous()


def redistribute_chain(
    mesh_shape: tuple[int, ...],
    source: Layout,
    steps: Sequence[tuple[tuple[Placement, ...], dict[int, tuple[int, ...]] | None]],
) -> list[tuple[dict, dict[int, list[int]]]]:
    """Rank body: redistribute through ``steps`` (placements, sizes or None for the default).

    Returns, per step, this rank's counts (``Traffic.as_dict``) and the shard sizes of the
    result (mesh axis -> extents along the dim it shards).
    """
    mesh = get_mesh(mesh_shape)
    x = ShardTensor.from_local(
        _local_shard(mesh_shape, source), mesh, source.placements, source.sizes or "chunk"
    )
    results = []
    for placements, sizes in steps:
        with count_traffic() as traffic:
            x = x.redistribute(mesh, placements, sharding_shapes=sizes)
        shard_sizes = {
            axis: [shape[x.placements[axis].dim] for shape in shapes]
            for axis, shapes in x.sharding_shapes().items()
        }
        results.append((traffic.as_dict(), shard_sizes))
    return results


def scatter(mesh_shape: tuple[int, ...], layout: Layout) -> dict:
    """Rank body: ``scatter_tensor`` from rank ``SCATTER_SOURCE``; this rank's counts."""
    mesh = get_mesh(mesh_shape)
    whole = torch.randn(GLOBAL_SHAPE) if dist.get_rank() == SCATTER_SOURCE else None
    with count_traffic() as traffic:
        scatter_tensor(
            whole,
            SCATTER_SOURCE,
            mesh,
            layout.placements,
            layout.sizes,
            global_shape=GLOBAL_SHAPE,
            dtype=torch.float32,
        )
    return traffic.as_dict()


def dtensor_received(source: Layout, target: Layout) -> dict[str, int]:
    """Rank body (1-D mesh, chunk sizes): bytes DTensor's redistribution receives, by kind."""
    mesh = get_mesh((WORLD_SIZE,))
    x = DTensor.from_local(
        _local_shard((WORLD_SIZE,), source),
        mesh,
        source.placements,
        shape=GLOBAL_SHAPE,
        stride=torch.empty(GLOBAL_SHAPE, device="meta").stride(),
    )
    with count_traffic() as traffic:
        x.redistribute(mesh, target.placements)
    return dict(traffic.received_by_kind)


# --------------------------------------------------------------------------- the cases
_H, _W = GLOBAL_SHAPE[2], GLOBAL_SHAPE[3]
H4, H4_CHUNK, H4_REVERSED = (40, 33, 30, 28), _chunk(_H, 4), (28, 30, 33, 40)
W4 = _chunk(_W, 4)
H2, W2 = (70, 61), (35, 32)
S2_1D = Layout((Shard(2),), {0: H4})
S2_2D = Layout((Shard(2), Shard(3)), {0: H2, 1: W2})
PARTIAL_2D = Layout((Shard(2), Partial()), {0: H2})

TRANSITIONS: list[tuple[str, tuple[int, ...], Layout, Layout]] = [
    ("Shard(2)->Shard(3)", (4,), S2_1D, Layout((Shard(3),), {0: W4})),
    ("Shard(2)->Shard(1) (an empty shard)", (4,), S2_1D, Layout((Shard(1),), {0: (1, 1, 1, 0)})),
    ("Shard(2)->Replicate", (4,), S2_1D, Layout((Replicate(),))),
    ("Replicate->Shard(2)", (4,), Layout((Replicate(),)), S2_1D),
    ("Shard(2) rebalance to chunk sizes", (4,), S2_1D, Layout((Shard(2),), {0: H4_CHUNK})),
    ("Shard(2) rebalance, reversed sizes", (4,), S2_1D, Layout((Shard(2),), {0: H4_REVERSED})),
    ("Partial->Replicate", (4,), Layout((Partial(),)), Layout((Replicate(),))),
    ("Partial->Shard(2)", (4,), Layout((Partial(),)), S2_1D),
    ("2-D swap [Shard(2),Shard(3)]->[Shard(3),Shard(2)]", (2, 2), S2_2D,
     Layout((Shard(3), Shard(2)), {0: W2, 1: H2})),
    ("2-D [Shard(2),Shard(3)]->[Shard(2),Replicate]", (2, 2), S2_2D,
     Layout((Shard(2), Replicate()), {0: H2})),
    ("2-D [Shard(2),Shard(3)]->[Replicate,Replicate]", (2, 2), S2_2D,
     Layout((Replicate(), Replicate()))),
    ("2-D [Replicate,Replicate]->[Shard(2),Shard(3)]", (2, 2),
     Layout((Replicate(), Replicate())), S2_2D),
    ("2-D rebalance both axes", (2, 2), S2_2D,
     Layout((Shard(2), Shard(3)), {0: (61, 70), 1: (30, 37)})),
    ("2-D [Shard(2),Partial]->[Shard(2),Replicate]", (2, 2), PARTIAL_2D,
     Layout((Shard(2), Replicate()), {0: H2})),
    ("2-D [Shard(2),Partial]->[Shard(2),Shard(3)]", (2, 2), PARTIAL_2D, S2_2D),
]  # fmt: skip
SCATTERS = [("scatter_tensor Shard(2)", (4,), S2_1D), ("scatter_tensor 2-D", (2, 2), S2_2D)]
ROUND_TRIP_SOURCE = Layout((Shard(2), Replicate()), {0: H2})
ROUND_TRIP_STEPS = [((Shard(3), Replicate()), {0: _chunk(_W, 2)}), ((Shard(2), Replicate()), None)]
DTENSOR_CONTEXT = [
    ("Shard(2)->Replicate", Layout((Shard(2),), {0: H4_CHUNK}), Layout((Replicate(),))),
    ("Shard(2)->Shard(3)", Layout((Shard(2),), {0: H4_CHUNK}), Layout((Shard(3),), {0: W4})),
    ("Partial->Replicate", Layout((Partial(),)), Layout((Replicate(),))),
    ("Partial->Shard(2)", Layout((Partial(),)), Layout((Shard(2),), {0: H4_CHUNK})),
]


# --------------------------------------------------------------------------- reporting
def _per_rank(stats: list[dict], direction: str) -> tuple[list[int], dict[str, list[int]]]:
    """Total bytes per rank and, per collective kind, bytes per rank."""
    kinds = sorted({kind for s in stats for kind in s[direction]})
    by_kind = {kind: [s[direction].get(kind, 0) for s in stats] for kind in kinds}
    return [sum(s[direction].values()) for s in stats], by_kind


def _volume_record(
    stats: list[dict], bound: tuple[list[int] | None, list[int]]
) -> dict[str, object]:
    """Measured bytes per rank and kind, the lower bound, and whether they meet."""
    sent, sent_by_kind = _per_rank(stats, "sent")
    received, received_by_kind = _per_rank(stats, "received")
    sent_bound, received_bound = bound
    sent_ok = sum(sent) == sum(received) if sent_bound is None else sent == sent_bound
    return {
        "sent_bytes": sent,
        "received_bytes": received,
        "sent_bytes_by_kind": sent_by_kind,
        "received_bytes_by_kind": received_by_kind,
        "calls_by_kind": {k: max(s["calls"].get(k, 0) for s in stats) for k in sent_by_kind},
        "lower_bound_sent_bytes": sent_bound,
        "lower_bound_received_bytes": received_bound,
        "at_lower_bound": received == received_bound and sent_ok,
    }


def _chain(
    mesh_shape: tuple[int, ...], source: Layout, steps: list
) -> list[tuple[Layout, dict[str, object]]]:
    """Run ``steps`` on the ranks; per step, the layout reached and its volume record."""
    per_rank = on_ranks(math.prod(mesh_shape), redistribute_chain, mesh_shape, source, steps)
    records = []
    for index, (placements, _) in enumerate(steps):
        stats = [rank[index][0] for rank in per_rank]
        reached = Layout(placements, {a: tuple(s) for a, s in per_rank[0][index][1].items()})
        bound = redistribution_bound(mesh_shape, source, reached)
        records.append((reached, _volume_record(stats, bound)))
        source = reached
    return records


def report_transitions(selected: re.Pattern) -> list[bool]:
    """Emit one record per selected transition; return whether each is at the lower bound."""
    verdicts = []
    for name, mesh_shape, source, target in TRANSITIONS:
        if not selected.search(name):
            continue
        ((reached, record),) = _chain(mesh_shape, source, [(target.placements, target.sizes)])
        verdicts.append(record["at_lower_bound"])
        emit(
            "transition",
            name=name,
            mesh=mesh_shape,
            source=source.describe(),
            target=reached.describe(),
            **record,
        )
    return verdicts


def report_scatters(selected: re.Pattern) -> list[bool]:
    """Emit one record per selected ``scatter_tensor`` case; return whether each is at the
    bound."""
    verdicts = []
    for name, mesh_shape, layout in SCATTERS:
        if not selected.search(name):
            continue
        stats = on_ranks(math.prod(mesh_shape), scatter, mesh_shape, layout)
        record = _volume_record(stats, scatter_bound(mesh_shape, layout))
        verdicts.append(record["at_lower_bound"])
        emit(
            "scatter",
            name=name,
            mesh=mesh_shape,
            source_rank=SCATTER_SOURCE,
            target=layout.describe(),
            **record,
        )
    return verdicts


def report_round_trip() -> tuple[bool, list[bool]]:
    """Emit the round trip; return whether the sizes came back, and each leg's verdict."""
    legs = _chain((2, 2), ROUND_TRIP_SOURCE, ROUND_TRIP_STEPS)
    final = legs[-1][0]
    restored = final.sizes == ROUND_TRIP_SOURCE.sizes
    emit(
        "round_trip",
        mesh=(2, 2),
        source=ROUND_TRIP_SOURCE.describe(),
        sizes_before=list(ROUND_TRIP_SOURCE.sizes[0]),
        sizes_after=list(final.sizes[0]),
        restored=restored,
        legs=[{"target": layout.describe(), **record} for layout, record in legs],
    )
    return restored, [record["at_lower_bound"] for _, record in legs]


def report_dtensor_context(selected: re.Pattern) -> None:
    """Emit, per selected transition on chunk sizes, what DTensor and ShardTensor receive per
    rank."""
    for name, source, target in DTENSOR_CONTEXT:
        if not selected.search(name):
            continue
        dtensor = on_ranks(WORLD_SIZE, dtensor_received, source, target)
        ((_, record),) = _chain((WORLD_SIZE,), source, [(target.placements, target.sizes)])
        emit(
            "dtensor_context",
            name=name,
            mesh=(WORLD_SIZE,),
            source=source.describe(),
            target=target.describe(),
            dtensor_bytes_by_kind={k: [r.get(k, 0) for r in dtensor] for k in sorted(dtensor[0])},
            dtensor_received_bytes=[sum(r.values()) for r in dtensor],
            shardtensor_received_bytes=record["received_bytes"],
            lower_bound_received_bytes=record["lower_bound_received_bytes"],
        )


ROUND_TRIP = "round trip"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="", help="regex on the case names (default: every case)")
    args = parse_arguments(parser, argv)
    selected = re.compile(args.cases)
    goals_round_trip = []
    with rank_pools():
        verdicts = report_transitions(selected) + report_scatters(selected)
        if selected.search(ROUND_TRIP):
            restored, leg_verdicts = report_round_trip()
            verdicts += leg_verdicts
            goals_round_trip = [Goal("the round trip restores the shard sizes", restored)]
        report_dtensor_context(selected)
    emit_summary(
        [Goal("every case at the byte lower bound", all(verdicts)), *goals_round_trip],
        args.check,
        cases=len(verdicts),
        cases_at_lower_bound=sum(verdicts),
    )


if __name__ == "__main__":
    main()
