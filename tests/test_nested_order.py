"""A dim sharded over several mesh axes keeps its nesting order and sizes when an op moves it.

NOTE [The nesting of a dim sharded over several axes is shardsci's, like its sizes]
(``shardsci/tensor/_propagation.py``): ``nn.MultiheadAttention`` on (B, L, D) sharded over batch
and tokens flattens them into rows nested over mesh axes (1, 0), and its backward transposes
those rows. Every op below runs on the default path (DTensor's placements), against one process
in float64: values, gradients, the output's placements, shard sizes and axis order, and no byte
moved (``count_traffic``) where the shards stay where they are.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch.distributed.tensor import Partial, Shard

from shardsci.handlers import from_local_spec
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    check_against_reference,
    count_traffic,
    get_mesh,
    run_on_ranks,
)

aten = torch.ops.aten

# (mesh, rows' sizes, their order): rows of a (12, 3, 4) tensor nested innermost axis first, on
# 2x2 with an empty shard and on 2x2x2 in a mixed order.
NESTINGS = {
    "2x2 inner axis first": ((2, 2), (4, 1, 0, 7), (1, 0)),
    "2x2x2 order (2, 0, 1)": ((2, 2, 2), (2, 0, 3, 1, 1, 2, 0, 3), (2, 0, 1)),
}

# name: (fn of the (12, 3, 4) input, where its rows end up)
MOVES: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]] = {
    "aten.t": (lambda x: aten.t.default(x.flatten(1)), 1),
    "transpose": (lambda x: x.transpose(0, 2), 2),
    "permute": (lambda x: x.permute(1, 2, 0), 2),
    "movedim": (lambda x: x.movedim(0, 1), 1),
    "unsqueeze": (lambda x: x.unsqueeze(0), 1),
    "sum over the others": (lambda x: x.sum((1, 2)), 0),
    "times a bias": (lambda x: x * torch.arange(4.0, dtype=torch.float64), 0),
}


def _layout(mesh_shape: tuple[int, ...], dim: int, sizes, order) -> Layout:
    return Layout((Shard(dim),) * len(mesh_shape), {dim: sizes}, {dim: order})


def _moves_body(nesting: str) -> None:
    mesh_shape, sizes, order = NESTINGS[nesting]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(12, 3, 4, dtype=torch.float64)
    layout = _layout(mesh_shape, 0, sizes, order)
    spec = layout.spec(mesh, x)
    for what, (fn, rows) in MOVES.items():
        check_against_reference(
            fn, [x], [layout], mesh, out_layouts=[_layout(mesh_shape, rows, sizes, order)],
            what=f"{nesting}: {what}",
        )  # fmt: skip
        leaf = from_local_spec(spec.narrow(x).contiguous(), spec).requires_grad_()
        with count_traffic() as forward:
            out = fn(leaf)
        with count_traffic() as backward:
            torch.autograd.grad(out, leaf, torch.ones_like(out))
        moved = {"forward": forward.as_dict(), "backward": backward.as_dict()}
        assert_all_ranks(
            forward.sent == forward.received == backward.sent == backward.received == 0,
            f"{nesting}: {what} moved bytes: {moved}",
        )


@pytest.mark.parametrize("nesting", list(NESTINGS))
def test_a_nested_dim_keeps_its_order_when_moved(nesting: str) -> None:
    """t, transpose, permute, movedim, unsqueeze, a reduction and a broadcast product of rows
    nested innermost axis first: values, gradient, layout (order included), 0 bytes."""
    run_on_ranks(math.prod(NESTINGS[nesting][0]), _moves_body, nesting)


def _products_body() -> None:
    """``mm``'s backward products of rows nested over (1, 0) on 2x2: the weight's gradient is
    ``t(rows) @ grad``, a sum over the rows of both factors, which share order and sizes."""
    mesh = get_mesh((2, 2))
    torch.manual_seed(0)
    x = torch.randn(12, 5, dtype=torch.float64)
    g = torch.randn(12, 3, dtype=torch.float64)
    layout = _layout((2, 2), 0, (4, 1, 0, 7), (1, 0))
    check_against_reference(
        lambda a, b: aten.mm.default(aten.t.default(a), b), [x, g], [layout, layout], mesh,
        out_layouts=[Layout((Partial(), Partial()))],
    )  # fmt: skip
    a, b = (
        from_local_spec(layout.spec(mesh, t).narrow(t).contiguous(), layout.spec(mesh, t))
        for t in (x, g)
    )
    with count_traffic() as traffic:
        product = aten.mm.default(aten.t.default(a), b)
    assert_all_ranks(
        product._spec.partial and traffic.sent == 0,
        f"t(rows) @ rows: {product._spec}, {traffic.as_dict()}",
    )


def test_the_product_of_transposed_nested_rows_moves_nothing() -> None:
    """Values and gradients of ``t(rows) @ rows``; a pending sum, no byte moved before it."""
    run_on_ranks(4, _products_body)


def _mixed_orders_body() -> None:
    """Two operands sharded over the same axes in different orders: one is moved to the
    other's order (here the first's, both being as large) before a pointwise op."""
    mesh = get_mesh((2, 2))
    torch.manual_seed(0)
    x, y = torch.randn(2, 12, 5, dtype=torch.float64)
    inner_first = _layout((2, 2), 0, (4, 1, 0, 7), (1, 0))
    outer_first = _layout((2, 2), 0, (3, 3, 3, 3), (0, 1))
    check_against_reference(
        torch.add, [x, y], [inner_first, outer_first], mesh, out_layouts=[inner_first]
    )


def test_operands_nested_in_different_orders_are_aligned() -> None:
    run_on_ranks(4, _mixed_orders_body)
