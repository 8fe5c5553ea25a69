"""A view of a tensor whose dim one rank holds whole keeps it on that rank (NOTE [A dim one
rank holds is whole on that rank] in ``shardsci/tensor/_ops/_common.py``), against one process
in float64: values, every gradient, the output's layout, and no byte received in the forward
(``count_traffic``), on 2 ranks, a 2x2 and a 2x2x2 mesh: views of a held dim (forwarded,
flattened as the outer or the inner dim, split, a dim of extent 1 dropped) and views of a
contraction's output held by one rank (NOTE [A sum over a dim one rank holds stays with that
rank]), as Transolver's slice tokens meet ``linear``'s view on a 2x2x2 block; and products of
two held operands (NOTE [A product of held operands runs on their holder] in
``shardsci/tensor/_ops/_matmul_ops.py``)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

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

# name -> (mesh, fn of the inputs, their shapes, their layouts (None: a plain tensor), the
# output's layout)
CASES = {
    "flatten-held-outer": (
        (2,),
        lambda x: x.reshape(6, 4),
        [(2, 3, 4)],
        [Layout((Shard(0),), {0: (2, 0)})],
        parse("S0; 0=6/0"),
    ),
    "flatten-held-inner": (  # was an all-to-all moving the axis onto dim 0
        (2,),
        lambda x: x.reshape(6, 4),
        [(3, 2, 4)],
        [Layout((Shard(1),), {1: (0, 2)})],
        parse("S0; 0=0/6"),
    ),
    "unflatten-held": (
        (2,),
        lambda x: x.unflatten(0, (2, 3)),
        [(6, 4)],
        [Layout((Shard(0),), {0: (0, 6)})],
        parse("S0; 0=0/2"),
    ),
    "drop-extent-1": (  # a held dim of extent 1 is in no view group: was replicated
        (2,),
        lambda x: x.reshape(3, 4),
        [(1, 3, 4)],
        [Layout((Shard(0),), {0: (1, 0)})],
        parse("S0; 0=3/0"),
    ),
    "linear-then-view": (  # held on its dim 0 of extent 1, then flattened (Transolver's q)
        (2,),
        lambda x, w: F.linear(x, w).reshape(6, 5),
        [(1, 2, 3, 4), (5, 4)],
        [Layout((Shard(3),), {3: (4, 0)}), None],
        parse("S0; 0=6/0"),
    ),
    "linear-then-view-2x2": (  # axis 1 holds, axis 0 splits the heads: nested outermost
        (2, 2),
        lambda x, w: F.linear(x, w).reshape(6, 5),
        [(1, 2, 3, 4), (5, 4)],
        [Layout((Shard(1), Shard(3)), {1: (1, 1), 3: (0, 4)}), None],
        parse("S0,S0; 0[1,0]=0/0/3/3"),
    ),
    "einsum-then-view-2x2x2": (  # the third axis holds its dim whole, kept through both
        (2, 2, 2),
        lambda x, w: torch.einsum("bhwc,kc->bhwk", x, w).reshape(2, 12, 5),
        [(2, 3, 4, 6), (5, 6)],
        [Layout((Shard(0), Shard(1), Shard(3)), {0: (1, 1), 1: (1, 2), 3: (6, 0)}), None],
        parse("S0,S1,S1; 0=1/1; 1[2,1]=4/8/0/0"),
    ),
    "einsum-over-held-then-view-2x2x2": (  # summed over the held dim: held on a free dim
        (2, 2, 2),
        lambda x, w: torch.einsum("bhwc,wk->bhk", x, w).reshape(2, 15),
        [(2, 3, 4, 6), (4, 5)],
        [Layout((Shard(0), Shard(1), Shard(2)), {0: (1, 1), 1: (1, 2), 2: (0, 4)}), None],
        parse("S0,S1,S1; 0=1/1; 1[2,1]=0/0/5/10"),
    ),
    # Two held operands, one holder (Transolver's deslice: the held tokens meet the field
    # held along W): the output is held on the field's letter. Was declined: gathered.
    "einsum-two-held": (
        (2,),
        lambda t, x: torch.einsum("bm,zbm->zb", t, x),
        [(2, 3), (4, 2, 3)],
        [Layout((Shard(0),), {0: (2, 0)}), Layout((Shard(0),), {0: (4, 0)})],
        parse("S0; 0=4/0"),
    ),
    "einsum-two-held-2x2x2": (
        (2, 2, 2),
        lambda t, x: torch.einsum("bmc,byzm->byzc", t, x),
        [(2, 3, 5), (2, 4, 6, 3)],
        [
            Layout((Shard(0), Replicate(), Shard(1)), {0: (1, 1), 1: (3, 0)}),
            Layout((Shard(0), Shard(1), Shard(2)), {0: (1, 1), 1: (1, 3), 2: (6, 0)}),
        ],
        parse("S0,S1,S2; 0=1/1; 1=1/3; 2=6/0"),
    ),
}


def _body(name: str) -> None:
    mesh_shape, fn, shapes, layouts, expected = CASES[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    inputs = [torch.randn(shape, dtype=torch.float64) for shape in shapes]
    check_against_reference(fn, inputs, layouts, mesh, out_layouts=[expected], what=name)
    shards = []
    for t, layout in zip(inputs, layouts):
        spec = None if layout is None else layout.spec(mesh, t)
        shards.append(t if spec is None else from_local_spec(spec.narrow(t).contiguous(), spec))
    with count_traffic() as traffic:
        fn(*shards)
    assert_all_ranks(traffic.received == 0, f"{name}: received {traffic.received} bytes")


@pytest.mark.parametrize("name", list(CASES))
def test_a_held_dim_stays_on_its_holder(name: str) -> None:
    run_on_ranks(math.prod(CASES[name][0]), _body, name)
