"""An aten ``bmm`` contracting a dim both operands split, outside a recorded graph (the backward
of ``need_weights=True`` attention), is summed around the ring into the layout of the operand
of its shape (NOTE [A backward product over a dim both operands split is summed around the
ring] in ``shardsci/tensor/_ops/_matmul_ops.py``): values as one process, that layout, ring hops
only, each rank receiving its block's accumulators and never the whole product; under
``gather_policy("error")`` nothing is refused."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from shardsci import gather_policy
from shardsci.tensor._api import from_local_spec
from shardsci.tensor._collectives import axis_group
from shardsci.testing import Layout, assert_all_ranks, count_traffic, get_mesh, run_on_ranks

aten = torch.ops.aten

# ``attn^T @ grad_out``: (B, L, L) @ (B, L, K) contracting the tokens L split alike in both, the
# output (B, L, K) laid out like ``grad_out``: mesh, the tokens' axes and sizes, the batch's
# axis and sizes (or None).
CASES = {
    "2r-5/4": ((2,), (0,), (5, 4), None),
    "4r-2/2/1/0": ((4,), (0,), (2, 2, 1, 0), None),
    "2x2-batch-and-L": ((2, 2), (1,), (3, 6), (0, (2, 1))),
    "2x2-L-nested": ((2, 2), (0, 1), (0, 4, 3, 2), None),
    "3-axis-batch-and-L": ((2, 1, 2), (2,), (6, 3), (0, (1, 2))),
}


def _laid_out(t: torch.Tensor, mesh, placements: dict[int, tuple]):
    """``t`` with each dim of ``placements`` split over its axes, with its sizes."""
    shard = [None] * mesh.ndim
    sizes, order = {}, {}
    for dim, (axes, dim_sizes) in placements.items():
        for axis in axes:
            shard[axis] = Shard(dim)
        sizes[dim], order[dim] = dim_sizes, axes
    layout = Layout(tuple(p or Replicate() for p in shard), sizes, order=order)
    spec = layout.spec(mesh, t)
    return from_local_spec(spec.narrow(t), spec)


def _body(name: str) -> None:
    mesh_shape, axes, sizes, batch = CASES[name]
    mesh = get_mesh(mesh_shape)
    length, width = sum(sizes), 3
    n_batch = sum(batch[1]) if batch else 2
    attn_t = torch.randn(n_batch, length, length, dtype=torch.float64)
    grad_out = torch.randn(n_batch, length, width, dtype=torch.float64)
    split = {0: (batch[0:1], batch[1])} if batch else {}
    a = _laid_out(attn_t, mesh, {**split, 2: (axes, sizes)})
    b = _laid_out(grad_out, mesh, {**split, 1: (axes, sizes)})
    with torch.no_grad(), gather_policy("error"), count_traffic() as traffic:
        out = aten.bmm.default(a, b)
    expected = torch.bmm(attn_t, grad_out)
    assert_all_ranks(
        torch.allclose(out.full_tensor(), expected, rtol=1e-12, atol=1e-12),
        f"{name}: the product differs from one process",
    )
    assert_all_ranks(
        out._spec.layout_key == b._spec.layout_key,
        f"{name}: laid out {out._spec.placements} {out._spec.shardings}; expected grad_out's "
        f"{b._spec.placements} {b._spec.shardings}",
    )
    # Rank ``r`` of the group receives the accumulators of every block but block ``r - 1``'s
    # (NOTE [Ring or all-gather]): ``S - S_{r-1}`` rows, never the whole product.
    group = axis_group(mesh, axes)
    previous = sizes[(group.index - 1) % group.size]
    received = (length - previous) * b._local.shape[0] * width * b._local.element_size()
    assert_all_ranks(
        set(traffic.received_by_kind) <= {"p2p", "all_to_all"} and traffic.received <= received,
        f"{name}: received {traffic.as_dict()}; expected ring hops only (sends, or all-to-alls on gloo), at most {received} B",
    )


@pytest.mark.parametrize("name", list(CASES))
def test_bmm_over_a_dim_both_split_is_summed_around_the_ring(name: str) -> None:
    run_on_ranks(math.prod(CASES[name][0]), _body, name)
