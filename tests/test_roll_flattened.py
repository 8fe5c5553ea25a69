"""``roll`` without dims (torch rolls the tensor in flat, row-major order) on a tensor sharded
along its leading dim, against one process, float64: values, the gradient, the output in the
input's layout (placements and shard sizes; before, it came back replicated: every rank held
the whole tensor), and each rank receiving only the cells that roll into its shard from
another (``count_traffic``), on uneven rows, rows with an empty shard and rows split over both
axes of a 2x2 mesh, for shifts within a row, across rows, negative and beyond the size."""

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

SHAPE = (4, 3, 5)
LAYOUTS = {  # of a SHAPE input
    "2r-rows-uneven": ((2,), Layout((Shard(0),), {0: (1, 3)})),
    "4r-rows-empty": ((4,), Layout((Shard(0),), {0: (2, 0, 1, 1)})),
    "2x2-rows-nested": ((2, 2), Layout((Shard(0), Shard(0)), {0: (1, 0, 2, 1)})),
}
SHIFTS = (2, 17, -4, 67)


def _received_cells(sizes: tuple[int, ...], rank: int, shift: int) -> int:
    """The flat cells that roll into ``rank``'s run of the flat order from another's."""
    row = math.prod(SHAPE[1:])
    total = math.prod(SHAPE)
    start = sum(sizes[:rank]) * row
    own = range(start, start + sizes[rank] * row)
    return sum(1 for j in own if (j - shift) % total not in own)


def _body(name: str) -> None:
    mesh_shape, layout = LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(SHAPE, dtype=torch.float64)
    spec = layout.spec(mesh, x)
    shard = from_local_spec(spec.narrow(x).contiguous(), spec)
    rank = torch.distributed.get_rank()
    for shift in SHIFTS:
        check_against_reference(
            lambda t, s=shift: t.roll(s), [x], [layout], mesh, out_layouts=[layout],
            what=f"{name}: roll({shift})",
        )  # fmt: skip
        with count_traffic() as traffic:
            shard.roll(shift)
        expected = _received_cells(layout.sizes[0], rank, shift) * x.element_size()
        assert_all_ranks(
            traffic.received == expected,
            f"{name}: roll({shift}): rank {rank} received {traffic.received} bytes; "
            f"the cells rolling into its shard are {expected}",
        )


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_flat_roll_keeps_the_rows_layout(name: str) -> None:
    run_on_ranks(math.prod(LAYOUTS[name][0]), _body, name)
