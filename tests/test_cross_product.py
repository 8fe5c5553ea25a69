"""``torch.cross`` and ``torch.linalg.cross`` of vector fields (the curl-like products of
vorticity) on ShardTensors, against one process in float64: values, both operands' gradients
and the output's layout, which is the fields' own (placements and shard sizes), with nothing
gathered, forward or backward (the gather guard set to "error"). Fields of shape
``(B, 3, H, W)`` split along H unevenly with an empty shard, in 2x2 blocks on H x W uneven in
opposite directions, and with the size-3 component dim itself split (its split kept: each
rank receives only the components its rotated copies need)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import Shard

from shardsci import gather_policy
from shardsci.testing import Layout, check_against_reference, get_mesh, run_on_ranks

SHAPE = (2, 3, 7, 5)
LAYOUTS = {
    "4r-empty-H": ((4,), Layout((Shard(2),), {2: (3, 0, 2, 2)})),
    "2x2-HW": ((2, 2), Layout((Shard(2), Shard(3)), {2: (5, 2), 3: (1, 4)})),
    "4r-components": ((4,), Layout((Shard(1),), {1: (1, 0, 1, 1)})),
    "2x2-components-and-W": ((2, 2), Layout((Shard(1), Shard(3)), {1: (2, 1), 3: (3, 2)})),
}


def _body(name: str) -> None:
    mesh_shape, layout = LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    u, w = torch.randn(*SHAPE, dtype=torch.float64), torch.randn(*SHAPE, dtype=torch.float64)
    calls = {
        "torch.cross": lambda a, b: torch.cross(a, b, dim=1),
        "linalg.cross, a negative dim": lambda a, b: torch.linalg.cross(a, b, dim=-3),
    }
    for what, call in calls.items():
        with gather_policy("error"):  # forward and backward
            check_against_reference(
                call, [u, w], [layout, layout], mesh, out_layouts=[layout], what=f"{name}: {what}"
            )


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_cross_product_of_vector_fields_keeps_their_layout(name: str) -> None:
    run_on_ranks(math.prod(LAYOUTS[name][0]), _body, name)
