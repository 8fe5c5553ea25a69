"""A contraction over a split dim that one rank holds whole, against one process in float64
(NOTE [A sum over a dim one rank holds stays with that rank] in
``shardsci/tensor/_ops/_common.py``): values, every gradient, and the output held by that rank
alone (sharded along a dim it has whole, the others' shards empty), on 1-D, nested and 2x2
layouts; a 0-d output stays a pending sum; no byte received in the forward
(``count_traffic``)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
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

# name -> (mesh, fn of (x, w), x's shape, w's shape, x's layout, the output's layout)
CASES = {
    # a vector on one rank of four, as linear's op-database sample 8 on 4r-random
    "linear-vector-bias": (
        (4,),
        lambda x, w: F.linear(x, w, torch.arange(4.0, dtype=x.dtype)),
        (3,),
        (4, 3),
        Layout((Shard(0),), {0: (0, 0, 3, 0)}),
        parse("S0; 0=0/0/4/0"),
    ),
    "linear-rows": (
        (4,),
        lambda x, w: F.linear(x, w),
        (2, 5),
        (4, 5),
        Layout((Shard(1),), {1: (0, 5, 0, 0)}),
        parse("S0; 0=0/2/0/0"),
    ),
    "matmul-dot": (  # 0-d: no dim carries the holder's axes, a pending sum stays
        (4,),
        lambda x, w: x @ w,
        (3,),
        (3,),
        Layout((Shard(0),), {0: (3, 0, 0, 0)}),
        parse("P"),
    ),
    "einsum-2x2": (  # the rows stay split over axis 0; axis 1's holder takes the columns
        (2, 2),
        lambda x, w: torch.einsum("ij,kj->ik", x, w),
        (3, 4),
        (5, 4),
        Layout((Shard(0), Shard(1)), {0: (2, 1), 1: (0, 4)}),
        parse("S0,S1; 0=2/1; 1=0/5"),
    ),
    "linear-nested-2x2": (  # one holder of four over both axes, nested
        (2, 2),
        lambda x, w: F.linear(x, w),
        (3, 4),
        (5, 4),
        Layout((Shard(1), Shard(1)), {1: (0, 0, 4, 0)}),
        parse("S0,S0; 0=0/0/3/0"),
    ),
    "matmul-nested-2x2": (  # the output's one dim split already: the holder's axis nests over it
        (2, 2),
        lambda x, w: x @ w,
        (3, 4),
        (4,),
        Layout((Shard(0), Shard(1)), {0: (2, 1), 1: (0, 4)}),
        parse("S0,S0; 0[1,0]=0/0/2/1"),
    ),
    "mm-columns": (  # aten.mm with split columns (multi_dot, autograd)
        (4,),
        lambda x, w: torch.ops.aten.mm.default(x, w),
        (3, 2),
        (2, 2),
        Layout((Shard(1),), {1: (0, 2, 0, 0)}),
        parse("S0; 0=0/3/0/0"),
    ),
}


def _body(name: str) -> None:
    mesh_shape, fn, x_shape, w_shape, layout, expected = CASES[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(x_shape, dtype=torch.float64)
    w = torch.randn(w_shape, dtype=torch.float64)
    check_against_reference(fn, [x, w], [layout, None], mesh, out_layouts=[expected], what=name)
    spec = layout.spec(mesh, x)
    shard = from_local_spec(spec.narrow(x).contiguous(), spec)
    with count_traffic() as traffic:
        fn(shard, w)
    assert_all_ranks(traffic.received == 0, f"{name}: received {traffic.received} bytes")


@pytest.mark.parametrize("name", list(CASES))
def test_a_sum_one_rank_holds_stays_with_it(name: str) -> None:
    run_on_ranks(math.prod(CASES[name][0]), _body, name)
