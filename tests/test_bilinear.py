"""``F.bilinear`` (``nn.Bilinear``) on ShardTensors as an einsum (``_ops/_bilinear_ops.py``):
the rows keep their split and nothing is gathered (it was: aten's ``_trilinear`` ran on
whole tensors). Against one process in float64: values, every gradient (both inputs, weight,
bias), the output's layout, and the forward's bytes by ``count_traffic``."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Partial, Shard

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

# name -> (mesh, x1 (N, ..., 3), x1's layout, x2's layout (None: plain), the output's layout,
# bytes each rank receives in the forward)
CASES = {
    "2r-rows": ((2,), (8, 3), Layout((Shard(0),), {0: (5, 3)}), None, "rows", 0),
    "2r-rows-both": ((2,), (8, 3), Layout((Shard(0),), {0: (5, 3)}), "same", "rows", 0),
    "4r-rows-empty": ((4,), (8, 3), Layout((Shard(0),), {0: (3, 0, 4, 1)}), "same", "rows", 0),
    "4r-batched-tokens": (
        (4,), (2, 7, 3), Layout((Shard(1),), {1: (0, 3, 1, 3)}), None, "rows", 0,
    ),
    "2x2-rows-and-features": (
        (2, 2),
        (8, 3),
        Layout((Shard(0), Shard(1)), {0: (3, 5), 1: (2, 1)}),
        None,
        Layout((Shard(0), Partial()), {0: (3, 5)}),
        0,
    ),
}  # fmt: skip


def _bilinear_body(name: str) -> None:
    mesh_shape, shape, layout, other, expected, received = CASES[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    module = nn.Bilinear(3, 4, 5, dtype=torch.float64)
    x1 = torch.randn(shape, dtype=torch.float64)
    x2 = torch.randn(*shape[:-1], 4, dtype=torch.float64)
    x2_layout = layout if other == "same" else None
    out_layout = layout if expected == "rows" else expected
    # A pending output is the sum of each rank's split features, held whole along them: a
    # GatherWarning (NOTE [Gathers an op was not asked to make]) that these cases state.
    with allowed_if(pending(out_layout)):
        check_against_reference(
            lambda m, a, b: m(a, b),
            [x1, x2],
            [layout, x2_layout],
            mesh,
            module=module,
            out_layouts=[out_layout],
            what=name,
        )
    spec = layout.spec(mesh, x1)
    a = from_local_spec(spec.narrow(x1), spec)
    with torch.no_grad(), count_traffic() as traffic, allowed_if(pending(out_layout)):
        module(a, x2)
    assert_all_ranks(
        traffic.received == received,
        f"{name}: the forward received {traffic.as_dict()}; expected {received} bytes",
    )


@pytest.mark.parametrize("name", list(CASES))
def test_bilinear_keeps_the_rows(name: str) -> None:
    run_on_ranks(math.prod(CASES[name][0]), _bilinear_body, name)
