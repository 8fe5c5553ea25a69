"""A selection through a replicated 1-D index in no increasing owner order, along a split dim,
against one process, float64 (NOTE [A selection through a replicated index is split by its
entries' owners]).

``x[idx]``, ``index_select`` and ``x[:, idx]`` with entries out of order and repeated, an
index shorter and one longer than the dim, on 2 uneven ranks, 4 ranks with an empty shard, a
2x2 mesh (two dims split), a dim split over both axes of a 2x2 mesh and a 2x2x2 mesh: values,
the input's gradient (the backward adds each fetched row's gradient into its owner), nothing
gathered (the guard set to "error"), and the output's layout stated here from the rule: the
indexed dim split over its axes with as many entries on each rank as name that rank's rows,
the other dims as the input. Per rank, ``count_traffic``: the forward receives exactly the
distinct remote rows of its run of entries (at most the rows it reads), the backward exactly
the rows the other ranks' runs fetched from it.

Scatters of a source so split (``index_reduce`` prod, mean, amax, amin, with and without the
destination's values, ``index_copy``; NOTE [A source split by its entries' owners is sent to
them]): values, both gradients, the destination's layout kept, nothing gathered, and per rank
the forward receives exactly the entries naming its rows held elsewhere, the backward exactly
its entries' gradients from their owners; and a read scattered back through ``index_reduce``
(whose torch backward scatters the read).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.distributed.tensor import Shard

from shardsci import gather_policy, record_gathers
from shardsci.handlers import from_local_spec
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    check_against_reference,
    count_traffic,
    get_mesh,
    run_on_ranks,
)

SHAPE = (6, 4, 3)
LAYOUTS = {
    "2r-uneven": ((2,), Layout((Shard(0),), {0: (2, 4)})),
    "4r-empty": ((4,), Layout((Shard(0),), {0: (3, 0, 2, 1)})),
    "2x2-uneven": ((2, 2), Layout((Shard(0), Shard(1)), {0: (4, 2), 1: (1, 3)})),
    "2x2-nested": ((2, 2), Layout((Shard(0), Shard(0)), {0: (1, 2, 0, 3)})),
    "2x2x2": ((2, 2, 2), Layout((Shard(0), Shard(1), Shard(2)), {0: (4, 2), 1: (3, 1), 2: (0, 3)})),
}
# (fn, indexed dim, index)
SHORTER = torch.tensor([5, 0, 3])
LONGER = torch.tensor([4, 1, 1, 5, 0, 2, 4, 3, 0])
ACROSS = torch.tensor([3, 0, 3, 1, 2])
CASES = {
    "x[idx], out of order, shorter": (lambda x: x[SHORTER], 0, SHORTER),
    "index_select, repeated, longer": (lambda x: x.index_select(0, LONGER), 0, LONGER),
    "x[:, idx], along dim 1, repeated, longer": (lambda x: x[:, ACROSS], 1, ACROSS),
}


def _group(layout: Layout, dim: int, mesh) -> tuple[tuple[int, ...], int]:
    """The shard sizes along ``dim`` and this rank's position in the group splitting it."""
    axes = [a for a, p in enumerate(layout.placements) if p.dim == dim]
    coordinate = mesh.get_coordinate()
    position = 0
    for a in axes:
        position = position * mesh.shape[a] + coordinate[a]
    return tuple(layout.sizes[dim]), position


def _owner(sizes: tuple[int, ...], row: int) -> int:
    bounds = [sum(sizes[: k + 1]) for k in range(len(sizes))]
    return next(k for k, b in enumerate(bounds) if row < b)


def _runs(sizes: tuple[int, ...], index: torch.Tensor) -> list[list[int]]:
    """Each rank's run of entries: as many as name its rows, in the index's order."""
    counts = [sum(_owner(sizes, int(i)) == k for i in index) for k in range(len(sizes))]
    starts = [0, *itertools.accumulate(counts)]
    return [[int(i) for i in index[a:b]] for a, b in itertools.pairwise(starts)]


def _expected(layout: Layout, dim: int, index: torch.Tensor) -> Layout:
    sizes = dict(layout.sizes)
    sizes[dim] = tuple(len(run) for run in _runs(tuple(layout.sizes[dim]), index))
    return Layout(layout.placements, sizes)


def _body(name: str) -> None:
    mesh_shape, layout = LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(SHAPE, dtype=torch.float64)
    spec = layout.spec(mesh, x)
    shard = from_local_spec(spec.narrow(x).contiguous(), spec)
    for what, (fn, dim, index) in CASES.items():
        if dim not in layout.sizes:
            continue
        label = f"{name}: {what}"
        expected = _expected(layout, dim, index)
        with gather_policy("error"), record_gathers() as gathers:
            check_against_reference(fn, [x], [layout], mesh, out_layouts=[expected], what=label)
            leaf = shard.detach().requires_grad_()
            with count_traffic() as forward:
                out = fn(leaf)
            with count_traffic() as backward:
                out.backward(torch.ones_like(out))
        assert_all_ranks(not gathers, f"{label}: gathered {gathers}")
        sizes, me = _group(layout, dim, mesh)
        runs = _runs(sizes, index)
        row = math.prod(n for d, n in enumerate(spec.local_shape()) if d != dim) * 8
        fetched = [{r for r in run if _owner(sizes, r) != k} for k, run in enumerate(runs)]
        bounds = (
            len(fetched[me]) * row,
            sum(_owner(sizes, r) == me for k, rows in enumerate(fetched) for r in rows) * row,
        )
        assert_all_ranks(
            (forward.received, backward.received) == bounds
            and forward.received <= len(runs[me]) * row,
            f"{label}: received {forward.received} and {backward.received} B forward and "
            f"backward; the remote rows its run reads and the others fetched from it: {bounds}",
        )


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n == "2x2x2" else n for n in LAYOUTS]
)
def test_a_selection_in_no_owner_order_is_split_by_its_entries_owners(name: str) -> None:
    run_on_ranks(math.prod(LAYOUTS[name][0]), _body, name)


# ---------------------------------------------------------------------------- scatters
# (fn of the destination and a source split by its entries' owners, indexed dim, index)
SCATTERS = {
    "index_reduce prod, repeated": (
        lambda x, s: x.index_reduce(0, LONGER, s, "prod"),
        0,
        LONGER,
    ),
    "index_reduce mean without self": (
        lambda x, s: x.index_reduce(0, LONGER, s, "mean", include_self=False),
        0,
        LONGER,
    ),
    "index_reduce amax, along dim 1": (
        lambda x, s: x.index_reduce(1, ACROSS, s, "amax"),
        1,
        ACROSS,
    ),
    "index_reduce amin without self, along dim 1": (
        lambda x, s: x.index_reduce(1, ACROSS, s, "amin", include_self=False),
        1,
        ACROSS,
    ),
    "index_copy, out of order": (lambda x, s: x.index_copy(0, SHORTER, s), 0, SHORTER),
}
# a read's source scattered back: torch's backward of index_reduce scatters such a read
READ_BACK = {
    "x.index_reduce(0, idx, x[idx].sin(), prod)": (
        lambda x: x.index_reduce(0, LONGER, x[LONGER].sin(), "prod", include_self=False), 0,
    ),
    "x.index_reduce(1, idx, x[:, idx] * 2, amax)": (
        lambda x: x.index_reduce(1, ACROSS, x[:, ACROSS] * 2, "amax"), 1,
    ),
}  # fmt: skip


def _scatter_body(name: str) -> None:
    mesh_shape, layout = LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(1)
    x = torch.randn(SHAPE, dtype=torch.float64)
    spec = layout.spec(mesh, x)
    for what, (fn, dim, index) in SCATTERS.items():
        if dim not in layout.sizes:
            continue
        label = f"{name}: {what}"
        source_layout = _expected(layout, dim, index)
        shape = list(SHAPE)
        shape[dim] = len(index)
        s = torch.randn(shape, dtype=torch.float64)
        source_spec = source_layout.spec(mesh, s)
        with gather_policy("error"), record_gathers() as gathers:
            check_against_reference(
                fn, [x, s], [layout, source_layout], mesh, out_layouts=[layout], what=label
            )
            leaves = [
                from_local_spec(sp.narrow(t).contiguous(), sp).requires_grad_()
                for t, sp in ((x, spec), (s, source_spec))
            ]
            with count_traffic() as forward:
                out = fn(*leaves)
            with count_traffic() as backward:
                out.backward(torch.ones_like(out))
        assert_all_ranks(not gathers, f"{label}: gathered {gathers}")
        sizes, me = _group(layout, dim, mesh)
        runs = _runs(sizes, index)
        row = math.prod(n for d, n in enumerate(spec.local_shape()) if d != dim) * 8
        # each entry moves once, to the owner of its row, and its gradient back
        arriving = sum(_owner(sizes, r) == me for k, run in enumerate(runs) if k != me for r in run)
        leaving = sum(_owner(sizes, r) != me for r in runs[me])
        assert_all_ranks(
            (forward.received, backward.received) == (arriving * row, leaving * row),
            f"{label}: received {forward.received} and {backward.received} B forward and "
            f"backward; the entries sent to its rows and its entries' gradients: "
            f"{arriving * row}, {leaving * row}",
        )
    for what, (fn, dim) in READ_BACK.items():
        if dim in layout.sizes:
            with gather_policy("error"):
                check_against_reference(
                    fn, [x], [layout], mesh, out_layouts=[layout], what=f"{name}: {what}"
                )


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n == "2x2x2" else n for n in LAYOUTS]
)
def test_a_source_split_by_its_entries_owners_is_sent_to_them(name: str) -> None:
    run_on_ranks(math.prod(LAYOUTS[name][0]), _scatter_body, name)
