"""aten's ``_unsafe_masked_index`` whose hidden entries break the owners' increasing order,
against one process, float64 (NOTE [An entry every mask hides reads the row before it]).

``x`` (7, 3) split 5/2 along dim 0; entries ``[1, 6, 3, 0, 5]`` with the second and fourth
hidden by the mask: the shown ones (1 and 3 on rank 0, 5 on rank 1) are in owner order, so the
output keeps them on their owners (4/1, each hidden entry counted with the one before it) and
nothing moves, forward or backward. Before, the clamped hidden entries made the read one every
rank held whole (``_unsafe_masked_index`` sample 5 of the op database, gathered on 2r-uneven
and 2x2-uneven). Values, layout and ``x``'s gradient as one process under ``"error"``, on 2
ranks and on 2x2 with dim 1 split too; bytes by ``count_traffic``: 0.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import Shard

from shardsci import gather_policy
from shardsci.handlers import from_local_spec
from shardsci.testing import Layout, assert_all_ranks, count_traffic, get_mesh, run_on_ranks

aten = torch.ops.aten

# name: (mesh, x's layout, the output's layout), x (7, 3)
CASES = {
    "2r-uneven": ((2,), Layout((Shard(0),), {0: (5, 2)}), Layout((Shard(0),), {0: (4, 1)})),
    "2x2-blocks": (
        (2, 2),
        Layout((Shard(0), Shard(1)), {0: (5, 2), 1: (1, 2)}),
        Layout((Shard(0), Shard(1)), {0: (4, 1), 1: (1, 2)}),
    ),
}


def _masked_read_moves_nothing(name: str) -> None:
    mesh_shape, layout, out_layout = CASES[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(7, 3, dtype=torch.float64)
    index = torch.tensor([1, 6, 3, 0, 5])
    mask = torch.tensor([True, False, True, False, True])[:, None].expand(5, 3)
    x_ref = x.clone().requires_grad_(True)
    reference = aten._unsafe_masked_index(x_ref, mask, [index], 0.5)
    weight = torch.randn(5, 3, dtype=torch.float64)
    (reference * weight).sum().backward()
    spec, expected = layout.spec(mesh, x), out_layout.spec(mesh, weight)
    t = from_local_spec(spec.narrow(x).clone(), spec).detach().requires_grad_(True)
    w = from_local_spec(expected.narrow(weight), expected)
    with gather_policy("error"), count_traffic() as traffic:
        out = aten._unsafe_masked_index(t, mask, [index], 0.5)
        (out * w).sum(dim=0).to_local().sum().backward()
    assert_all_ranks(out._spec.same_layout(expected), f"layout {out._spec}")
    assert_all_ranks(traffic.received == 0, f"received {traffic.received} B")
    assert_all_ranks(torch.allclose(out.full_tensor(), reference.detach()), "values")
    assert_all_ranks(torch.allclose(t.grad.full_tensor(), x_ref.grad), "gradient")


@pytest.mark.parametrize("name", list(CASES))
def test_a_masked_read_follows_the_shown_entries(name: str) -> None:
    run_on_ranks(math.prod(CASES[name][0]), _masked_read_moves_nothing, name)
