"""``roll`` along given dims on every layout, against one process, float64: values, the
gradient (a roll the other way: the same exchange), the output in the input's layout
(placements and shard sizes), no gather (pytest makes a ``GatherWarning`` an error), and each
rank receiving at most the cells that roll into its shard from another along each split
rolled dim (``count_traffic``; nothing when every rolled dim is held whole).

A roll along dims held whole of a tensor split elsewhere is local. Before, the handler
declined it and the default path gathered one axis of a dim split over both axes of a 2x2
mesh: ``fftshift`` of a batch-split spectrum in neuraloperator's TFNO and its gradient
(``tests/third_party``, ``tfno-empty`` and ``tfno-2x2``)."""

from __future__ import annotations

import math

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


def _bound(layout: Layout, shifts: tuple[int, ...], dims: tuple[int, ...], rank: int) -> int:
    """Bytes of the cells rolling into ``rank``'s shard from another's, along every split
    rolled dim in turn (the neighbour exchange; float64)."""
    local = list(SHAPE)
    starts = [0] * len(SHAPE)
    for dim, sizes in layout.sizes.items():
        index = _index_along(layout, dim, rank)
        local[dim], starts[dim] = sizes[index], sum(sizes[:index])
    total = 0
    for shift, dim in zip(shifts, dims):
        if dim not in layout.sizes:
            continue
        extent = SHAPE[dim]
        own = range(starts[dim], starts[dim] + local[dim])
        incoming = sum(1 for j in own if (j - shift) % extent not in own)
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


def _body(name: str) -> None:
    mesh_shape, layout = LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(SHAPE, dtype=torch.float64)
    spec = layout.spec(mesh, x)
    shard = from_local_spec(spec.narrow(x).contiguous(), spec)
    rank = torch.distributed.get_rank()
    for shifts, dims in ROLLS:
        what = f"{name}: roll({shifts}, {dims})"
        check_against_reference(
            lambda t, s=shifts, d=dims: t.roll(s, d), [x], [layout], mesh, out_layouts=[layout],
            what=what,
        )  # fmt: skip
        with count_traffic() as traffic:
            shard.roll(shifts, dims)
        bound = _bound(layout, shifts, dims, rank)
        assert_all_ranks(
            traffic.received <= bound,
            f"{what}: rank {rank} received {traffic.received} bytes; the cells rolling into "
            f"its shard are {bound}",
        )


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_roll_keeps_the_layout_and_moves_only_the_crossing_cells(name: str) -> None:
    run_on_ranks(math.prod(LAYOUTS[name][0]), _body, name)
