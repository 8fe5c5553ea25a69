"""``v @ A`` with a plain ``v`` and ``A`` batched and sharded along its last two dims, as
``Tensor.__matmul__`` and as ``A.__rmatmul__(v)`` (Python's reflected call when the left
operand declines; PyTorch's op database calls it directly), against one process in float64:
values, both gradients and the output's layout. The product is taken as an einsum, so a split of ``A``'s columns stays on
the output's last dim (``at::matmul`` would fold ``A``'s batch dims into its rows and bring
that split back on the batch dim) and a split of the contracted rows is a pending sum over
its axes; nothing is gathered, forward or backward (the gather guard set to "error"). On a
2x2 mesh uneven in opposite directions and on 4 ranks with an empty shard."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import Partial, Shard

from shardsci import gather_policy
from shardsci.testing import Layout, check_against_reference, get_mesh, run_on_ranks

CASES = {
    # A (5, 10, 5) sharded along rows (4 | 6) and columns (3 | 2)
    "2x2": (
        (2, 2),
        (5, 10, 5),
        Layout((Shard(1), Shard(2)), {1: (4, 6), 2: (3, 2)}),
        {
            "v @ A": ((10,), Layout((Partial(), Shard(1)), {1: (3, 2)})),
            "M @ A, batched": ((5, 10), Layout((Partial(), Shard(2)), {2: (3, 2)})),
        },
    ),
    # A (2, 3, 6, 7) sharded along its columns, one rank empty
    "4r-empty": (
        (4,),
        (2, 3, 6, 7),
        Layout((Shard(3),), {3: (3, 0, 1, 3)}),
        {
            "v @ A": ((6,), Layout((Shard(2),), {2: (3, 0, 1, 3)})),
            "M @ A, broadcast": ((4, 6), Layout((Shard(3),), {3: (3, 0, 1, 3)})),
        },
    ),
}


def _body(name: str) -> None:
    mesh_shape, shape, layout, products = CASES[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    a = torch.randn(*shape, dtype=torch.float64)
    for what, (left_shape, expected) in products.items():
        left = torch.randn(*left_shape, dtype=torch.float64)
        # ``left`` needs a gradient too: at::matmul folds ``A`` then (and not otherwise)
        calls = {"@": lambda m, v: v @ m, "__rmatmul__": lambda m, v: m.__rmatmul__(v)}
        for form, call in calls.items():
            with gather_policy("error"):  # forward and backward
                check_against_reference(
                    call,
                    [a, left],
                    [layout, None],
                    mesh,
                    out_layouts=[expected],
                    what=f"{name}: {what} {form}",
                )


@pytest.mark.parametrize("name", list(CASES))
def test_a_plain_operand_times_a_batched_sharded_matrix_keeps_its_columns_split(
    name: str,
) -> None:
    run_on_ranks(math.prod(CASES[name][0]), _body, name)
