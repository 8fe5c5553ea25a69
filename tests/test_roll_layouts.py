"""``roll`` and ``flip`` along given dims on every layout, against one process, float64:
values, the gradient (a roll the other way, a flip again: the same exchange), the output in
the input's layout (placements and shard sizes), no gather (pytest makes a ``GatherWarning``
an error), and each rank receiving at most the cells that move into its shard from another
along each split dim rolled or flipped (``count_traffic``; nothing when every such dim is
held whole).

A roll along dims held whole of a tensor split elsewhere is local. Before, the handler
declined it and the default path gathered one axis of a dim split over both axes of a 2x2
mesh: ``fftshift`` of a batch-split spectrum in neuraloperator's TFNO and its gradient
(``tests/third_party``, ``tfno-empty`` and ``tfno-2x2``). ``flip`` had the same guard: a flip
along dims held whole of the nested batch gathered one axis of it."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch.distributed.tensor import Shard

from shardsci.handlers import from_local_spec
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    check_against_reference,
    count_traffic,
    get_mesh,
    run_on_ranks,
)

SHAPE = (2, 6, 5)
LAYOUTS = {  # of a SHAPE input
    "2r-uneven": ((2,), Layout((Shard(1),), {1: (4, 2)})),
    "4r-empty": ((4,), Layout((Shard(1),), {1: (2, 0, 3, 1)})),
    "2x2-blocks": ((2, 2), Layout((Shard(1), Shard(2)), {1: (4, 2), 2: (2, 3)})),
    "2x2-nested-batch": ((2, 2), Layout((Shard(0), Shard(0)), {0: (1, 1, 0, 0)})),
}
ROLLS = (  # (shifts, dims): whole dims only, split dims only, both, negative, past the extent
    ((3,), (0,)),
    ((-2,), (2,)),
    ((1, -7), (0, 2)),
    ((3,), (1,)),
    ((-8,), (1,)),
    ((2, 4), (1, 2)),
    ((-1, 13, 2), (2, 1, 0)),
)
FLIPS = ((0,), (2,), (0, 2), (1,), (-2, 0), (2, 1, 0))  # whole only, split only, both


def _rolled(j: int, extent: int, shift: int) -> int:
    return (j - shift) % extent


def _flipped(j: int, extent: int, shift: None) -> int:
    return extent - 1 - j


def _calls() -> list[tuple[str, Callable, tuple]]:
    """``(what, fn, moves)``: each roll and flip, and along which dims its cells come from
    where (``(dim, source, shift)``, ``source(index, extent, shift)`` the global index a cell's
    value comes from)."""
    calls = []
    for shifts, dims in ROLLS:
        moves = tuple((d % len(SHAPE), _rolled, s) for s, d in zip(shifts, dims))
        calls.append((f"roll({shifts}, {dims})", lambda t, s=shifts, d=dims: t.roll(s, d), moves))
    for dims in FLIPS:
        moves = tuple((d % len(SHAPE), _flipped, None) for d in dims)
        calls.append((f"flip({dims})", lambda t, d=dims: t.flip(d), moves))
    return calls


def _bound(layout: Layout, moves: tuple, rank: int) -> int:
    """Bytes of the cells moving into ``rank``'s shard from another's, along every split dim
    of ``moves`` in turn (the neighbour or mirror exchange; float64)."""
    local = list(SHAPE)
    starts = [0] * len(SHAPE)
    for dim, sizes in layout.sizes.items():
        index = _index_along(layout, dim, rank)
        local[dim], starts[dim] = sizes[index], sum(sizes[:index])
    total = 0
    for dim, source, shift in moves:
        if dim not in layout.sizes:
            continue
        own = range(starts[dim], starts[dim] + local[dim])
        incoming = sum(1 for j in own if source(j, SHAPE[dim], shift) not in own)
        total += incoming * math.prod(n for d, n in enumerate(local) if d != dim)
    return total * 8


def _index_along(layout: Layout, dim: int, rank: int) -> int:
    """``rank``'s index among the shards of ``dim``: flat over the mesh axes sharding it, in
    order (a 1-D mesh or a 2x2 one, row-major)."""
    axes = [axis for axis, p in enumerate(layout.placements) if p == Shard(dim)]
    shape = (2, 2) if len(layout.placements) == 2 else (len(layout.sizes[dim]),)
    coords = [rank // 2, rank % 2] if len(shape) == 2 else [rank]
    index = 0
    for axis in axes:
        index = index * shape[axis] + coords[axis]
    return index


def _body(name: str, op: str) -> None:
    mesh_shape, layout = LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(SHAPE, dtype=torch.float64)
    spec = layout.spec(mesh, x)
    shard = from_local_spec(spec.narrow(x).contiguous(), spec)
    rank = torch.distributed.get_rank()
    for call, fn, moves in _calls():
        if not call.startswith(op):
            continue
        what = f"{name}: {call}"
        check_against_reference(fn, [x], [layout], mesh, out_layouts=[layout], what=what)
        with count_traffic() as traffic:
            fn(shard)
        bound = _bound(layout, moves, rank)
        assert_all_ranks(
            traffic.received <= bound,
            f"{what}: rank {rank} received {traffic.received} bytes; the cells moving into "
            f"its shard are {bound}",
        )


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_roll_keeps_the_layout_and_moves_only_the_crossing_cells(name: str) -> None:
    run_on_ranks(math.prod(LAYOUTS[name][0]), _body, name, "roll")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_flip_keeps_the_layout_and_moves_only_the_mirrored_cells(name: str) -> None:
    run_on_ranks(math.prod(LAYOUTS[name][0]), _body, name, "flip")
