"""A write into a slice of a sharded field (``slice_scatter``, ``select_scatter``: what
functionalization makes of a boundary write ``u[..., 0] = g``) keeps the
field's layout, against one process in float64: values, the gradients of the field and of
the source, the output's placements and shard sizes (before, DTensor's rule replicated the
written dim: every rank held the whole field), and no byte moved in forward (``count_traffic``)
when the source is plain, replicated or sharded like the slice it replaces. On the split dim
and across it, with a step and negative indices; uneven, empty-shard and 2x2 layouts. The
same for ``x[key] = value`` with a basic key on a non-leaf ``x`` (the eager write above)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from shardsci import gather_policy
from shardsci.handlers import from_local_spec
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    assert_close_all_ranks,
    check_against_reference,
    count_traffic,
    get_mesh,
    run_on_ranks,
)
from tests.expected_layouts import parse

SHAPE = (6, 7)
#: (mesh, the field's layout, the layout of its columns 1::2 as ``u[:, 1::2]`` has them)
LAYOUTS = {
    "2r-uneven": ((2,), parse("S1; 1=2/5"), parse("S1; 1=1/2")),
    "4r-empty": ((4,), parse("S1; 1=0/3/2/2"), parse("S1; 1=0/1/1/1")),
    "2x2-blocks": ((2, 2), parse("S0,S1; 0=4/2; 1=5/2"), parse("S0,S1; 0=4/2; 1=2/1")),
}

#: name -> (write, the source's shape)
WRITES = {
    "left boundary u[:, 0] = g": (lambda u, g: torch.select_scatter(u, g, -1, 0), (6,)),
    "right boundary u[:, -1] = g": (lambda u, g: torch.select_scatter(u, g, 1, -1), (6,)),
    "bottom row u[-1] = g": (lambda u, g: torch.select_scatter(u, g, 0, -1), (7,)),
    "odd columns u[:, 1::2] = g": (lambda u, g: torch.slice_scatter(u, g, 1, 1, None, 2), (6, 3)),
    "last three u[:, -3:] = g": (lambda u, g: torch.slice_scatter(u, g, -1, -3), (6, 3)),
    "rows 1:5:3 u[1:5:3] = g": (lambda u, g: torch.slice_scatter(u, g, 0, 1, 5, 3), (2, 7)),
}


def _sharded(x: torch.Tensor, layout: Layout, mesh) -> torch.Tensor:
    spec = layout.spec(mesh, x)
    return from_local_spec(spec.narrow(x).contiguous(), spec)


def _body(name: str) -> None:
    mesh_shape, layout, odd_columns = LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    u = torch.randn(SHAPE, dtype=torch.float64)
    for what, (write, source_shape) in WRITES.items():
        g = torch.randn(source_shape, dtype=torch.float64)
        label = f"{name}: {what}"
        # a plain source (a boundary value every rank holds), its gradient checked too
        check_against_reference(write, [u, g], [layout, None], mesh, what=label)
        with count_traffic() as traffic:
            out = write(_sharded(u, layout, mesh), g)
        assert_all_ranks(
            traffic.received == 0, f"{label}: received {traffic.received} bytes in forward"
        )
        assert_all_ranks(
            out.placements == layout.placements, f"{label}: placements {out.placements}"
        )
        # a replicated ShardTensor source moves nothing either
        replicated = Layout((Replicate(),) * len(mesh_shape))
        with count_traffic() as traffic:
            write(_sharded(u, layout, mesh), _sharded(g, replicated, mesh))
        assert_all_ranks(
            traffic.received == 0, f"{label}, replicated source: received {traffic.received}"
        )
    # a source sharded like the slice it replaces (computed from it): nothing moves
    write = WRITES["odd columns u[:, 1::2] = g"][0]
    check_against_reference(
        lambda v: write(v, v[:, 1::2] * 2), [u], [layout], mesh, what=f"{name}: from its slice"
    )
    g = torch.randn(6, 3, dtype=torch.float64)
    check_against_reference(write, [u, g], [layout, odd_columns], mesh, what=f"{name}: alike")
    with count_traffic() as traffic:
        write(_sharded(u, layout, mesh), _sharded(g, odd_columns, mesh))
    assert_all_ranks(traffic.received == 0, f"{name}: source alike: {traffic.received} bytes")
    # a source sharded otherwise is redistributed (its own bytes, never the field's)
    rows = Layout((Shard(0),) * len(mesh_shape))
    check_against_reference(write, [u, g], [layout, rows], mesh, what=f"{name}: rows source")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_slice_write_keeps_the_field_layout(name: str) -> None:
    run_on_ranks(math.prod(LAYOUTS[name][0]), _body, name)


#: name -> (key, the value's shape, or a Python scalar)
KEYS = {
    "u[:, 0] = g": ((slice(None), 0), (6,)),
    "u[..., -1] = g, broadcast": ((..., -1), (1,)),
    "u[1:5:3, 2:-1] = g": ((slice(1, 5, 3), slice(2, -1)), (2, 4)),
    "u[-1, 1::2] = g": ((-1, slice(1, None, 2)), (3,)),
    "u[None, :, -3:] = g": ((None, slice(None), slice(-3, None)), (1, 6, 3)),
    "u[None, ..., 5, None] = g": ((None, ..., 5, None), (6, 1)),
    "u[2, 4] = g, 0-d": ((2, 4), ()),
    "u[3] = g": ((3,), (7,)),
    "u[:, ::3] = 0.5": ((slice(None), slice(None, None, 3)), 0.5),
    # scalar items torch reads as ints or as a new one-cell dim (NOTE [Scalar index items as
    # torch reads them]): before, numpy ints raised or their write was lost
    "u[np.int64(-1), 1::2] = g": ((np.int64(-1), slice(1, None, 2)), (3,)),
    "u[1:5, np.int32(0)] = g": ((slice(1, 5), np.int32(0)), (4,)),
    "u[:, torch.tensor(5)] = g": ((slice(None), torch.tensor(5)), (6,)),
    "u[torch.tensor(-2), 2:] = g": ((torch.tensor(-2), slice(2, None)), (5,)),
    "u[..., True] = g": ((..., True), (6, 7, 1)),
    "u[1:4, True, 0] = g": ((slice(1, 4), True, 0), (3, 1)),
    "u[torch.tensor(True), 3] = g": ((torch.tensor(True), 3), (1, 7)),
    "u[:, torch.tensor(1, dtype=torch.uint8), -1] = g": (
        (slice(None), torch.tensor(1, dtype=torch.uint8), -1),
        (6, 1),
    ),
    "u[2:, False] = g, nothing": ((slice(2, None), False), (1, 0, 7)),
}


def _written(key: object):
    """``u[key] = g`` on a non-leaf copy of ``u`` (``u`` and ``g`` both need gradients)."""

    def write(u: torch.Tensor, g: object = None) -> torch.Tensor:
        v = u * 1.0
        v[key] = g
        return v

    return write


def _setitem_body(name: str) -> None:
    mesh_shape, layout, odd_columns = LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    u = torch.randn(SHAPE, dtype=torch.float64)
    replicated = Layout((Replicate(),) * len(mesh_shape))
    for what, (key, value) in KEYS.items():
        label = f"{name}: {what}"
        with gather_policy("error"):  # no gather, forward or backward
            _check_setitem(u, layout, replicated, mesh, label, key, value)
    g = torch.randn(6, dtype=torch.float64)
    for what, op in IN_PLACE.items():
        check_against_reference(_in_place(op), [u, g], [layout, None], mesh, what=f"{name}: {what}")
        with count_traffic() as traffic:
            _in_place(op)(_sharded(u, layout, mesh), g)
        # the select's broadcast of one column, no more
        assert_all_ranks(traffic.received <= 2 * 6 * 8, f"{name}: {what}: {traffic.received} B")
    # a value sharded like the slice it replaces: nothing moves
    key = (slice(None), slice(1, None, 2))
    g = torch.randn(6, 3, dtype=torch.float64)
    check_against_reference(
        _written(key), [u, g], [layout, odd_columns], mesh, what=f"{name}: alike"
    )
    with count_traffic() as traffic:
        _written(key)(_sharded(u, layout, mesh), _sharded(g, odd_columns, mesh))
    assert_all_ranks(traffic.received == 0, f"{name}: g alike: {traffic.received} bytes")


def _check_setitem(u, layout, replicated, mesh, label, key, value) -> None:
    if not isinstance(value, tuple):
        check_against_reference(lambda v: _written(key)(v, value), [u], [layout], mesh, what=label)
        return
    write = _written(key)
    g = torch.randn(value, dtype=torch.float64)
    check_against_reference(write, [u, g], [layout, None], mesh, what=label)
    check_against_reference(write, [u, g], [layout, replicated], mesh, what=f"{label}, R g")
    for source, g_layout in (("plain", None), ("replicated", replicated)):
        shard_g = g if g_layout is None else _sharded(g, g_layout, mesh)
        with count_traffic() as traffic:
            out = write(_sharded(u, layout, mesh), shard_g)
        assert_all_ranks(
            traffic.received == 0, f"{label}, {source} g: received {traffic.received} bytes"
        )
        assert_all_ranks(
            out.placements == layout.placements, f"{label}: placements {out.placements}"
        )


#: name -> an in-place op on a select of ``v`` (a view on one process, a copy when split)
IN_PLACE = {
    "u[:, 0].zero_()": lambda v, g: v[:, 0].zero_(),
    "u.select(1, -1).mul_(2)": lambda v, g: v.select(1, -1).mul_(2),
    "u[:, 0].copy_(g)": lambda v, g: v[:, 0].copy_(g),
    "u[:, 0] += g": lambda v, g: v[:, 0].__iadd__(g),
    "u[:, 5].add_(u[:, 1] + g)": lambda v, g: v[:, 5].add_(v[:, 1] + g),
}


def _in_place(op):
    def write(u: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        v = u * 1.0
        op(v, g)
        return v

    return write


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_basic_key_write_into_a_split_dim_is_kept(name: str) -> None:
    """``x[key] = value`` with ints, slices, an ellipsis and None, and an in-place op on a
    select (NOTE [An in-place op on a select's copy writes through]) (before, ``u[:, 0] = g`` on
    a split dim was silently lost: the select is a broadcast copy)."""
    run_on_ranks(math.prod(LAYOUTS[name][0]), _setitem_body, name)


def _compiled_writes_body() -> None:
    mesh = get_mesh((2,))
    layout = parse("S1; 1=2/5")
    torch.manual_seed(0)
    u = torch.randn(SHAPE, dtype=torch.float64)
    g = torch.randn(6, dtype=torch.float64)
    writes = {
        "u[:, 0] = g; u[1:5, -3::2] = 0.5": lambda v, g: _written(
            (slice(1, 5), slice(-3, None, 2))
        )(_written((slice(None), 0))(v, g), 0.5),
        "u[:, 0].mul_(2); u[:, -1] += g": _in_place(
            lambda v, g: (v[:, 0].mul_(2), v[:, -1].__iadd__(g))
        ),
    }
    for what, write in writes.items():
        whole, whole_g = u.clone().requires_grad_(), g.clone().requires_grad_()
        expected = write(whole, whole_g)
        projection = torch.randn(expected.shape, dtype=torch.float64)
        (expected * projection).sum().backward()
        torch._dynamo.reset()
        shard = _sharded(u, layout, mesh).requires_grad_()
        shard_g = g.clone().requires_grad_()
        out = torch.compile(write, backend="aot_eager")(shard, shard_g)
        (out.full_tensor() * projection).sum().backward()
        for name, actual, reference in (
            ("output", out.full_tensor(), expected),
            ("grad of u", shard.grad.full_tensor(), whole.grad),
            ("grad of g", shard_g.grad, whole_g.grad),
        ):
            assert_close_all_ranks(
                actual, reference, atol=1e-12, rtol=1e-12, what=f"compiled {what}: {name}"
            )
        assert_all_ranks(out.placements == layout.placements, f"{what}: {out.placements}")


def test_a_compiled_write_into_a_split_dim_is_kept() -> None:
    """The writes above under ``torch.compile(aot_eager)`` through ShardTensors: before, the
    write was lost (and a scalar write raised: ``aten.copy`` has no rule)."""
    run_on_ranks(2, _compiled_writes_body)


#: name -> an in-place op on a view of a select's copy (a view on one process), written through
VIEWS_OF_A_COPY = {
    "u[:, 0][1:3].zero_()": lambda v, g: v[:, 0][1:3].zero_(),
    "u[:, 0][1:3] = 0.5": lambda v, g: v[:, 0].__setitem__(slice(1, 3), 0.5),
    "u[:, -1].unsqueeze(1).mul_(3)": lambda v, g: v[:, -1].unsqueeze(1).mul_(3),
    "u[:, 2][1:4].view(1, 3) += g[:3]": lambda v, g: v[:, 2][1:4].view(1, 3).__iadd__(g[:3]),
    "u.t()[0][::2].sub_(g[:3])": lambda v, g: v.t()[0][::2].sub_(g[:3]),
}


def _view_of_a_copy_body(name: str) -> None:
    mesh_shape, layout, _ = LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    u = torch.randn(SHAPE, dtype=torch.float64)
    g = torch.randn(6, dtype=torch.float64)
    for what, op in VIEWS_OF_A_COPY.items():
        check_against_reference(_in_place(op), [u, g], [layout, None], mesh, what=f"{name}: {what}")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_an_in_place_op_on_a_view_of_a_select_copy_is_kept(name: str) -> None:
    """A write into a view of a select's copy reaches the field (NOTE [A write into a view that
    is a copy]): values, gradients, layout; before, ``u[:, 0][1:3].zero_()`` was lost and
    ``u[:, 0][1:3] = 0.5`` raised (``aten.copy`` has no rule, from ``fill_.Tensor``)."""
    run_on_ranks(math.prod(LAYOUTS[name][0]), _view_of_a_copy_body, name)
