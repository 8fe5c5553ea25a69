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
from torch.distributed.tensor import Partial, Replicate, Shard

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


# An operand whose split disagrees is realigned (NOTE [A product realigns the operand whose
# split disagrees]): the output's gradient ``g`` (B, L, K) back from the views with its tokens
# L split over two axes, nested, meets an operand splitting the batch B over one of them and
# the tokens over the other (MHA's backward with ``need_weights=True`` on a 2x2 block). ``g``
# moves by one all-to-all to the batch split as in the other operand and its tokens in the
# outer blocks of the nested split. Per case: mesh, ``g``'s token axes (outermost first) and
# sizes, the batch's axis and sizes, the other tokens' axis; the tokens' outer blocks follow.
REALIGNED = {
    "2x2": ((2, 2), (1, 0), (2, 1, 1, 1), (0, (2, 4)), 1),
    "2x2-empty": ((2, 2), (1, 0), (0, 3, 1, 1), (0, (1, 5)), 1),
    "3-axis": ((2, 1, 2), (2, 0), (1, 1, 3, 0), (0, (4, 2)), 2),
}
# ``g @ v^T`` (the scores' gradient, a ring product) and ``attn^T @ g`` (the values', contracting
# the tokens).
PRODUCTS = ["bnk,bkm->bnm", "bmn,bnk->bmk"]


def _outer(axes: tuple[int, ...], sizes: tuple[int, ...], mesh_shape) -> tuple[int, ...]:
    inner = mesh_shape[axes[1]]
    return tuple(sum(sizes[k : k + inner]) for k in range(0, len(sizes), inner))


def _realigned_body(name: str, equation: str, mode: str) -> None:
    from shardsci import attention_exchange
    from shardsci.testing import check_against_reference
    from tests.boxes import box, coordinates, overlap, volume

    mesh_shape, axes, sizes, (batch_axis, batch), tokens_axis = REALIGNED[name]
    mesh = get_mesh(mesh_shape)
    length, n_batch, width = sum(sizes), sum(batch), 3
    outer = _outer(axes, sizes, mesh_shape)
    g = torch.randn(n_batch, length, width, dtype=torch.float64)
    nested = Layout(_placed(mesh, {1: axes}), {1: sizes}, order={1: axes})
    block = Layout(_placed(mesh, {0: (batch_axis,), 2: (tokens_axis,)}), {0: batch, 2: outer})
    moved = Layout(_placed(mesh, {0: (batch_axis,), 1: (tokens_axis,)}), {0: batch, 1: outer})
    scores = equation == PRODUCTS[0]
    other = torch.randn(n_batch, width if scores else length, length, dtype=torch.float64)
    inputs, layouts = ([g, other], [nested, block]) if scores else ([other, g], [block, nested])
    product = lambda a, b: torch.ops.aten.bmm.default(a, b)  # noqa: E731
    if mode == "grad":  # recording a graph, the values' gradient stays pending over the tokens
        pending = list(moved.placements)
        pending[tokens_axis] = Partial()
        out = moved if scores else Layout(tuple(pending), {0: batch})
        with attention_exchange("ring"):
            check_against_reference(
                product, inputs, layouts, mesh, out_layouts=[out], what=f"{name} {equation}"
            )
        return
    a, b = (_from(t, layout, mesh) for t, layout in zip(inputs, layouts))
    with (
        torch.no_grad(),
        gather_policy("error"),
        attention_exchange("ring"),
        count_traffic() as traffic,
    ):
        out = product(a, b)
    assert_all_ranks(
        torch.allclose(out.full_tensor(), torch.bmm(*inputs), rtol=1e-12, atol=1e-12),
        f"{name} {equation}: the product differs from one process",
    )
    expected = moved.spec(mesh, out)
    assert_all_ranks(
        out._spec.layout_key == expected.layout_key,
        f"{name} {equation}: laid out {out._spec}; expected {expected}",
    )
    # Bytes: the realignment's lower bound (boxes, computed here), plus one pass of the ring over
    # the other tokens' axis: the other operand's blocks (scores), or the accumulators of the
    # output's blocks (values), each rank receiving all but one block of its batch rows.
    me = coordinates(mesh_shape)[torch.distributed.get_rank()]
    target = box(moved, g.shape, mesh_shape, me)
    realign = volume(target) - volume(overlap(target, box(nested, g.shape, mesh_shape, me)))
    rows = batch[me[batch_axis]]
    ring = (length - min(outer)) * rows * width
    bound = (realign + ring) * g.element_size()
    assert_all_ranks(
        set(traffic.received_by_kind) <= {"p2p", "all_to_all"} and traffic.received <= bound,
        f"{name} {equation}: received {traffic.as_dict()}; expected all-to-alls, at most "
        f"{bound} B ({realign} elements realigned)",
    )


def _placed(mesh, dims: dict[int, tuple[int, ...]]) -> tuple:
    shard = [Replicate()] * mesh.ndim
    for dim, axes in dims.items():
        for axis in axes:
            shard[axis] = Shard(dim)
    return tuple(shard)


def _from(t: torch.Tensor, layout: Layout, mesh):
    spec = layout.spec(mesh, t)
    return from_local_spec(spec.narrow(t), spec)


@pytest.mark.parametrize("mode", ["no-grad", "grad"])
@pytest.mark.parametrize("equation", PRODUCTS)
@pytest.mark.parametrize("name", list(REALIGNED))
def test_a_backward_bmm_realigns_the_operand_whose_split_disagrees(
    name: str, equation: str, mode: str
) -> None:
    run_on_ranks(math.prod(REALIGNED[name][0]), _realigned_body, name, equation, mode)
