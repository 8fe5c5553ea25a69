"""Redistribution between every pair of layouts: values, gradients and the bytes moved.

Each transition starts from a ShardTensor whose global value is known (Partial sources hold
random pieces whose sum or average is that value), moves it, and checks on every rank:
- its shard is exactly the target box of the global value, and ``full_tensor`` is the value;
- the bytes it received are the lower bound: what its target box lacks from its source box
  (Shard / Replicate sources), with the sender known from the layout alone; a Partial axis
  becomes Shard by one reduce-scatter, Replicate by one all-reduce;
- the gradient of a random projection of the result, read back on the source shard, is the
  reference gradient (Replicate gradient for a Partial source, NOTE in ``_api.py``).
Expected boxes and byte counts come from ``tests/boxes.py``, never from the library's planner.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pytest
import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from shardsci.tensor import ShardTensor, ShardTensorSpec
from shardsci.tensor._api import from_local_spec
from shardsci.tensor._api import redistribute as redistribute_to_spec
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    assert_close_all_ranks,
    counted_comm,
    get_mesh,
    run_on_ranks,
)
from tests.boxes import box, coordinates, dim_shardings, narrow, overlap, partial_index, volume

S0, S1, S2, R = Shard(0), Shard(1), Shard(2), Replicate()
PSUM, PAVG = Partial("sum"), Partial("avg")
ITEMSIZE = 8  # float64


@dataclass(frozen=True)
class Move:
    """A redistribution target.

    Attributes
    ----------
    placements : tuple of Placement
    sizes : dict
        Tensor dim -> explicit target extents (rebalancing); other dims get the defaults.
    order : dict
        Tensor dim -> mesh axes, outermost first. A move with an order or with sizes for a
        nested dim goes through the internal ``redistribute(x, spec)`` (the public API has no
        words for either) and must then give the sizes of every sharded dim.
    """

    placements: tuple[Placement, ...]
    sizes: Mapping[int, Sequence[int]] = field(default_factory=dict)
    order: Mapping[int, Sequence[int]] = field(default_factory=dict)

    @property
    def internal(self) -> bool:
        dims = [p.dim for p in self.placements if isinstance(p, Shard)]
        nested = {d for d in dims if dims.count(d) > 1}
        return bool(self.order) or bool(nested & set(self.sizes))

    def __str__(self) -> str:
        return _show(Layout(self.placements, self.sizes, self.order))


def _show(layout: Layout) -> str:
    text = ",".join(_short(p) for p in layout.placements)
    if layout.sizes:
        text += "|" + ";".join(f"{d}:{'/'.join(map(str, s))}" for d, s in layout.sizes.items())
    if layout.order:
        text += "|order " + ";".join(f"{d}:{tuple(a)}" for d, a in layout.order.items())
    return f"[{text}]"


def _short(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"S{p.dim}"
    if isinstance(p, Partial):
        return f"P{p.reduce_op}"
    return "R"


# --------------------------------------------------------------------------- building a source
def _source(
    layout: Layout, shape: tuple[int, ...], mesh_shape: tuple[int, ...], me: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(global value, this rank's shard). Partial axes hold random pieces: the value is their
    sum, divided by the number of ranks along the ``avg`` axes."""
    partial = [a for a, p in enumerate(layout.placements) if isinstance(p, Partial)]
    pieces = [
        torch.randn(shape, dtype=torch.float64)
        for _ in range(math.prod(mesh_shape[a] for a in partial))
    ]
    avg_ranks = math.prod(mesh_shape[a] for a in partial if layout.placements[a].reduce_op == "avg")
    value = sum(pieces[1:], pieces[0]) / avg_ranks
    local = narrow(
        pieces[partial_index(layout, mesh_shape, me)], box(layout, shape, mesh_shape, me)
    )
    return value, local


def _normalized(placements: Sequence[Placement], ndim: int) -> tuple[Placement, ...]:
    return tuple(Shard(p.dim % ndim) if isinstance(p, Shard) else p for p in placements)


def _expected_layout(
    src: Layout, move: Move, shape: tuple[int, ...], mesh_shape: tuple[int, ...]
) -> Layout:
    """The layout a move lands on: explicit sizes; else, for a dim sharded over the same axes
    as in the source, the source's order and sizes; else increasing axes and torch.chunk."""
    placements = _normalized(move.placements, len(shape))
    if move.internal:
        return Layout(placements, move.sizes, move.order)
    before = dim_shardings(src, shape, mesh_shape)
    sizes: dict[int, Sequence[int]] = {}
    order: dict[int, Sequence[int]] = {}
    for dim, (axes, _) in dim_shardings(Layout(placements), shape, mesh_shape).items():
        kept = before.get(dim)
        if kept is not None and sorted(kept[0]) == sorted(axes):
            order[dim], sizes[dim] = kept
        if dim in move.sizes:
            sizes[dim] = move.sizes[dim]
    return Layout(placements, sizes, order)


def _apply(x: ShardTensor, move: Move, mesh) -> ShardTensor:
    if move.internal:
        spec = ShardTensorSpec.build(
            mesh, move.placements, x.shape, x.dtype, dict(move.sizes), order=dict(move.order)
        )
        return redistribute_to_spec(x, spec)
    axis_of = {p.dim % x.ndim: a for a, p in enumerate(move.placements) if isinstance(p, Shard)}
    shapes = {axis_of[d % x.ndim]: list(s) for d, s in move.sizes.items()}
    return x.redistribute(mesh, move.placements, sharding_shapes=shapes or None)


# --------------------------------------------------------------------------- expected bytes
def _byte_problems(
    stats, src: Layout, dst: Layout, shape: tuple[int, ...], mesh_shape: tuple[int, ...], me
) -> list[str]:
    """What differs between the counted communication and the lower bound."""
    counted = {
        "calls": {k: v for k, v in stats.calls.items() if v},
        "received": {k: v for k, v in stats.received.items() if v},
        "sent": {k: v for k, v in stats.sent.items() if v},
    }
    if any(isinstance(p, Partial) for p in src.placements):
        allowed = _partial_bytes(src, dst, shape, mesh_shape, me)
        if allowed is None:
            return _multi_step_problems(stats, src, dst, shape, mesh_shape, me)
    else:
        allowed = _exchange_bytes(src, dst, shape, mesh_shape, me)
    if counted in allowed:
        return []
    return [f"communication {counted}, expected {' or '.join(map(str, allowed))}"]


def _multi_step_problems(
    stats, src: Layout, dst: Layout, shape: tuple[int, ...], mesh_shape: tuple[int, ...], me
) -> list[str]:
    """Whether this rank moved (received, sent) bytes as one of the cheapest ways to the
    target does (fewest bytes received over all ranks; see ``_partial_strategies``)."""
    strategies = _partial_strategies(src, dst, shape, mesh_shape)
    totals = {name: sum(r for r, _ in cost.values()) for name, cost in strategies.items()}
    cheapest = {
        name: strategies[name][me] for name in totals if totals[name] == min(totals.values())
    }
    counted = (stats.total_received, stats.total_sent)
    if counted in cheapest.values():
        return []
    return [f"(received, sent) {counted}, the cheapest ways move {cheapest} (all: {totals})"]


def _exchange_bytes(
    src: Layout, dst: Layout, shape: tuple[int, ...], mesh_shape: tuple[int, ...], me
) -> list[dict[str, dict[str, int]]]:
    """One collective in which each rank receives what its target box lacks, from the rank
    of its replica group (same coordinates on the source's Replicate axes) that holds it: an
    all-gather when the ranks that exchange data want the same box, else an all-to-all.

    A rank that neither sends nor receives may still take part in its group's collective,
    except on a 1-D mesh, where the group is every rank: there it does iff any data moves.
    """
    replicated = [a for a, p in enumerate(src.placements) if isinstance(p, Replicate)]

    def moved(sender: tuple[int, ...], receiver: tuple[int, ...]) -> int:
        if sender == receiver or any(sender[a] != receiver[a] for a in replicated):
            return 0
        source = box(src, shape, mesh_shape, sender)
        return volume(overlap(source, box(dst, shape, mesh_shape, receiver)))

    everyone = coordinates(mesh_shape)
    target = box(dst, shape, mesh_shape, me)
    lacks = volume(target) - volume(overlap(target, box(src, shape, mesh_shape, me)))
    received = lacks * ITEMSIZE
    sent = sum(moved(me, c) for c in everyone) * ITEMSIZE
    # A gather: every rank that sends to another wants the same target box as it.
    gather = all(
        box(dst, shape, mesh_shape, a) == box(dst, shape, mesh_shape, b)
        for a in everyone
        for b in everyone
        if moved(a, b)
    )
    kind = "all_gather" if gather else "all_to_all"
    busy = {
        "calls": {kind: 1},
        "received": {kind: received} if received else {},
        "sent": {kind: sent} if sent else {},
    }
    idle = {"calls": {}, "received": {}, "sent": {}}
    if received or sent:
        return [busy]
    if len(mesh_shape) == 1:
        anything_moves = any(moved(a, b) for a in everyone for b in everyone)
        return [busy if anything_moves else idle]
    return [idle, busy]


def _partial_bytes(
    src: Layout, dst: Layout, shape: tuple[int, ...], mesh_shape: tuple[int, ...], me
) -> list[dict[str, dict[str, int]]] | None:
    """One Partial axis and every other axis unchanged: Partial -> Shard(d) (d sharded by that
    axis alone) is one reduce-scatter receiving (N - 1) x the target shard; Partial ->
    Replicate one all-reduce, counted with the ring model. None: no single-step expectation."""
    partial = [a for a, p in enumerate(src.placements) if isinstance(p, Partial)]
    if len(partial) != 1:
        return None
    axis = partial[0]
    others = [a for a in range(len(mesh_shape)) if a != axis]
    if any(src.placements[a] != dst.placements[a] for a in others):
        return None
    before = dim_shardings(src, shape, mesh_shape)
    after = dim_shardings(dst, shape, mesh_shape)
    n = mesh_shape[axis]
    target = volume(box(dst, shape, mesh_shape, me)) * ITEMSIZE
    held = volume(box(src, shape, mesh_shape, me)) * ITEMSIZE
    placement = dst.placements[axis]
    if isinstance(placement, Shard):
        if after.pop(placement.dim)[0] != (axis,) or after != before:
            return None
        received, sent, kind = (n - 1) * target, held - target, "reduce_scatter"
    else:
        if after != before:
            return None
        received = sent = 2 * (n - 1) * held // n
        kind = "all_reduce"
    return [
        {
            "calls": {kind: 1},
            "received": {kind: received} if received else {},
            "sent": {kind: sent} if sent else {},
        }
    ]


# --------------------------------------------------------------------------- Partial sources
# The bound for any Partial source, from boxes alone. Each Partial axis of the source must be
# reduced: by a reduce-scatter where it is the innermost axis of a target Shard dim (a rank
# receives (N - 1) pieces of its target box, the least it can), else by an all-reduce, one ring
# over all such axes together (2 (N - 1) / N of the buffer), done where the buffer is smallest:
# on the source boxes, after the box exchange, or, when those axes shard nothing in the target,
# on the target boxes after the reduce-scatters. Between them one box exchange moves what each
# target box lacks. The cheapest of these ways, in bytes received over all ranks, is the bound.
Cost = dict[tuple[int, ...], tuple[int, int]]  # coordinate -> (received, sent) bytes


def _without_axes(
    layout: Layout, axes: Sequence[int], shape, mesh_shape, src: Layout
) -> Layout | None:
    """``layout`` with ``axes`` taken out of their dims' shardings (sizes summed over them)
    and placed as in ``src``; None when one is outside an axis that stays."""
    placements, sizes, order = list(layout.placements), {}, {}
    for dim, (dim_axes, dim_sizes) in dim_shardings(layout, shape, mesh_shape).items():
        kept = tuple(a for a in dim_axes if a not in axes)
        if kept != dim_axes[: len(kept)]:
            return None
        if kept:
            inner = math.prod(mesh_shape[a] for a in dim_axes[len(kept) :])
            sizes[dim] = tuple(
                sum(dim_sizes[i : i + inner]) for i in range(0, len(dim_sizes), inner)
            )
            order[dim] = kept
    for axis in axes:
        placements[axis] = src.placements[axis]
    return Layout(tuple(placements), sizes, order)


def _placed(layout: Layout, axes: Sequence[int], placement: Placement) -> Layout:
    placements = list(layout.placements)
    for axis in axes:
        placements[axis] = placement
    return Layout(tuple(placements), layout.sizes, layout.order)


def _box_exchange(x: Layout, y: Layout, shape, mesh_shape) -> Cost:
    """Each rank receives what its box of ``y`` lacks from its box of ``x``, from the rank
    with its coordinates on every unsharded axis of ``x`` that holds it."""
    fixed = [a for a, p in enumerate(x.placements) if not isinstance(p, Shard)]
    everyone = coordinates(mesh_shape)
    cost = {}
    for me in everyone:
        mine, target = box(x, shape, mesh_shape, me), box(y, shape, mesh_shape, me)
        received = volume(target) - volume(overlap(target, mine))
        sent = sum(
            volume(overlap(mine, box(y, shape, mesh_shape, c)))
            for c in everyone
            if c != me and all(c[a] == me[a] for a in fixed)
        )
        cost[me] = (received * ITEMSIZE, sent * ITEMSIZE)
    return cost


def _ring_all_reduce(axes: Sequence[int], x: Layout, shape, mesh_shape) -> Cost:
    n = math.prod(mesh_shape[a] for a in axes)
    return {
        me: (2 * (n - 1) * volume(box(x, shape, mesh_shape, me)) * ITEMSIZE // n,) * 2
        for me in coordinates(mesh_shape)
    }


def _reduce_scatters(
    start: Layout, dst: Layout, order: Sequence[int], shape, mesh_shape, src: Layout
) -> Cost:
    """Reduce-scatters over ``order``'s axes from ``start`` (those axes Partial) to ``dst``."""
    total: Cost = {}
    current = start
    for k, axis in enumerate(order):
        after = _without_axes(dst, order[k + 1 :], shape, mesh_shape, src)
        for me in coordinates(mesh_shape):
            before, piece = (
                volume(box(current, shape, mesh_shape, me)),
                volume(box(after, shape, mesh_shape, me)),
            )
            step = ((mesh_shape[axis] - 1) * piece * ITEMSIZE, (before - piece) * ITEMSIZE)
            total[me] = _plus(total.get(me, (0, 0)), step)
        current = after
    return total


def _plus(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return a[0] + b[0], a[1] + b[1]


def _sum(*costs: Cost) -> Cost:
    total: Cost = {}
    for cost in costs:
        for me, step in cost.items():
            total[me] = _plus(total.get(me, (0, 0)), step)
    return total


def _scattered_axes(src: Layout, dst: Layout, shape, mesh_shape) -> list[int]:
    """Partial axes that end a target Shard dim's axes (innermost), with those after them."""
    partial = {a for a, p in enumerate(src.placements) if isinstance(p, Partial)}
    scattered = []
    for dim_axes, _ in dim_shardings(dst, shape, mesh_shape).values():
        tail = list(itertools.takewhile(lambda a: a in partial, reversed(dim_axes)))
        scattered += reversed(tail)
    return scattered


def _partial_strategies(src: Layout, dst: Layout, shape, mesh_shape) -> dict[str, Cost]:
    """The communication of each way of NOTE above, by name."""
    partial = [a for a, p in enumerate(src.placements) if isinstance(p, Partial)]
    scattered = _scattered_axes(src, dst, shape, mesh_shape)
    reduced = [a for a in partial if a not in scattered]
    landing = _without_axes(dst, scattered, shape, mesh_shape, src)
    # Reduce-scatters in any order that keeps each dim's outer axes first.
    orders = [
        o
        for o in itertools.permutations(scattered)
        if all(
            o.index(a) < o.index(b)
            for dim_axes, _ in dim_shardings(dst, shape, mesh_shape).values()
            for a, b in itertools.combinations([x for x in dim_axes if x in scattered], 2)
        )
    ]

    def scatters(start: Layout, target: Layout) -> dict[str, Cost]:
        return {
            f"reduce-scatter {o}": _reduce_scatters(start, target, o, shape, mesh_shape, src)
            for o in orders
        }

    ways: dict[str, Cost] = {}
    if not reduced:
        for name, cost in scatters(landing, dst).items():
            ways[f"exchange, {name}"] = _sum(_box_exchange(src, landing, shape, mesh_shape), cost)
        return ways
    first = _placed(src, reduced, Replicate())
    exchange_first = _box_exchange(first, landing, shape, mesh_shape)
    for name, cost in scatters(landing, dst).items():
        ways[f"all-reduce, exchange, {name}"] = _sum(
            _ring_all_reduce(reduced, src, shape, mesh_shape), exchange_first, cost
        )
    middle = _without_axes(landing, reduced, shape, mesh_shape, src)
    if middle is not None:
        after = _box_exchange(_placed(middle, reduced, Replicate()), landing, shape, mesh_shape)
        for name, cost in scatters(landing, dst).items():
            ways[f"exchange, all-reduce, {name}"] = _sum(
                _box_exchange(src, middle, shape, mesh_shape),
                _ring_all_reduce(reduced, middle, shape, mesh_shape),
                after,
                cost,
            )
    if scattered and not any(isinstance(dst.placements[a], Shard) for a in reduced):
        still = _without_axes(landing, reduced, shape, mesh_shape, src)
        final = _without_axes(dst, reduced, shape, mesh_shape, src)
        for name, cost in scatters(still, final).items():
            ways[f"exchange, {name}, all-reduce"] = _sum(
                _box_exchange(src, still, shape, mesh_shape),
                cost,
                _ring_all_reduce(reduced, dst, shape, mesh_shape),
            )
    return ways


# --------------------------------------------------------------------------- one transition
def _close_problems(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> list:
    try:
        torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)
    except AssertionError as exc:
        return [f"{what}: {exc}"]
    return []


def _check_move(
    mesh,
    shape: tuple[int, ...],
    x: ShardTensor,
    src: Layout,
    value: torch.Tensor,
    move: Move,
    dst: Layout | None = None,
) -> tuple[ShardTensor, Layout]:
    """Move ``x`` (layout ``src``, global ``value``) and check its shard against ``dst``
    (default: ``_expected_layout``), its full tensor and the bytes moved. Returns the result
    and its layout."""
    mesh_shape, me = tuple(mesh.shape), tuple(mesh.get_coordinate())
    label = f"{_show(src)} -> {move}"
    with counted_comm(label) as stats:
        y = _apply(x, move, mesh)
    if dst is None:
        dst = _expected_layout(src, move, shape, mesh_shape)
    tol = 1e-12 if any(isinstance(p, Partial) for p in src.placements) else 0.0
    problems = []
    if y.placements != dst.placements:
        problems.append(f"placements {y.placements}, expected {dst.placements}")
    target = narrow(value, box(dst, shape, mesh_shape, me))
    problems += _close_problems(y.to_local().detach(), target, tol, "shard")
    if not any(isinstance(p, Shard) for p in dst.placements) and not y.to_local().is_contiguous():
        # Every rank holds the same tensor: with other strides on some ranks, an op that asks
        # (``_pdist_forward`` requires a contiguous input) raises on those alone.
        problems.append(f"a whole tensor with strides {y.to_local().stride()}, not contiguous")
    problems += _byte_problems(stats, src, dst, shape, mesh_shape, me)
    assert_all_ranks(not problems, f"{label}: " + "; ".join(problems))
    with torch.no_grad():
        full = y.full_tensor()
    assert_close_all_ranks(full, value, atol=tol, rtol=tol, what=f"{label}: full_tensor")
    return y, dst


def _transitions_body(mesh_shape: tuple[int, ...], shape: tuple[int, ...], src: Layout, moves):
    mesh = get_mesh(mesh_shape)
    me = tuple(mesh.get_coordinate())
    for move in moves:
        value, local = _source(src, shape, mesh_shape, me)
        leaf = local.clone().requires_grad_(True)
        x = from_local_spec(leaf, src.spec(mesh, value))
        y, dst = _check_move(mesh, shape, x, src, value, move)
        projection = torch.randn(shape, dtype=torch.float64)
        (y.to_local() * narrow(projection, box(dst, shape, mesh_shape, me))).sum().backward()
        # Partial axes hold the whole extent in ``box``: the Replicate gradient.
        expected = narrow(projection, box(src, shape, mesh_shape, me))
        assert_close_all_ranks(
            leaf.grad, expected, atol=1e-12, rtol=1e-12, what=f"{_show(src)} -> {move}: grad"
        )


@dataclass(frozen=True)
class Case:
    """Sources and targets on one mesh; every source is moved to every target."""

    name: str
    mesh: tuple[int, ...]
    shape: tuple[int, ...]
    sources: tuple[Layout, ...]
    moves: tuple[Move, ...]


def _one_d(n: int, shape: tuple[int, ...], sizes: dict[int, tuple[int, ...]], rebalanced):
    """Shard(0), Shard(1) (given sizes), Shard(2) (torch.chunk), Replicate and Partial sources;
    every Shard and Replicate target, default and rebalanced sizes."""
    sources = (
        Layout((S0,), {0: sizes[0]}),
        Layout((S1,), {1: sizes[1]}),
        Layout((S2,)),
        Layout((R,)),
        Layout((PSUM,)),
        Layout((PAVG,)),
    )
    moves = (
        Move((S0,)),
        Move((S0,), {0: rebalanced[0]}),
        Move((S1,)),
        Move((S1,), {1: rebalanced[1]}),
        Move((Shard(-1),)),
        Move((R,)),
    )
    return Case(f"{n}r", (n,), shape, sources, moves)


CASES = [
    _one_d(2, (7, 5, 3), {0: (5, 2), 1: (4, 1)}, {0: (7, 0), 1: (0, 5)}),
    _one_d(
        4,
        (131, 9, 2),
        {0: (40, 33, 30, 28), 1: (0, 3, 4, 2)},
        {0: (28, 30, 33, 40), 1: (9, 0, 0, 0)},
    ),
    Case(
        "2x2",
        (2, 2),
        (6, 5, 4),
        (
            Layout((S0, S1), {0: (5, 1), 1: (0, 5)}),
            Layout((S1, S0), {1: (2, 3), 0: (4, 2)}),
            Layout((S0, S0), {0: (2, 1, 0, 3)}),
            Layout((S0, S0), {0: (1, 0, 3, 2)}, {0: (1, 0)}),
            Layout((R, S1), {1: (4, 1)}),
            Layout((S2, R), {2: (3, 1)}),
            Layout((R, R)),
            Layout((PSUM, S1), {1: (1, 4)}),
            Layout((S0, PAVG), {0: (2, 4)}),
            Layout((PSUM, PAVG)),
            Layout((PSUM, R)),
        ),
        (
            Move((S0, S1)),
            Move((S1, S0)),
            Move((S0, S0)),
            Move((S0, S0), {0: (3, 0, 1, 2)}, {0: (1, 0)}),
            Move((S0, S0), {0: (0, 4, 1, 1)}, {0: (0, 1)}),
            Move((R, S0)),
            Move((S2, R)),
            Move((R, R)),
            Move((S0, S1), {0: (1, 5), 1: (5, 0)}),
            Move((S1, R), {1: (3, 2)}),
        ),
    ),
    Case(
        "4x2",
        (4, 2),
        (9, 10, 3),
        (
            Layout((S0, S1), {0: (3, 0, 4, 2), 1: (7, 3)}),
            Layout((S0, S0), {0: (2, 0, 1, 1, 0, 3, 2, 0)}, {0: (1, 0)}),
            Layout((PSUM, S0), {0: (5, 4)}),
            Layout((R, S2)),
        ),
        (
            Move((S1, S0)),
            Move((R, S0)),
            Move((S0, R)),
            Move((R, R)),
            Move((S1, S0), {1: (1, 2, 3, 4), 0: (0, 9)}),
        ),
    ),
]
CASES.append(
    Case(
        "2x2x2",
        (2, 2, 2),
        (5, 6, 7),
        (
            Layout((S0, S1, S2), {0: (3, 2), 1: (1, 5), 2: (4, 3)}),
            Layout((S0, S0, S1), {0: (2, 0, 1, 2), 1: (3, 3)}),
            Layout((S0, S0, S0), {0: (1, 0, 2, 0, 1, 0, 0, 1)}, {0: (2, 0, 1)}),
            Layout((R, S2, S0)),
            Layout((PSUM, S1, R), {1: (6, 0)}),
        ),
        (
            Move((S2, S0, S1)),
            Move((R, R, S0)),
            Move((S0, S0, S0)),
            Move((S1, R, S1)),
            Move((R, R, R)),
        ),
    )
)
TRANSITIONS = [(case, source) for case in CASES for source in case.sources]


@pytest.mark.parametrize(
    ("case", "source"), TRANSITIONS, ids=[f"{c.name}-{_show(s)}" for c, s in TRANSITIONS]
)
def test_every_transition(case: Case, source: Layout) -> None:
    run_on_ranks(math.prod(case.mesh), _transitions_body, case.mesh, case.shape, source, case.moves)


# --------------------------------------------------------------------------- round trips
@dataclass(frozen=True)
class RoundTrip:
    """A source moved through ``via`` placements (default sizes) and back to its own."""

    name: str
    mesh: tuple[int, ...]
    shape: tuple[int, ...]
    source: Layout
    via: tuple[tuple[Placement, ...], ...]


ROUND_TRIPS = [
    RoundTrip("2r-70/61-via-S1", (2,), (131, 6), Layout((S0,), {0: (70, 61)}), ((S1,),)),
    RoundTrip("2r-70/61-via-R", (2,), (131, 6), Layout((S0,), {0: (70, 61)}), ((R,),)),
    RoundTrip(
        "4r-40/33/30/28-via-S1-S2",
        (4,),
        (131, 9, 2),
        Layout((S0,), {0: (40, 33, 30, 28)}),
        ((S1,), (S2,)),
    ),
    RoundTrip("4r-0/3/4/2-via-S0", (4,), (5, 9, 2), Layout((S1,), {1: (0, 3, 4, 2)}), ((S0,),)),
    RoundTrip(
        "2x2-swap",
        (2, 2),
        (6, 5, 4),
        Layout((S0, S1), {0: (5, 1), 1: (1, 4)}),
        ((S1, S0),),
    ),
    RoundTrip(
        "2x2-nested-order-1-0-via-R,S1-and-S2,S0",
        (2, 2),
        (6, 5, 4),
        Layout((S0, S0), {0: (1, 0, 3, 2)}, {0: (1, 0)}),
        ((R, S1), (S2, S0)),
    ),
    RoundTrip(
        "4x2-swap-via-R",
        (4, 2),
        (9, 10, 3),
        Layout((S0, S1), {0: (3, 0, 4, 2), 1: (7, 3)}),
        ((S1, S0), (R, R)),
    ),
]


def _round_trip_body(trip: RoundTrip) -> None:
    mesh = get_mesh(trip.mesh)
    mesh_shape, me = trip.mesh, tuple(mesh.get_coordinate())
    value, local = _source(trip.source, trip.shape, mesh_shape, me)
    leaf = local.clone().requires_grad_(True)
    y = from_local_spec(leaf, trip.source.spec(mesh, value))
    layout = trip.source
    for placements in trip.via:
        y, layout = _check_move(mesh, trip.shape, y, layout, value, Move(placements))
    y, _ = _check_move(
        mesh, trip.shape, y, layout, value, Move(trip.source.placements), dst=trip.source
    )
    projection = torch.randn(trip.shape, dtype=torch.float64)
    original = box(trip.source, trip.shape, mesh_shape, me)
    (y.to_local() * narrow(projection, original)).sum().backward()
    assert_close_all_ranks(
        leaf.grad, narrow(projection, original), atol=0, rtol=0, what="grad of the round trip"
    )


@pytest.mark.parametrize("trip", ROUND_TRIPS, ids=lambda t: t.name)
def test_round_trip_restores_sizes(trip: RoundTrip) -> None:
    run_on_ranks(math.prod(trip.mesh), _round_trip_body, trip)


# --------------------------------------------------------------------------- complex values
def _complex_body(mesh_shape: tuple[int, ...], shape: tuple[int, ...], src: Layout, moves):
    """complex64 (8 bytes, as float64) through every move: the shard, the full tensor and
    the bytes as ``_check_move`` checks them, and the gradient of a real projection."""
    mesh = get_mesh(mesh_shape)
    me = tuple(mesh.get_coordinate())
    for move in moves:
        value = torch.randn(shape, dtype=torch.complex64)
        leaf = narrow(value, box(src, shape, mesh_shape, me)).clone().requires_grad_(True)
        y, dst = _check_move(
            mesh, shape, from_local_spec(leaf, src.spec(mesh, value)), src, value, move
        )
        projection = torch.randn(*shape, 2)
        mine = narrow(projection, (*box(dst, shape, mesh_shape, me), (0, 2)))
        (torch.view_as_real(y.to_local()) * mine).sum().backward()
        expected = torch.view_as_complex(
            narrow(projection, (*box(src, shape, mesh_shape, me), (0, 2))).contiguous()
        )
        assert_close_all_ranks(
            leaf.grad, expected, atol=0, rtol=0, what=f"{_show(src)} -> {move}: grad"
        )


COMPLEX_CASES = [
    Case(
        "4r-complex",
        (4,),
        (2, 13, 9),
        (Layout((S1,), {1: (5, 0, 6, 2)}), Layout((S2,)), Layout((R,))),
        (Move((S1,)), Move((S2,)), Move((S1,), {1: (0, 13, 0, 0)}), Move((R,))),
    ),
    Case(
        "2x2-complex",
        (2, 2),
        (6, 5, 4),
        (
            Layout((S0, S1), {0: (5, 1), 1: (0, 5)}),
            Layout((S0, S0), {0: (1, 0, 3, 2)}, {0: (1, 0)}),
        ),
        (Move((S1, S0)), Move((S2, R)), Move((S0, S0)), Move((R, R))),
    ),
]


@pytest.mark.parametrize(
    ("case", "source"),
    [(c, s) for c in COMPLEX_CASES for s in c.sources],
    ids=[f"{c.name}-{_show(s)}" for c in COMPLEX_CASES for s in c.sources],
)
def test_complex_transitions(case: Case, source: Layout) -> None:
    run_on_ranks(math.prod(case.mesh), _complex_body, case.mesh, case.shape, source, case.moves)


# --------------------------------------------------------------------------- literal byte counts
def _literal_bytes_body() -> None:
    """The lower bounds of the brief, written out for one layout: a (131, 9, 2) float64 tensor
    on 4 ranks, rows 40/33/30/28; torch.chunk of the 9 columns is 3/3/3/0."""
    mesh = get_mesh((4,))
    rank = mesh.get_coordinate()[0]
    rows, cols = (40, 33, 30, 28), (3, 3, 3, 0)
    value = torch.randn(131, 9, 2, dtype=torch.float64)
    pieces = [torch.randn(131, 9, 2, dtype=torch.float64) for _ in range(4)]
    start = sum(rows[:rank])
    by_rows = ShardTensor.from_local(value[start : start + rows[rank]], mesh, [S0], {0: list(rows)})
    partial_spec = ShardTensorSpec.build(mesh, [PSUM], value.shape, value.dtype)
    partial = from_local_spec(pieces[rank], partial_spec)
    replicated = ShardTensor.from_local(value, mesh, [R])
    row_bytes, col_bytes = 9 * 2 * 8, 131 * 2 * 8
    checks = [
        ("S0 -> S1", by_rows, [S1], {"all_to_all": 1}, (131 - rows[rank]) * cols[rank] * 2 * 8),
        ("S0 -> R", by_rows, [R], {"all_gather": 1}, (131 - rows[rank]) * row_bytes),
        ("Psum -> S0", partial, [S0], {"reduce_scatter": 1}, 3 * rows[rank] * row_bytes),
        ("Psum -> S1", partial, [S1], {"reduce_scatter": 1}, 3 * cols[rank] * col_bytes),
        ("Psum -> R", partial, [R], {"all_reduce": 1}, 2 * 3 * 131 * row_bytes // 4),
        ("R -> S0", replicated, [S0], {}, 0),
    ]
    problems = []
    for name, x, placements, calls, received in checks:
        sizes = {0: list(rows)} if placements == [S0] else None
        with counted_comm(name) as stats:
            x.redistribute(mesh, placements, sharding_shapes=sizes)
        counted_calls = {k: v for k, v in stats.calls.items() if v}
        if counted_calls != calls or stats.total_received != received:
            problems.append(
                f"{name}: calls {counted_calls}, received {stats.total_received}; expected "
                f"calls {calls}, received {received}"
            )
    assert_all_ranks(not problems, "; ".join(problems))


def test_literal_lower_bounds() -> None:
    run_on_ranks(4, _literal_bytes_body)
