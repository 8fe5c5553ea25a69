"""The max/min family along a split dim against one process, float64, under
``gather_policy("error")``: ``amax``/``amin`` (over one dim, with ``keepdim``, over several
and over all), ``max``/``min`` with a dim (values and indices) and ``max()``; values, the
gradient and the output's layout, on uneven rows, rows one rank holds whole (the others
empty), rows with empty shards on 4 ranks, a 2x2 block and rows nested over two axes of a 2x2x2 mesh. Ties across shards (data of
few distinct values) check the gradient's rule: ``amax`` splits it among the tied cells,
``max`` with a dim gives it to the first one, as torch.

Before: ``amax``'s backward was refused on every split layout with a row of one cell on some
rank (its count of tied cells, an int64 sum of a bool mask, weighed more bytes than the mask's
shard, which the guard read as a pending sum held whole); ``max``/``min`` with a dim gathered
the input."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from shardsci import gather_policy
from shardsci.handlers import from_local_spec
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    assert_raises_all_ranks,
    check_against_reference,
    count_traffic,
    get_mesh,
    run_on_ranks,
)

LAYOUTS = {  # name: mesh, input shape, input layout
    "2r-uneven": ((2,), (3, 5), Layout((Shard(0),), {0: (2, 1)})),
    "2r-one-holder": ((2,), (6, 5), Layout((Shard(0),), {0: (6, 0)})),
    # 40 rows: each rank receives a few rows, far below the input it lacks (which
    # check_against_reference watches for on 3 ranks or more)
    "4r-empty": ((4,), (40, 3), Layout((Shard(0),), {0: (15, 0, 25, 0)})),
    "2x2-blocks": ((2, 2), (3, 4), Layout((Shard(0), Shard(1)), {0: (2, 1), 1: (1, 3)})),
    "2x2x2-nested": (
        (2, 2, 2),
        (5, 4),
        Layout((Shard(0), Shard(1), Shard(0)), {0: (2, 0, 1, 2), 1: (1, 3)}, {0: (0, 2)}),
    ),
}

# name: function, reduced dims, keepdim, what the reduced dims' axes hold
OPS = {
    "amax(0)": (lambda t: t.amax(0), (0,), False, Partial("max")),
    "amin(0, keepdim)": (lambda t: t.amin(0, keepdim=True), (0,), True, Partial("min")),
    "amax(1)": (lambda t: t.amax(1), (1,), False, Partial("max")),
    "amax((0, 1))": (lambda t: t.amax((0, 1)), (0, 1), False, Partial("max")),
    "max()": (lambda t: t.max(), (0, 1), False, Partial("max")),
    "max(0)": (lambda t: tuple(t.max(0)), (0,), False, Replicate()),
    "min(0, keepdim)": (lambda t: tuple(torch.min(t, 0, keepdim=True)), (0,), True, Replicate()),
    "max(dim=-1)": (lambda t: tuple(torch.max(t, dim=-1)), (1,), False, Replicate()),
    # aten's overloads called directly (decompositions, compiled graphs): below autograd
    "aten.max.dim(0)": (lambda t: tuple(torch.ops.aten.max.dim(t, 0)), (0,), False, Replicate()),
    "aten.min.dim(0, keepdim)": (
        lambda t: tuple(torch.ops.aten.min.dim(t, 0, True)),
        (0,),
        True,
        Replicate(),
    ),
}


# A max or min over a dim one rank holds whole stays with that rank (NOTE [A sum over a dim one
# rank holds stays with that rank] in ``_ops/_common.py``), on the reduced dim where it is
# kept, else the first dim; a 0-d one stays pending. ``torch.max``/``torch.min`` with a dim
# too (values and indices), and aten's overloads called directly (their backward scatters
# through the held indices on the holder: NOTE [A scatter through an index its holder holds
# writes on that holder]).
KEPT_BY_HOLDER = {
    ("2r-one-holder", "amax(0)"): Layout((Shard(0),), {0: (5, 0)}),
    ("2r-one-holder", "amin(0, keepdim)"): Layout((Shard(0),), {0: (1, 0)}),
    ("2r-one-holder", "max(0)"): Layout((Shard(0),), {0: (5, 0)}),
    ("2r-one-holder", "min(0, keepdim)"): Layout((Shard(0),), {0: (1, 0)}),
    ("2r-one-holder", "aten.max.dim(0)"): Layout((Shard(0),), {0: (5, 0)}),
    ("2r-one-holder", "aten.min.dim(0, keepdim)"): Layout((Shard(0),), {0: (1, 0)}),
}


def _reduced(layout: Layout, dims: tuple[int, ...], keepdim: bool, held: Placement) -> Layout:
    """``layout`` after reducing ``dims``: their axes hold ``held``, other dims renumbered
    (where not kept) with their sizes and nesting."""

    def renumbered(d: int) -> int:
        return d if keepdim else d - sum(r < d for r in dims)

    placements = tuple(
        held if isinstance(p, Shard) and p.dim in dims else Shard(renumbered(p.dim))
        for p in layout.placements
    )
    sizes = {renumbered(d): s for d, s in layout.sizes.items() if d not in dims}
    order = {renumbered(d): o for d, o in layout.order.items() if d not in dims}
    return Layout(placements, sizes, order)


def _body(layout_name: str, ties: bool) -> None:
    mesh_shape, shape, layout = LAYOUTS[layout_name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64)
    if ties:
        x = torch.randint(0, 2, shape).to(torch.float64)
    for name, (fn, dims, keepdim, held) in OPS.items():
        out = KEPT_BY_HOLDER.get((layout_name, name)) or _reduced(layout, dims, keepdim, held)
        with gather_policy("error"):
            check_against_reference(
                fn,
                [x],
                [layout],
                mesh,
                out_layouts=[out, out] if held == Replicate() else [out],
                what=f"{layout_name}{' ties' if ties else ''}: {name}",
            )


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_max_min_along_a_split_dim_equal_one_process(layout: str, ties: bool) -> None:
    mesh_shape = LAYOUTS[layout][0]
    run_on_ranks(math.prod(mesh_shape), _body, layout, ties)


def _bool_body(layout_name: str) -> None:
    mesh_shape, shape, layout = LAYOUTS[layout_name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(shape) > 0.5
    spec = layout.spec(mesh, x)
    shard = from_local_spec(spec.narrow(x).contiguous(), spec)
    ops = {
        "torch.max": torch.max,
        "torch.min": torch.min,
        "aten.max.dim": torch.ops.aten.max.dim,
        "aten.min.dim": torch.ops.aten.min.dim,
    }
    for name, op in ops.items():
        with gather_policy("error"):
            values, indices = op(shard, 0)
        expected_values, expected_indices = op(x, 0)
        assert_all_ranks(
            values.dtype == torch.bool
            and torch.equal(values.full_tensor(), expected_values)
            and torch.equal(indices.full_tensor(), expected_indices),
            f"{layout_name}: {name} of bools differs from one process",
        )


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_max_min_of_bools_along_a_split_dim_gather_nothing(layout: str) -> None:
    """Bools take the same route as numbers, their values summed as 0/1 bytes (was: the
    gathered fallback, refused under "error")."""
    run_on_ranks(math.prod(LAYOUTS[layout][0]), _bool_body, layout)


# Taller than the reference cases, so that a gather (many rows) and the exchange (a few) differ.
BYTES_LAYOUTS = {  # name: mesh, input shape, input layout, ranks along dim 0
    "2r-uneven": ((2,), (20, 5), Layout((Shard(0),), {0: (12, 8)}), 2),
    "2x2x2-nested": (
        (2, 2, 2),
        (20, 4),
        Layout((Shard(0), Shard(1), Shard(0)), {0: (6, 0, 4, 10), 1: (1, 3)}, {0: (0, 2)}),
        4,
    ),
}


def _bytes_body(layout_name: str) -> dict[str, int]:
    mesh_shape, shape, layout, _ = BYTES_LAYOUTS[layout_name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    whole = torch.randn(shape, dtype=torch.float64)
    spec = layout.spec(mesh, whole)
    x = from_local_spec(spec.narrow(whole).contiguous(), spec).requires_grad_()
    with gather_policy("allow"), count_traffic() as forward:
        values, _ = x.max(0)
    with count_traffic() as backward:
        torch.autograd.grad(values.to_local().sum(), x)
    return {"forward": forward.largest_received, "backward": backward.received}


@pytest.mark.parametrize("layout", list(BYTES_LAYOUTS))
def test_max_along_a_split_dim_moves_rows_not_the_input(layout: str) -> None:
    """Forward: each collective brings a rank at most one output row per rank along the dim
    (values, indices and a flag from each, then the values' all-reduce), where a gather
    brings every row it lacks; backward: no byte (the gradient goes to the cell on its
    holder). Measured by ``count_traffic``, under "allow" so that a gather is counted."""
    mesh_shape, shape, _, ranks_along_dim = BYTES_LAYOUTS[layout]
    row = math.prod(shape[1:]) * 8
    for result in run_on_ranks(math.prod(mesh_shape), _bytes_body, layout):
        assert result["forward"] <= ranks_along_dim * row, result
        assert result["backward"] == 0, result


def _empty_dim_body() -> None:
    mesh = get_mesh((2,))
    spec = Layout((Shard(0),), {0: (0, 0)}).spec(mesh, torch.zeros(0, 3, dtype=torch.float64))
    x = from_local_spec(torch.zeros(0, 3, dtype=torch.float64), spec)
    with gather_policy("error"):
        assert_raises_all_ranks(
            IndexError, r"max\(\): Expected reduction dim 0 to have non-zero size", lambda: x.max(0)
        )


def test_max_along_an_empty_dim_raises_torchs_error_on_every_rank() -> None:
    run_on_ranks(2, _empty_dim_body)


# aten ``max.dim``/``min.dim`` over a dim one rank holds whole, split over other axes elsewhere:
# values and indices kept by the holder, as ``torch.max``'s, and the backward (zeros of the
# input's layout, then a scatter through the held indices) local. Per case: mesh, shape, the
# input's layout (dim 0 held by one rank), the output's layout without and with ``keepdim``.
HELD = {
    "2r": (
        (2,),
        (6, 5),
        Layout((Shard(0),), {0: (6, 0)}),
        Layout((Shard(0),), {0: (5, 0)}),
        Layout((Shard(0),), {0: (1, 0)}),
    ),
    "2x2": (
        (2, 2),
        (5, 4),
        Layout((Shard(0), Shard(1)), {0: (0, 5), 1: (1, 3)}),
        Layout((Shard(0), Shard(0)), {0: (0, 0, 1, 3)}, {0: (0, 1)}),
        Layout((Shard(0), Shard(1)), {0: (0, 1), 1: (1, 3)}),
    ),
    "2x1x2": (
        (2, 1, 2),
        (5, 4),
        Layout((Shard(0), Replicate(), Shard(1)), {0: (0, 5), 1: (4, 0)}),
        Layout((Shard(0), Replicate(), Shard(0)), {0: (0, 0, 4, 0)}, {0: (0, 2)}),
        Layout((Shard(0), Replicate(), Shard(1)), {0: (0, 1), 1: (4, 0)}),
    ),
}
HELD_OPS = {
    "aten.max.dim(0)": (torch.ops.aten.max.dim, False),
    "aten.min.dim(0, keepdim)": (torch.ops.aten.min.dim, True),
    "aten.max.dim(0, keepdim)": (torch.ops.aten.max.dim, True),
    "aten.min.dim(0)": (torch.ops.aten.min.dim, False),
}


def _held_body(name: str, ties: bool) -> None:
    mesh_shape, shape, layout, dropped, kept = HELD[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randint(0, 2, shape).to(torch.float64) if ties else torch.randn(shape).double()
    for op_name, (op, keepdim) in HELD_OPS.items():
        out = kept if keepdim else dropped
        with gather_policy("error"):
            check_against_reference(
                lambda t, op=op, keepdim=keepdim: tuple(op(t, 0, keepdim)),
                [x],
                [layout],
                mesh,
                out_layouts=[out, out],
                what=f"{name}: {op_name}",
            )
        spec = layout.spec(mesh, x)
        leaf = spec.narrow(x).clone().requires_grad_()
        with gather_policy("error"), count_traffic() as traffic:
            values, _ = op(from_local_spec(leaf, spec), 0, keepdim)
            values.to_local().sum().backward()
        assert_all_ranks(
            traffic.received == 0 and torch.equal(leaf.grad, spec.narrow(_held_gradient(x, op))),
            f"{name}: {op_name} received {traffic.as_dict()}, or its gradient differs; "
            "expected no byte moved, the gradient on the holder's cells",
        )


def _held_gradient(x: torch.Tensor, op) -> torch.Tensor:
    whole = x.clone().requires_grad_()
    op(whole, 0)[0].sum().backward()
    return whole.grad


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("name", list(HELD))
def test_aten_max_min_dim_over_a_held_dim_stay_on_the_holder(name: str, ties: bool) -> None:
    run_on_ranks(math.prod(HELD[name][0]), _held_body, name, ties)
