"""A product over sharded columns, as ``linalg.multi_dot`` and ``aten.mm`` reach it, against
one process in float64 (NOTE [A product over sharded columns is a pending sum] in
``shardsci/tensor/_ops/_matmul_ops.py``): values, every gradient, the output pending a sum over
the column axes with the rows' sizes kept, on uneven, empty and 2x2 layouts; and no byte
received in the forward (``count_traffic``)."""

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
from tests.expected_layouts import parse
from tests.stated_gathers import allowed_if, pending

# Of a (3, 2) matrix (DTensor's rule gathers it; it pends a (3, 4) one's sum) -> the
# product's expected layout.
LAYOUTS = {
    "2r-columns-1/1": ((2,), Layout((Shard(1),), {1: (1, 1)}), parse("P")),
    "4r-columns-0/2/0/0": ((4,), Layout((Shard(1),), {1: (0, 2, 0, 0)}), parse("S0; 0=0/3/0/0")),
    "4r-columns-1/0/0/1": ((4,), Layout((Shard(1),), {1: (1, 0, 0, 1)}), parse("P")),
    "2x2-rows-columns": (
        (2, 2),
        Layout((Shard(0), Shard(1)), {0: (2, 1), 1: (1, 1)}),
        parse("S0,P; 0=2/1"),
    ),
}
CALLS = {
    "multi_dot": lambda x, b, c: torch.linalg.multi_dot([x, b, c]),
    "aten.mm": lambda x, b, c: torch.ops.aten.mm.default(x, b),
}


def _body(name: str) -> None:
    mesh_shape, layout, expected = LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x, b, c = torch.randn(3, 2, dtype=torch.float64), *torch.randn(2, 2, 2, dtype=torch.float64)
    # A pending product holds each rank's sum whole: the guard counts it (NOTE [Gathers an op
    # was not asked to make]), and these cases state it.
    for what, fn in CALLS.items():
        with allowed_if(pending(expected)):
            check_against_reference(
                fn, [x, b, c], [layout, None, None], mesh, out_layouts=[expected],
                what=f"{name}: {what}",
            )  # fmt: skip
    spec = layout.spec(mesh, x)
    shard = from_local_spec(spec.narrow(x).contiguous(), spec)
    with count_traffic() as traffic, allowed_if(pending(expected)):
        CALLS["multi_dot"](shard, b, c)
    assert_all_ranks(traffic.received == 0, f"{name}: received {traffic.received} bytes")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_product_over_sharded_columns_is_pending(name: str) -> None:
    run_on_ranks(math.prod(LAYOUTS[name][0]), _body, name)
