"""``renorm`` of a tensor sharded across the slices it renormalises (dims other than ``dim``
split), against one process in float64: values, the gradient, the input's layout (before,
the aten path gathered the split dims: every rank held the whole tensor), and each rank
receiving only the slices' norms, a few numbers per slice, never the tensor (``count_traffic``);
p = 2, 1, 0.5 and inf, slices over and under ``maxnorm``; uneven, empty-shard and 2x2 layouts."""

from __future__ import annotations

import math

import pytest
import torch

from shardsci.handlers import from_local_spec
from shardsci.testing import (
    assert_all_ranks,
    check_against_reference,
    count_traffic,
    get_mesh,
    run_on_ranks,
)
from tests.expected_layouts import parse

SHAPE = (3, 8, 10)  # renormalised along dim 0: 3 slices of 80 cells
LAYOUTS = {
    "2r-uneven": ((2,), parse("S1; 1=3/5")),
    "4r-empty": ((4,), parse("S2; 2=0/5/2/3")),
    "2x2-blocks": ((2, 2), parse("S1,S2; 1=6/2; 2=3/7")),
    "2x2-with-dim": ((2, 2), parse("S0,S2; 0=1/2; 2=6/4")),
}
NORMS = (2.0, 1.0, 0.5, math.inf)


def _body(name: str) -> None:
    mesh_shape, layout = LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(SHAPE, dtype=torch.float64)
    x[1] *= 0.01  # a slice under maxnorm for every p
    for p in NORMS:
        maxnorm = 0.5 * torch.linalg.vector_norm(x[0], p).item()
        check_against_reference(
            lambda t, p=p, m=maxnorm: torch.renorm(t, p, 0, m), [x], [layout], mesh,
            what=f"{name}: renorm(p={p})",
        )  # fmt: skip
        check_against_reference(
            lambda t, p=p, m=maxnorm: t.renorm(p, -3, m), [x], [layout], mesh,
            what=f"{name}: Tensor.renorm(p={p}, dim=-3)",
        )  # fmt: skip
        spec = layout.spec(mesh, x)
        shard = from_local_spec(spec.narrow(x).contiguous(), spec)
        with count_traffic() as traffic:
            torch.renorm(shard, p, 0, maxnorm)
        bound = 4 * SHAPE[0] * x.element_size() * math.prod(mesh_shape)
        assert_all_ranks(
            traffic.received <= bound,
            f"{name}: renorm(p={p}) received {traffic.received} bytes; the slices' norms "
            f"take at most {bound}, the tensor {x.numel() * x.element_size()}",
        )


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_renorm_across_shards_keeps_the_layout(name: str) -> None:
    run_on_ranks(math.prod(LAYOUTS[name][0]), _body, name)
