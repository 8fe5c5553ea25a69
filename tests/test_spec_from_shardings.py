"""``ShardTensorSpec.from_shardings``: the one constructor of a spec from its dims'
shardings (the attention layouts, the embedding lookup's), the same interned spec as
``build`` given the placements, sizes and axis order it derives."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardsci.tensor import ShardTensorSpec
from shardsci.tensor._spec import DimSharding
from shardsci.testing import assert_all_ranks, assert_raises_all_ranks, get_mesh, run_on_ranks


def _body() -> None:
    mesh = get_mesh((2, 2))
    shape, dtype = (12, 3, 5), torch.float64
    cases = {
        "nested, inner axis first": (
            [DimSharding(0, (1, 0), (4, 1, 0, 7))],
            (),
            ShardTensorSpec.build(
                mesh, [Shard(0), Shard(0)], shape, dtype, {0: (4, 1, 0, 7)}, order={0: (1, 0)}
            ),
        ),
        "one dim split, a pending sum on the other axis": (
            [DimSharding(2, (1,), (5, 0))],
            (0,),
            ShardTensorSpec.build(mesh, [Partial(), Shard(2)], shape, dtype, {2: (5, 0)}),
        ),
        "nothing split": ([], (), ShardTensorSpec.build(mesh, [Replicate()] * 2, shape, dtype)),
    }
    built = {
        name: ShardTensorSpec.from_shardings(mesh, shardings, shape, dtype, pending=pending)
        for name, (shardings, pending, _) in cases.items()
    }
    differ = [name for name, (_, _, expected) in cases.items() if built[name] is not expected]
    assert_all_ranks(not differ, f"not the spec build gives: {differ}")
    assert_raises_all_ranks(
        ValueError,
        "sum to 6, but the global size of that dim is 12",
        lambda: ShardTensorSpec.from_shardings(mesh, [DimSharding(0, (0,), (5, 1))], shape, dtype),
    )


def test_from_shardings_is_the_spec_build_gives() -> None:
    run_on_ranks(4, _body)
