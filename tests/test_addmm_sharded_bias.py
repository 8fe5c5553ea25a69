"""``addmm`` with a sharded bias and replicated matrices against one process, float64 (NOTE [A
sharded bias keeps its blocks]): values, the three gradients, the output in the bias's layout
(placements and shard sizes) on rows, columns with an empty shard and 2x2 blocks, and no byte
received by ``count_traffic``."""

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

LAYOUTS = {  # of a (3, 3) bias
    "2r-rows": ((2,), Layout((Shard(0),), {0: (2, 1)})),
    "4r-columns-empty": ((4,), Layout((Shard(1),), {1: (0, 1, 1, 1)})),
    "2x2-blocks": ((2, 2), Layout((Shard(0), Shard(1)), {0: (2, 1), 1: (1, 2)})),
}


def _body(name: str) -> None:
    mesh_shape, layout = LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    bias, mat1, mat2 = torch.randn(3, 3, 3, dtype=torch.float64).unbind()
    calls = {
        "torch.addmm": lambda b, m1, m2: torch.addmm(b, m1, m2, beta=0.2, alpha=0.6),
        "Tensor.addmm": lambda b, m1, m2: b.addmm(m1, m2),
    }
    for what, fn in calls.items():
        check_against_reference(
            fn, [bias, mat1, mat2], [layout, None, None], mesh, out_layouts=[layout],
            what=f"{name}: {what}",
        )  # fmt: skip
    spec = layout.spec(mesh, bias)
    shard = from_local_spec(spec.narrow(bias).contiguous(), spec)
    with count_traffic() as traffic:
        torch.addmm(shard, mat1, mat2)
    assert_all_ranks(traffic.received == 0, f"{name}: received {traffic.received} bytes")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_addmm_keeps_a_sharded_bias_layout(name: str) -> None:
    run_on_ranks(math.prod(LAYOUTS[name][0]), _body, name)
