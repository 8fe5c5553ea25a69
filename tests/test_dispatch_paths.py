"""The dispatch path each op takes (NOTE [Dispatch paths] in ``shardsci/tensor/_dispatch.py``)
and the pointwise fast path for operands that broadcast into a layout (NOTE [Operands that
broadcast into the layout]) or have its shape laid out otherwise (NOTE [Operands of one shape
laid out differently]): against one process in float64, forward and gradients, on an
uneven 1-D split, one with an empty shard and an uneven 2x2 block decomposition, with the
output's layout stated; and which path each op took, counted by ``tally_paths``.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from shardsci.tensor._api import from_local_spec
from shardsci.tensor._dispatch import tally_paths
from shardsci.tensor._spec import ShardTensorSpec
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    check_against_reference,
    get_mesh,
    run_on_ranks,
)
from tests.layouts import Sharded

# (B, C, H, W) fields: H split unevenly, H with an empty shard, 2x2 blocks.
FIELDS = [
    Sharded("2r-H-7/3", (2,), (2, 4, 10, 6), Layout((Shard(2),), {2: (7, 3)})),
    Sharded("4r-H-0/5/2/3", (4,), (2, 4, 10, 6), Layout((Shard(2),), {2: (0, 5, 2, 3)})),
    Sharded(
        "2x2-6/4x2/4", (2, 2), (2, 4, 10, 6), Layout((Shard(2), Shard(3)), {2: (6, 4), 3: (2, 4)})
    ),
]

# Second operands, by name: global shape, and whether it is a replicated ShardTensor (True)
# or a plain tensor (False). Each broadcasts into the field along dims no mesh axis splits,
# or holds whole a dim the field's layout splits (H, and W on 2x2), which each rank cuts.
OPERANDS = {
    "replicated bias (C, 1, 1)": ((4, 1, 1), True),
    "plain bias (C, 1, 1)": ((4, 1, 1), False),
    "replicated (1, C, 1, 1)": ((1, 4, 1, 1), True),
    "plain (B, 1, 1, 1)": ((2, 1, 1, 1), False),
    "replicated (H, W)": ((10, 6), True),
    "plain (C, H, 1)": ((4, 10, 1), False),
}


def _operand(shape: tuple[int, ...], replicated: bool, mesh, seed: int) -> torch.Tensor:
    value = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    if not replicated:
        return value
    return from_local_spec(value, Layout((Replicate(),) * mesh.ndim).spec(mesh, value))


def _sharded(case: Sharded, mesh, seed: int = 0):
    whole = torch.randn(
        case.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)
    )
    spec = case.layout.spec(mesh, whole)
    return whole, from_local_spec(spec.narrow(whole), spec)


def _broadcast_body(case: Sharded) -> None:
    mesh = get_mesh(case.mesh)
    whole, _ = _sharded(case, mesh)
    for name, (shape, replicated) in OPERANDS.items():
        bias = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        layout = Layout((Replicate(),) * mesh.ndim) if replicated else None
        for op_name, fn in {
            "x + b": lambda x, b: x + b,
            "b * x": lambda x, b: b * x,
            "where(x > 0, x, b)": lambda x, b: torch.where(x > 0, x, b),
            "x - b, float32": lambda x, b: (x - b).to(torch.float32).to(torch.float64),
        }.items():
            check_against_reference(
                fn, [whole, bias], [case.layout, layout], mesh, what=f"{op_name}, {name}"
            )


@pytest.mark.parametrize("case", FIELDS, ids=str)
def test_broadcast_operands_match_one_process(case: Sharded) -> None:
    run_on_ranks(case.world, _broadcast_body, case)


def _paths_body(case: Sharded) -> None:
    mesh = get_mesh(case.mesh)
    _, x = _sharded(case, mesh)
    found = {}
    for name, (shape, replicated) in OPERANDS.items():
        bias = _operand(shape, replicated, mesh, seed=1)
        with torch.no_grad(), tally_paths() as tally:
            out = x + bias
            out = bias * out
            out.add_(bias)
            out = out.to(torch.float32)
        found[name] = (dict(tally.outermost), out.spec.same_layout(x.spec), out.dtype)
        assert tally.outermost == tally.ops, f"{name}: no op dispatches another"
    # A leaf that requires grad is not cut (its .grad keeps its layout): the default path.
    leaf = _operand(case.shape[2:], True, mesh, seed=2).requires_grad_()
    with tally_paths() as tally:
        out = x + leaf
    out.sum().backward()
    found["leaf (H, W)"] = (dict(tally.outermost), out.spec.same_layout(x.spec), out.dtype)
    expected = {name: ({"fast": 4}, True, torch.float32) for name in OPERANDS}
    expected["leaf (H, W)"] = ({"propagation": 1}, True, torch.float64)
    assert_all_ranks(found == expected, f"paths {found}, expected {expected}")
    assert_all_ranks(leaf.grad.spec.same_layout(leaf.spec), f"leaf's grad: {leaf.grad.spec}")


@pytest.mark.parametrize("case", FIELDS, ids=str)
def test_broadcasting_pointwise_ops_take_the_fast_path(case: Sharded) -> None:
    run_on_ranks(case.world, _paths_body, case)


def _row_statistic(case: Sharded) -> tuple[tuple[int, ...], Layout]:
    """A per-row operand of the field: (B, C, H, 1), H split as the field's (a statistic over
    W, the other axes' dims broadcast)."""
    h_axes = [axis for axis, p in enumerate(case.layout.placements) if p == Shard(2)]
    placements = tuple(
        Shard(2) if axis in h_axes else Replicate() for axis in range(len(case.mesh))
    )
    return (*case.shape[:3], 1), Layout(placements, {2: case.layout.sizes[2]})


def _partly_sharded_body(case: Sharded) -> None:
    mesh = get_mesh(case.mesh)
    whole, x = _sharded(case, mesh)
    shape, layout = _row_statistic(case)
    rows = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for op_name, fn in {
        "x - rows": lambda x, r: x - r,
        "rows * x": lambda x, r: r * x,
    }.items():
        check_against_reference(fn, [whole, rows], [case.layout, layout], mesh, what=op_name)
    sharded_rows = from_local_spec(layout.spec(mesh, rows).narrow(rows), layout.spec(mesh, rows))
    with torch.no_grad(), tally_paths() as tally:
        out = sharded_rows * (x - sharded_rows)
    found = (dict(tally.outermost), out.spec.same_layout(x.spec))
    # Split otherwise than the field's H, the same operand needs the default path.
    other = Layout(layout.placements, {2: layout.sizes[2][::-1]})
    if other.sizes != layout.sizes:
        moved = from_local_spec(other.spec(mesh, rows).narrow(rows), other.spec(mesh, rows))
        with torch.no_grad(), tally_paths() as tally:
            x - moved
        assert_all_ranks(tally.outermost == {"propagation": 1}, f"{tally.outermost}")
    assert_all_ranks(found == ({"fast": 2}, True), f"paths {found}")


@pytest.mark.parametrize("case", FIELDS, ids=str)
def test_operands_sharded_like_the_field_along_some_dims_take_the_fast_path(
    case: Sharded,
) -> None:
    """``x - rows``, ``rows`` of shape (B, C, H, 1) split along H as ``x`` is: one process's
    values, gradients and layout, on the fast path; split otherwise, the default path."""
    run_on_ranks(case.world, _partly_sharded_body, case)


# Other layouts of each field's shape, by mesh: (layout, None, or where it splits the field into
# fewer pieces than the field's layout, the layout of ``y - x`` that the default path gives:
# ``y``'s H sizes, ``x``'s W split). Same placements other sizes, another dim, H over both axes
# of a 2x2 mesh (slabs: what a window partition's reverse returns), the dims swapped.
OTHER_LAYOUTS = {
    (2,): [(Layout((Shard(2),), {2: (3, 7)}), None), (Layout((Shard(3),), {3: (4, 2)}), None)],
    (4,): [
        (Layout((Shard(2),), {2: (5, 0, 3, 2)}), None),
        (Layout((Shard(3),), {3: (1, 2, 0, 3)}), None),
    ],
    (2, 2): [
        (Layout((Shard(2), Shard(2)), {2: (3, 3, 2, 2)}), None),
        (Layout((Shard(3), Shard(2)), {3: (4, 2), 2: (3, 7)}), None),
        (
            Layout((Shard(2), Replicate()), {2: (4, 6)}),
            Layout((Shard(2), Shard(3)), {2: (4, 6), 3: (2, 4)}),
        ),
    ],
}


def _one_shape_body(case: Sharded) -> None:
    mesh = get_mesh(case.mesh)
    whole, x = _sharded(case, mesh)
    other_whole = torch.randn(case.shape, dtype=torch.float64)
    for layout, default_path in OTHER_LAYOUTS[case.mesh]:
        spec = layout.spec(mesh, other_whole)
        y = from_local_spec(spec.narrow(other_whole), spec)
        what = f"{layout}"
        if default_path is None:
            check_against_reference(
                lambda a, b: a + 2 * b, [whole, other_whole], [case.layout, layout], mesh,
                out_layouts=[case.layout], what=f"x + 2 y, y {what}",
            )  # fmt: skip
            with torch.no_grad(), tally_paths() as tally:
                out = x * y
            assert_all_ranks(tally.outermost == {"fast": 1}, f"{what}: {tally.outermost}")
            assert_all_ranks(out.spec.same_layout(x.spec), f"{what}: x * y is {out.spec}")
        # The other way round the result takes y's layout, or, where x's would leave y in
        # fewer pieces (a gather), DTensor's rule decides on the default path.
        check_against_reference(
            lambda a, b: b - a, [whole, other_whole], [case.layout, layout], mesh,
            out_layouts=[default_path or layout], what=f"y - x, y {what}",
        )  # fmt: skip


@pytest.mark.parametrize("case", FIELDS, ids=str)
def test_operands_of_one_shape_laid_out_otherwise_take_the_first_ones_layout(
    case: Sharded,
) -> None:
    """``x + 2 y`` with ``y`` of ``x``'s shape laid out otherwise (a residual add after a
    window partition and its reverse): one process's values and gradients, in ``x``'s layout,
    on the fast path; ``y - x`` in ``y``'s; never moved into fewer pieces."""
    run_on_ranks(case.world, _one_shape_body, case)


def _nested_tallies_body() -> None:
    mesh = get_mesh((1,))
    x = from_local_spec(
        torch.ones(4, 3), ShardTensorSpec.build(mesh, [Shard(0)], (4, 3), torch.float32)
    )
    with torch.no_grad(), tally_paths() as outer:
        _ = x + x
        with tally_paths() as inner:
            _ = x * 2.0
        _ = x.mean(0)
    assert dict(inner.ops) == {"fast": 1}, dict(inner.ops)
    assert dict(outer.ops) == {"fast": 2, "propagation": 1}, dict(outer.ops)
    assert set(outer.seconds) == {"fast", "propagation"}


def test_tallies_nest_each_counting_every_op_in_it() -> None:
    """A tally opened inside another (a ``WorkCounter`` in a ``host_overhead`` tally) counts
    its own block's ops; the outer one counts them too."""
    run_on_ranks(1, _nested_tallies_body)


def _spec_key_body() -> None:
    mesh = get_mesh((1,))
    a = ShardTensorSpec.build(mesh, [Shard(0)], (4, 3), torch.float64, {0: (4,)})
    b = ShardTensorSpec.build(mesh, [Shard(0)], (4, 3), torch.float32).with_dtype(torch.float64)
    assert b is a, "equal layouts built separately are one spec (with_dtype interns)"
    assert a.with_dtype(torch.float32) is a.with_dtype(torch.float32)
    key = pickle.loads(pickle.dumps(a.key))
    assert key == a.key and hash(key) == hash(a.key), "a key is its value, its hash recomputed"
    assert a.key != a.with_dtype(torch.float32).key


def test_spec_keys_are_values() -> None:
    run_on_ranks(1, _spec_key_body)
