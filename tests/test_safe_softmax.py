"""``aten._safe_softmax`` (SDPA's math path with a boolean mask: a row of only ``-inf`` gives
zeros, not NaN) on sharded scores, against one process in float64: values, the gradient and
the input's layout (before, DTensor had no rule for it and every rank held the whole
tensor), along the split dim and across it, with masked rows, partly masked rows and a
``dtype``; uneven, empty-shard and 2x2 layouts."""

from __future__ import annotations

import math

import pytest
import torch

from shardsci.testing import check_against_reference, get_mesh, run_on_ranks
from tests.expected_layouts import parse

LAYOUTS = {  # of a (4, 7) input
    "2r-columns-uneven": ((2,), parse("S1; 1=2/5")),
    "4r-columns-empty": ((4,), parse("S1; 1=3/0/2/2")),
    "4r-rows-empty": ((4,), parse("S0; 0=0/1/3/0")),
    "2x2-blocks": ((2, 2), parse("S0,S1; 0=3/1; 1=2/5")),
}


def _body(name: str) -> None:
    mesh_shape, layout = LAYOUTS[name]
    torch.manual_seed(0)
    x = torch.randn(4, 7, dtype=torch.float64)
    x[1] = -math.inf  # a fully masked row
    x[2, 3:] = -math.inf  # a row masked on some ranks only
    x[:, 5] = -math.inf  # a fully masked column
    safe_softmax = torch.ops.aten._safe_softmax.default
    for dim in (1, 0, -1):
        check_against_reference(
            lambda t, d=dim: safe_softmax(t, d), [x], [layout], get_mesh(mesh_shape),
            what=f"{name}: _safe_softmax(x, {dim})",
        )  # fmt: skip
    check_against_reference(
        lambda t: safe_softmax(t, 1, dtype=torch.float32).double(), [x], [layout],
        get_mesh(mesh_shape), atol=1e-6, rtol=1e-6, what=f"{name}: dtype=float32",
    )  # fmt: skip


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_safe_softmax_keeps_the_layout(name: str) -> None:
    run_on_ranks(math.prod(LAYOUTS[name][0]), _body, name)
