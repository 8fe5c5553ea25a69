"""List keys, ``take`` and ``put`` through a replicated index along a split dim, against one
process, float64 (NOTE [A gather through a replicated index keeps the input's layout], NOTE
[Scatters through a replicated index write where they land]).

``x[[1, 2, 2, 5]]`` (a list key, with an ellipsis after or before it), ``x[mask]``,
``x[[1, 2, 5], [0, 3, 1]]`` (several indices: owners over the axes of the split indexed dims,
row-major) and ``take`` with a 1-D index whose entries' owners never decrease (on any layout:
read as ``x[i, j, k]`` when a dim other than the leading one is split) hold each entry
on the rank that owns its cell: the output is split along the entries' dim with each rank's
count of entries, no byte is received in the forward (``count_traffic``) and nothing is
gathered in the backward (the gather guard set to "error"). An index whose
owners go back (``x[[5, 0]]``) gives an output split the same way (NOTE [A selection through a
replicated index is split by its entries' owners]), each rank fetching the rows its entries
name and sending their gradient back (as many bytes as the forward received). An outer
product of indices of the input's extents (``x[i[:, None], j[None, :]]``, and aten's
``_unsafe_masked_index``, bilinear interpolation's decomposed read) keeps the input's layout,
and its backward sends the rows it read back to their owners (as many bytes in all as the
forward received), nothing gathered. ``put`` (plain and accumulating, negative positions) keeps the input's layout on any
layout and moves nothing. Values, the input's gradient and the output's layout (placements
and shard sizes, stated here from the rule) on 2 uneven ranks, 4 ranks with an empty shard
and a 2x2 mesh.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from shardsci import gather_policy
from shardsci.handlers import from_local_spec
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    check_against_reference,
    count_traffic,
    get_mesh,
    run_on_ranks,
)

SHAPE = (6, 5, 4)  # every index is along dim 0
LAYOUTS = {
    "2r-uneven": ((2,), Layout((Shard(0),), {0: (2, 4)})),
    "4r-empty": ((4,), Layout((Shard(0),), {0: (2, 0, 3, 1)})),
    "2x2-uneven": ((2, 2), Layout((Shard(0), Shard(1)), {0: (4, 2), 1: (1, 4)})),
}


def _owned(sizes: tuple[int, ...], rows: list[int]) -> tuple[int, ...]:
    """How many of ``rows`` (a dim-0 position each) fall in each shard of ``sizes``."""
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    return tuple(
        sum(start <= r < start + n for r in rows) for start, n in zip(starts, sizes, strict=True)
    )


def _along_dim0(layout: Layout, dim0: tuple[int, ...] | None) -> Layout:
    """``layout`` with dim 0 split as ``dim0`` (None: replicated over its axes)."""
    placements = [p if p.dim != 0 or dim0 is not None else Replicate() for p in layout.placements]
    sizes = {d: s for d, s in layout.sizes.items() if d != 0}
    if dim0 is not None:
        sizes[0] = dim0
    return Layout(tuple(placements), sizes)


def _cases(layout: Layout) -> dict[str, tuple]:
    """``(fn, expected layout, what moves)``: "nothing" or "rows" (the rows a read names
    travel, and back in the backward, nothing gathered)."""
    dim0 = tuple(layout.sizes[0])
    row = math.prod(SHAPE[1:])
    flat = [1 * row + 3, 2 * row, 2 * row + 1, 5 * row + 7]  # rows 1, 2, 2, 5
    cases = {
        "x[[1, 2, 2, 5]]": (
            lambda x: x[[1, 2, 2, 5]],
            _along_dim0(layout, _owned(dim0, [1, 2, 2, 5])),
            "nothing",
        ),
        "x[[0, 3], ...]": (
            lambda x: x[[0, 3], ...],
            _along_dim0(layout, _owned(dim0, [0, 3])),
            "nothing",
        ),
        "x[..., [4, 5], :, :]": (
            lambda x: x[..., [4, 5], :, :],
            _along_dim0(layout, _owned(dim0, [4, 5])),
            "nothing",
        ),
        "x[[5, 0]], owners going back": (
            lambda x: x[[5, 0]],
            _along_dim0(layout, _owned(dim0, [5, 0])),
            "rows",
        ),
        "x[mask], a boolean mask": (
            lambda x: x[torch.tensor([True, False, True, True, False, True])],
            _along_dim0(layout, _owned(dim0, [0, 2, 3, 5])),
            "nothing",
        ),
        "put": (
            lambda x: x.put(
                torch.tensor([3, 70, -1]), torch.tensor([1.0, 2.0, 3.0], dtype=x.dtype)
            ),
            layout,
            "nothing",
        ),
        "put_, accumulate, duplicates": (
            lambda x: x.clone().put_(
                torch.tensor([[3, 70], [3, 119]]),
                torch.arange(4, dtype=x.dtype),
                accumulate=True,
            ),
            layout,
            "nothing",
        ),
    }
    # several indices: the entries' owners over the axes of the split indexed dims, row-major
    pairs = ([1, 2, 5], [0, 3, 1])
    cases["x[[1, 2, 5], [0, 3, 1]], several indices"] = (
        lambda x: x[pairs],
        _held_by_owners(layout, list(zip(*pairs, strict=True))),
        "nothing",
    )
    # an outer product of indices of the input's extents (interpolation's): its layout kept
    rows, columns = torch.tensor([3, 0, 5, 1, 4, 2]), torch.tensor([4, 2, 0, 1, 3])
    cases["x[i[:, None], j[None, :]], an outer product"] = (
        lambda x: x[rows[:, None], columns[None, :]],
        layout,
        "rows",
    )
    # bilinear interpolation's read as torch decomposes it (compiled upsampling): clamped
    # indices, out-of-range entries masked to a fill; its backward is an accumulating
    # index_put of the gradient through both indices
    beyond = torch.tensor([3, 0, 7, 1, 4, -1])
    mask = ((beyond >= 0) & (beyond < SHAPE[0]))[:, None, None].expand(6, 5, 4)
    cases["aten _unsafe_masked_index, an outer product"] = (
        lambda x: torch.ops.aten._unsafe_masked_index.default(
            x, mask, [beyond.clamp(0, SHAPE[0] - 1)[:, None], columns[None, :]], -2.5
        ),
        layout,
        "rows",
    )
    # take: the flat positions' cells, each held by its owner (read as x[i, j, k] when a dim
    # other than the leading one is split: the shards are not runs of the flat order)
    cells = [torch.unravel_index(torch.tensor(p), SHAPE) for p in flat]
    cases["take"] = (
        lambda x: torch.take(x, torch.tensor(flat)),
        _held_by_owners(layout, [tuple(int(c) for c in cell) for cell in cells]),
        "nothing",
    )
    return cases


def _held_by_owners(layout: Layout, cells: list[tuple[int, ...]]) -> Layout:
    """The layout of entries read from ``cells`` (owners never decreasing), each held by the
    rank owning its cell: owners over the axes of the split dims, row-major."""
    owners = [0] * len(cells)
    for d in sorted(layout.sizes):
        for k, cell in enumerate(cells):
            owners[k] = owners[k] * len(layout.sizes[d]) + _owned(layout.sizes[d], [cell[d]]).index(
                1
            )
    counts = tuple(owners.count(k) for k in range(math.prod(len(v) for v in layout.sizes.values())))
    return Layout((Shard(0),) * len(layout.placements), {0: counts})


def _body(name: str) -> None:
    mesh_shape, layout = LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(*SHAPE, dtype=torch.float64)
    spec = layout.spec(mesh, x)
    shard = from_local_spec(spec.narrow(x).contiguous(), spec)
    for what, (fn, expected, moves) in _cases(layout).items():
        label = f"{name}: {what}"
        with gather_policy("error"):  # forward, backward
            check_against_reference(fn, [x], [layout], mesh, out_layouts=[expected], what=label)
        read = shard.detach().requires_grad_()
        with count_traffic() as forward:
            out = fn(read)
        if moves == "nothing":
            assert_all_ranks(forward.received == 0, f"{label}: received {forward.received} bytes")
            continue
        with count_traffic() as backward:
            out.backward(torch.ones_like(out))
        # the adjoint sends each row the read brought back to its owner, nothing more: the
        # ranks receive as many bytes in all as in the forward (a rank receives what the
        # others read from it)
        totals = torch.tensor([forward.received, backward.received])
        torch.distributed.all_reduce(totals)
        assert_all_ranks(
            totals[1] == totals[0],
            f"{label}: the ranks received {int(totals[1])} bytes in the backward, "
            f"{int(totals[0])} in the forward",
        )


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_list_keys_take_and_put_keep_the_split(name: str) -> None:
    run_on_ranks(math.prod(LAYOUTS[name][0]), _body, name)
