"""A pending sum that is a replicated parameter's gradient is not a gather (NOTE [Gathers an op
was not asked to make]): the weight gradient of an aten-level ``mm`` over token-split rows,
larger than a rank's few rows, passes under ``gather_policy("error")`` with the gradient of one
process; a pending sum larger than the parameter it comes from (a repeated weight's) is still
refused."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from shardsci import GatherError, gather_policy
from shardsci.tensor._api import from_local_spec
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    assert_raises_all_ranks,
    get_mesh,
    run_on_ranks,
)

aten = torch.ops.aten

# Three tokens of eight features, split 2/1 or 0/2/1/0: fewer rows per rank than the weight's.
CASES = {"2r-2/1": ((2,), (2, 1)), "4r-0/2/1/0": ((4,), (0, 2, 1, 0))}


def _tokens(sizes: tuple[int, ...], x: torch.Tensor):
    mesh = get_mesh((len(sizes),))
    spec = Layout((Shard(0),), {0: sizes}).spec(mesh, x)
    return from_local_spec(spec.narrow(x), spec)


def _body(name: str) -> None:
    _, sizes = CASES[name]
    torch.manual_seed(0)
    x = torch.randn(3, 8, dtype=torch.float64)
    weight = torch.randn(16, 8, dtype=torch.float64, requires_grad=True)
    with gather_policy("error"):
        aten.mm.default(_tokens(sizes, x), weight.t()).square().sum().backward()
    reference = weight.detach().clone().requires_grad_()
    (x @ reference.t()).square().sum().backward()
    assert_all_ranks(
        torch.allclose(weight.grad, reference.grad, rtol=1e-12, atol=1e-12),
        f"{name}: the weight's gradient differs from one process",
    )
    # A weight repeated to (8, 64) contributes a gradient eight times its own size: counted.
    small = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    with gather_policy("error"):
        out = aten.mm.default(_tokens(sizes, x), small.repeat(1, 8)).square().sum()
        assert_raises_all_ranks(GatherError, "a pending sum, held whole", out.backward)


@pytest.mark.parametrize("name", list(CASES))
def test_a_parameter_gradient_pending_over_the_tokens_is_not_a_gather(name: str) -> None:
    run_on_ranks(len(CASES[name][1]), _body, name)
