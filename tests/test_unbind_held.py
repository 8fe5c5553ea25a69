"""``unbind`` along a sharded dim against one process, float64 (NOTE [An unbound slice stays
with its holder]): values, the gradient (``unbind``'s backward stacks the slices), each slice
sharded along the first whole dim (else the first other dim, the dim's axes nested outermost)
with its holder holding all of it (before, the dim was all-gathered and every rank held every
slice), no byte received (``count_traffic``), and ``stack`` of the slices back in the input's
layout; on uneven rows, rows with empty shards, rows nested over both axes of a 2x2 mesh, 2x2
blocks of a 3-D field, and with no whole dim: 2x2 blocks of a 2-D field (in either axis
order), rows with an empty shard nested over two axes of a 2x2x2 mesh beside columns split
over the third, and every dim of a 3-D field split on a 2x2x2 mesh. (Where every row lies on
one rank and the other dims' split is itself held by one rank, ``stack`` returns an
equivalent layout of the same cells on the same rank, not the input's spec.)"""

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

CASES = {  # name: mesh, input shape, input layout, per slice: its layout given its holder
    "2r-rows-uneven": ((2,), (5, 4), Layout((Shard(0),), {0: (2, 3)})),
    "4r-rows-empty": ((4,), (5, 4), Layout((Shard(0),), {0: (0, 2, 1, 2)})),
    "2x2-rows-nested": ((2, 2), (5, 4), Layout((Shard(0), Shard(0)), {0: (1, 0, 3, 1)})),
    "2x2-blocks-3d": ((2, 2), (3, 5, 4), Layout((Shard(0), Shard(1)), {0: (1, 2), 1: (3, 2)})),
    "2x2-blocks-2d": ((2, 2), (5, 4), Layout((Shard(0), Shard(1)), {0: (2, 3), 1: (3, 1)})),
    "2x2-blocks-swapped": ((2, 2), (5, 4), Layout((Shard(1), Shard(0)), {0: (2, 3), 1: (3, 1)})),
    "2x2x2-rows-empty": (
        (2, 2, 2),
        (5, 5),
        Layout((Shard(0), Shard(0), Shard(1)), {0: (0, 2, 1, 2), 1: (3, 2)}),
    ),
    "2x2x2-all-split": (
        (2, 2, 2),
        (3, 5, 4),
        Layout((Shard(0), Shard(1), Shard(2)), {0: (1, 2), 1: (3, 2), 2: (3, 1)}),
    ),
}


def _axes(layout: Layout, dim: int) -> tuple[int, ...]:
    """The mesh axes sharding ``dim``, outermost first."""
    return tuple(layout.order.get(dim, ())) or tuple(
        a for a, p in enumerate(layout.placements) if isinstance(p, Shard) and p.dim == dim
    )


def _slice_layouts(layout: Layout, shape: tuple[int, ...]) -> list[Layout]:
    """Slice ``i`` of dim 0: dim 0's axes shard the first dim the input holds whole, else dim 1
    (in the slice's numbering), nested outermost, all of it on the coordinate holding row
    ``i``; other dims renumbered."""
    sizes = layout.sizes[0]
    carrier = next((d for d in range(1, len(shape)) if d not in layout.sizes), 1)
    e = carrier - 1
    placements = tuple(
        (Shard(e) if p.dim == 0 else Shard(p.dim - 1)) if isinstance(p, Shard) else p
        for p in layout.placements
    )
    others = {d - 1: s for d, s in layout.sizes.items() if d != 0}
    inner = tuple(layout.sizes.get(carrier, (shape[carrier],)))
    order = {e: (*_axes(layout, 0), *_axes(layout, carrier))}
    holders = [k for k, n in enumerate(sizes) for _ in range(n)]
    return [
        Layout(
            placements,
            {**others, e: tuple(n if k == h else 0 for k in range(len(sizes)) for n in inner)},
            order=order,
        )
        for h in holders
    ]


def _body(name: str) -> None:
    mesh_shape, shape, layout = CASES[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64)
    slices = _slice_layouts(layout, shape)
    check_against_reference(
        lambda t: t.unbind(0), [x], [layout], mesh, out_layouts=slices, what=f"{name}: unbind"
    )
    check_against_reference(
        lambda t: torch.stack([s * 2 for s in t.unbind(0)]), [x], [layout], mesh,
        out_layouts=[layout], what=f"{name}: stack(unbind)",
    )  # fmt: skip
    spec = layout.spec(mesh, x)
    shard = from_local_spec(spec.narrow(x).contiguous(), spec)
    with count_traffic() as traffic:
        shard.unbind(0)
    assert_all_ranks(traffic.received == 0, f"{name}: unbind received {traffic.received} bytes")


@pytest.mark.parametrize("name", list(CASES))
def test_unbind_keeps_each_slice_with_its_holder(name: str) -> None:
    run_on_ranks(math.prod(CASES[name][0]), _body, name)
