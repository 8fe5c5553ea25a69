"""``F.embedding`` of a table split along its vocabulary, its embedding dim or both, the
indices whole or split over other mesh axes, against one process in float64 (NOTE [A split
table is looked up where it lies] in ``shardsci/tensor/_ops/_embedding_ops.py``): values, the
table's gradient, the lookup's layout, and a forward that moves no byte (``count_traffic``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

from shardsci.tensor._api import from_local_spec
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    check_against_reference,
    count_traffic,
    get_mesh,
    run_on_ranks,
)
from tests.stated_gathers import allowed_if, pending

VOCABULARY, WIDTH, INDICES = 10, 6, (4, 3)
# name -> (mesh, table layout, indices layout or None, lookup layout)
CASES = {
    "2r-rows-4/6": ((2,), Layout((Shard(0),), {0: (4, 6)}), None, Layout((Partial(),))),
    "4r-rows-0/5/5/0": ((4,), Layout((Shard(0),), {0: (0, 5, 5, 0)}), None, Layout((Partial(),))),
    "4r-columns-0/3/2/1": (
        (4,),
        Layout((Shard(1),), {1: (0, 3, 2, 1)}),
        None,
        Layout((Shard(2),), {2: (0, 3, 2, 1)}),
    ),
    "2x2-rows-and-columns": (
        (2, 2),
        Layout((Shard(0), Shard(1)), {0: (7, 3), 1: (2, 4)}),
        None,
        Layout((Partial(), Shard(2)), {2: (2, 4)}),
    ),
    "2x2-indices-and-rows": (
        (2, 2),
        Layout((Replicate(), Shard(0)), {0: (3, 7)}),
        Layout((Shard(0), Replicate()), {0: (1, 3)}),
        Layout((Shard(0), Partial()), {0: (1, 3)}),
    ),
}


def _lookup_body(name: str, padding_idx: int | None) -> None:
    mesh_shape, table_layout, index_layout, lookup_layout = CASES[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    table = torch.randn(VOCABULARY, WIDTH, dtype=torch.float64)
    indices = torch.randint(0, VOCABULARY, INDICES)
    indices[0, 0] = 4  # the padding row, looked up at least once
    # A pending lookup of every index (12) on each rank holds as much as the table gathered
    # along its vocabulary (10 rows): the guard counts it, a pending sum held whole (NOTE
    # [Gathers an op was not asked to make]). No byte moves for it (count_traffic, below).
    held_whole = (
        index_layout is None and pending(lookup_layout) and math.prod(INDICES) >= VOCABULARY
    )
    with allowed_if(held_whole):
        check_against_reference(
            lambda t, i: F.embedding(i, t, padding_idx=padding_idx),
            [table, indices],
            [table_layout, index_layout],
            mesh,
            out_layouts=[lookup_layout],
            what=f"{name} padding {padding_idx}",
        )
    spec = table_layout.spec(mesh, table)
    sharded = from_local_spec(spec.narrow(table), spec)
    if index_layout is not None:
        index_spec = index_layout.spec(mesh, indices)
        indices = from_local_spec(index_spec.narrow(indices), index_spec)
    with count_traffic() as traffic, allowed_if(held_whole):
        F.embedding(indices, sharded, padding_idx=padding_idx)
    assert_all_ranks(
        traffic.received == 0 and traffic.collective_calls == 0,
        f"{name}: the lookup received {traffic.as_dict()}; expected nothing",
    )


@pytest.mark.parametrize("padding_idx", [None, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_split_table_lookup(name: str, padding_idx: int | None) -> None:
    run_on_ranks(math.prod(CASES[name][0]), _lookup_body, name, padding_idx)
