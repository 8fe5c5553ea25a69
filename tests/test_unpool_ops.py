"""Max unpooling of spatially sharded tensors against one process, float64: values, the
gradient of the values, and the output's layout (each cell on the owner of the pooled cell
whose window is the last to start at or before it); indices sharded as the values or held
whole; 1-D meshes of 2 and 4 ranks (an empty shard; channels sharded), 2x2 blocks in 2-D and
3-D; and what
moves, counted by ``count_traffic``: nothing but a flag when windows do not overlap, the
overlapping faces when they do, never the field.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from shardsci.handlers import from_local_spec
from shardsci.tensor._collectives import axis_group
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    assert_raises_all_ranks,
    check_against_reference,
    count_traffic,
    get_mesh,
    run_on_ranks,
)
from tests.expected_layouts import parse, windowed
from tests.layouts import Sharded

_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_UNPOOL = {1: F.max_unpool1d, 2: F.max_unpool2d, 3: F.max_unpool3d}

# The pooled tensors' layouts (what max_unpool receives).
CASES = [
    Sharded("1d-2r-L-4/3", (2,), (2, 3, 7), Layout((Shard(2),), {2: (4, 3)})),
    Sharded("2d-4r-H-2/0/3/1", (4,), (2, 2, 6, 5), Layout((Shard(2),), {2: (2, 0, 3, 1)})),
    Sharded("2d-4r-C-1/0/0/1", (4,), (2, 2, 3, 4), Layout((Shard(1),), {1: (1, 0, 0, 1)})),
    Sharded(
        "2d-2x2-block", (2, 2), (1, 2, 5, 6), Layout((Shard(2), Shard(3)), {2: (3, 2), 3: (2, 4)})
    ),
    Sharded(
        "3d-2x2-DW", (2, 2), (1, 2, 4, 3, 5), Layout((Shard(2), Shard(4)), {2: (1, 3), 4: (3, 2)})
    ),
]
# name -> (kernel, stride, padding): windows that tile, overlap, gap, and overlap with padding.
WINDOWS = {"k2": (2, 2, 0), "k3-s2": (3, 2, 0), "k2-s3": (2, 3, 0), "k3-s2-p1": (3, 2, 1)}


def _pooled(case: Sharded, kernel: int, stride: int, padding: int):
    """Values and indices of a max pooling whose output has ``case.shape``, and the size of
    the plane it pooled."""
    n = len(case.shape) - 2
    extents = [(e - 1) * stride - 2 * padding + kernel for e in case.shape[2:]]
    x = torch.randn(*case.shape[:2], *extents, dtype=torch.float64)
    values, indices = _POOL[n](x, kernel, stride, padding, return_indices=True)
    assert values.shape == case.shape
    return values, indices, extents


def _unpooled_layout(case: Sharded, stride: int, padding: int):
    """Output cell ``i`` on the rank holding pooled cell ``(i + p) // s``."""
    anchors = {d: (lambda i: (i + padding) // stride) for d in range(2, len(case.shape))}
    return windowed(case.layout, case.shape, case.mesh, anchors)


def _body(case: Sharded) -> None:
    mesh = get_mesh(case.mesh)
    n = len(case.shape) - 2
    torch.manual_seed(0)
    for name, (kernel, stride, padding) in WINDOWS.items():
        values, indices, extents = _pooled(case, kernel, stride, padding)
        expected = [_unpooled_layout(case, stride, padding)]
        window = (kernel, stride, padding)

        def unpool(v, i, window=window, extents=extents):
            return _UNPOOL[n](v, i, *window, output_size=extents)

        check_against_reference(
            lambda v, i=indices, u=unpool: u(v, i), [values], [case.layout], mesh,
            out_layouts=expected, what=f"{name}, plain indices",
        )  # fmt: skip
        check_against_reference(
            unpool, [values, indices], [case.layout, case.layout], mesh, out_layouts=expected,
            what=f"{name}, sharded indices",
        )  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=str)
def test_max_unpool_writes_where_each_value_lands(case: Sharded) -> None:
    run_on_ranks(case.world, _body, case)


def _traffic_body(case: Sharded, window: str) -> int:
    kernel, stride, padding = WINDOWS[window]
    n = len(case.shape) - 2
    mesh = get_mesh(case.mesh)
    torch.manual_seed(0)
    values, indices, extents = _pooled(case, kernel, stride, padding)
    spec = case.layout.spec(mesh, values)
    shard = from_local_spec(spec.narrow(values).contiguous(), spec)
    index = from_local_spec(spec.narrow(indices).contiguous(), spec.with_dtype(indices.dtype))
    with count_traffic() as traffic:
        _UNPOOL[n](shard, index, kernel, stride, padding, output_size=extents)
    # A halo exchange is messages or one all-to-all, as the axis's group has it (NOTE [An
    # exchange of messages as one all-to-all where messages are slow]).
    halo = "all_to_all" if axis_group(mesh, (0,)).messages_in_one_collective else "p2p"
    assert_all_ranks(
        set(traffic.calls_by_kind) <= {"all_reduce", halo}, f"{dict(traffic.calls_by_kind)}"
    )
    return traffic.received_by_kind.get(halo, 0)


def test_max_unpool_moves_only_the_overlapping_faces() -> None:
    """2 ranks, L split 4/3 of a pooled (2, 3, 7): with windows that tile (k2) no cell
    moves, only the one-number flag that says every index lies in its shard's block; with
    k3-s2 rank 0's last window reaches rank 1's first cell: one cell per plane, its value and
    its count (2 x 3 planes x 2 x 8 bytes), the field never."""
    case = CASES[0]
    assert run_on_ranks(2, _traffic_body, case, "k2") == [0, 0]
    assert run_on_ranks(2, _traffic_body, case, "k3-s2") == [0, 2 * 3 * 2 * 8]


def _stray_index_body() -> None:
    """An index outside the block its shard's windows cover (torch allows any index of the
    plane): every rank declines alike, and the default path's gather is the gather guard's
    to allow (the right values) or refuse (one error on every rank)."""
    from shardsci import GatherError, gather_policy

    case = CASES[0]
    mesh = get_mesh(case.mesh)
    torch.manual_seed(0)
    values, indices, extents = _pooled(case, 2, 2, 0)
    indices[1, 2, 0] = extents[0] - 1  # rank 0's first cell, written at rank 1's last

    def unpool(v):
        return F.max_unpool1d(v, indices, 2, 2, 0, output_size=extents)

    with gather_policy("allow"):
        check_against_reference(unpool, [values], [case.layout], mesh, out_layouts=[parse("R")],
                                not_a_gather="an index outside its shard's windows")  # fmt: skip
    spec = case.layout.spec(mesh, values)
    shard = from_local_spec(spec.narrow(values).contiguous(), spec)
    with gather_policy("error"):
        assert_raises_all_ranks(GatherError, "max_unpool", unpool, shard)


def test_an_index_outside_its_windows_takes_the_guarded_gather() -> None:
    run_on_ranks(2, _stray_index_body)
