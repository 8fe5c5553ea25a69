"""Halo exchange against padding the whole tensor: every boundary, uneven, narrow and empty
shards, 1-D and 2-D block decompositions, exact adjoint, bytes at the face lower bound."""

from __future__ import annotations

from contextlib import nullcontext
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard
from torch.utils._python_dispatch import TorchDispatchMode

import shardsci
from shardsci.tensor import _halo
from shardsci.tensor._halo import halo_exchange
from shardsci.testing import (
    assert_all_ranks,
    assert_close_all_ranks,
    count_traffic,
    counted_comm,
    get_mesh,
    run_on_ranks,
)
from tests.exchange_ways import exchanges_as

MODES = {
    "zeros": "constant",
    "periodic": "circular",
    "reflect": "reflect",
    "replicate": "replicate",
}


def _padded(x: torch.Tensor, dim: int, left: int, right: int, boundary: str) -> torch.Tensor:
    moved = x.movedim(dim, -1)
    flat = moved.reshape(-1, 1, moved.shape[-1])
    out = F.pad(flat, (left, right), mode=MODES[boundary])
    return out.reshape(*moved.shape[:-1], out.shape[-1]).movedim(-1, dim)


def _window(padded: torch.Tensor, spec, coordinate, widths) -> torch.Tensor:
    """The cells of ``padded`` (the whole tensor padded by ``widths``) a rank extends to."""
    offsets, shape = spec.local_offsets(coordinate), spec.local_shape(coordinate)
    for dim, (left, right) in widths.items():
        padded = padded.narrow(dim, offsets[dim], shape[dim] + left + right)
    return padded


def _check(mesh_shape, shape, placements, sizes, widths, boundary) -> None:
    mesh = get_mesh(mesh_shape)
    whole = torch.randn(shape, dtype=torch.float64)
    leaf = whole.clone().requires_grad_(True)
    reference = leaf
    for dim in sorted(widths):
        reference = _padded(reference, dim, *widths[dim], boundary[dim])
    by_axis = {axis: sizes[p.dim] for axis, p in enumerate(placements)}
    x = shardsci.distribute_tensor(whole, mesh, placements, by_axis)
    local = x.to_local().detach().requires_grad_(True)
    sharded = shardsci.ShardTensor.from_local(local, mesh, placements, by_axis)
    with counted_comm("halo") as stats:
        extended = halo_exchange(sharded, {d: w for d, w in widths.items()}, boundary)
    expected = _window(reference, x._spec, mesh.get_coordinate(), widths)
    assert_close_all_ranks(extended.detach(), expected.detach(), atol=0, rtol=0, what="halo")
    # Adjoint: the loss is the sum over ranks of each rank's window times a weight; halo cells
    # appear in several windows, so their gradients add up at the owner.
    weight = torch.randn(reference.shape, dtype=torch.float64)
    everyone = [
        c.tolist()
        for c in torch.cartesian_prod(*map(torch.arange, mesh_shape)).reshape(-1, len(mesh_shape))
    ]
    total = sum(
        (_window(reference, x._spec, c, widths) * _window(weight, x._spec, c, widths)).sum()
        for c in everyone
    )
    total.backward()
    (extended * _window(weight, x._spec, mesh.get_coordinate(), widths)).sum().backward()
    expected_grad = x._spec.narrow(leaf.grad)
    assert_close_all_ranks(local.grad, expected_grad, atol=1e-12, rtol=1e-12, what="adjoint")
    return stats


def _one_d_body(sizes, widths, boundary) -> None:
    _check((len(sizes),), (sum(sizes), 3), [Shard(0)], {0: sizes}, {0: widths}, {0: boundary})


@pytest.mark.parametrize("boundary", list(MODES))
@pytest.mark.parametrize(
    ("sizes", "widths"),
    [
        ((5, 2), (1, 1)),
        ((40, 33, 30, 28), (2, 3)),
        ((4, 0, 3, 4), (2, 2)),  # an empty shard: its halo comes from two ranks away
        ((5, 1, 1, 6), (3, 2)),  # shards narrower than the halo: multi-hop
        ((7,), (2, 1)),  # one rank: a zeros boundary is a pad (NOTE [A local extension is a pad])
    ],
    ids=["2r-5/2", "4r-uneven-asym", "4r-empty", "4r-narrow", "1r"],
)
def test_one_d(sizes, widths, boundary) -> None:
    run_on_ranks(len(sizes), _one_d_body, sizes, widths, boundary)


def _block_body(boundary_h, boundary_w) -> None:
    _check(
        (2, 2),
        (2, 6, 7),
        [Shard(1), Shard(2)],
        {1: (4, 2), 2: (3, 4)},
        {1: (1, 2), 2: (2, 1)},
        {1: boundary_h, 2: boundary_w},
    )


@pytest.mark.parametrize(
    ("boundary_h", "boundary_w"),
    [("zeros", "zeros"), ("periodic", "periodic"), ("reflect", "replicate"), ("periodic", "zeros")],
)
def test_block_decomposition_edges_and_corners(boundary_h, boundary_w) -> None:
    run_on_ranks(4, _block_body, boundary_h, boundary_w)


def _face_bytes_body() -> None:
    sizes = (6, 5, 7, 4)
    stats = _check((4,), (22, 3), [Shard(0)], {0: sizes}, {0: (2, 1)}, {0: "periodic"})
    face = 3 * 8
    assert_all_ranks(
        stats.received["halo"] == 3 * face and stats.sent["halo"] == 3 * face,
        f"halo moved {dict(stats.sent)} / {dict(stats.received)}, faces are {3 * face} bytes",
    )


def test_halo_volume_is_the_faces() -> None:
    run_on_ranks(4, _face_bytes_body)


def _posted_body(way: str | None) -> dict[str, object]:
    batches = []
    batched = torch.distributed.batch_isend_irecv

    def counted(ops):
        batches.append(len(ops))
        return batched(ops)

    with (
        exchanges_as(way) if way else nullcontext(),
        mock.patch.object(torch.distributed, "batch_isend_irecv", counted),
        count_traffic() as traffic,
    ):
        _check((4,), (22, 3), [Shard(0)], {0: (6, 5, 7, 4)}, {0: (2, 1)}, {0: "periodic"})
    me = torch.distributed.get_rank()
    return {
        "batches": batches,
        "messages": traffic.messages,
        "rounds": traffic.p2p_rounds,
        "all_to_alls": traffic.collectives["c10d::alltoall_base_"],
        "spans": {
            span.ranks: n for span, n in traffic.calls_by_span.items() if span.kind != "all_reduce"
        },
        "bytes": {
            kind: (traffic.sent_by_kind[kind], traffic.received_by_kind[kind])
            for kind in ("p2p", "all_to_all")
        },
        "neighbours": tuple(sorted({me, (me - 1) % 4, (me + 1) % 4})),
    }


def _faces_both_ways() -> tuple[int, int]:
    """Bytes a rank of ``_posted_body`` sends and receives, forward and adjoint: a periodic
    halo of (2, 1) rows of 3 float64 on each rank of 4, so 3 rows in and 3 out each way."""
    face = 3 * 8
    return 2 * 3 * face, 2 * 3 * face


def test_gloo_halos_are_one_all_to_all_per_exchange() -> None:
    """NOTE [An exchange of messages as one all-to-all where messages are slow]: on gloo (the
    rule as it stands, no override) each exchange, forward and adjoint, is one
    ``all_to_all_single`` over the axis's group connecting the rank with its two neighbours
    only, no message, the faces' bytes. Fails if eager halos revert to messages on gloo."""
    for result in run_on_ranks(4, _posted_body, None):
        assert result["all_to_alls"] == 2, result
        assert (result["messages"], result["rounds"], result["batches"]) == (0, 0, []), result
        assert result["spans"] == {result["neighbours"]: 2}, result
        assert result["bytes"] == {"p2p": (0, 0), "all_to_all": _faces_both_ways()}, result


def test_halo_messages_are_posted_one_by_one_in_one_round() -> None:
    """Where the rule says messages, NOTE [Messages posted one by one where the backend does
    not batch them]: on gloo no ``batch_isend_irecv``; per rank and direction (forward,
    adjoint) a message to and one from each of the two neighbours, posted back to back (one
    round), the same bytes as one all-to-all."""
    for result in run_on_ranks(4, _posted_body, "messages"):
        assert result["batches"] == [] and result["all_to_alls"] == 0, result
        assert (result["messages"], result["rounds"]) == (2 * 2 * 2, 2), result
        assert result["bytes"] == {"p2p": _faces_both_ways(), "all_to_all": (0, 0)}, result


def _own_dtype_body(way: str) -> dict[str, object]:
    """A periodic halo of one row on 2 ranks in several dtypes, exchanged ``way``: the dtypes
    posted as messages, the bytes counted at the dispatcher, whether the values are the
    reference's."""
    mesh = get_mesh((2,))
    posted, results = [], {}
    isend = torch.distributed.isend

    def recorded(tensor, *args, **kwargs):
        posted.append(tensor.dtype)
        return isend(tensor, *args, **kwargs)

    with exchanges_as(way):
        for dtype in (torch.float64, torch.bfloat16, torch.int64, torch.complex128, torch.bool):
            whole = (torch.arange(15).reshape(5, 3) % 7).to(dtype)
            x = shardsci.distribute_tensor(whole, mesh, [Shard(0)], {0: (3, 2)})
            posted.clear()
            with (
                mock.patch.object(torch.distributed, "isend", recorded),
                count_traffic() as traffic,
            ):
                extended = halo_exchange(x, {0: 1}, "periodic")
            padded = torch.cat([whole[-1:], whole, whole[:1]])
            expected = _window(padded, x._spec, mesh.get_coordinate(), {0: (1, 1)})
            results[str(dtype)] = (
                sorted({str(d) for d in posted}),
                traffic.sent,
                traffic.received,
                extended.dtype == dtype and torch.equal(extended, expected),
            )
    return results


@pytest.mark.parametrize("way", ["messages", "all_to_all"])
def test_halo_messages_travel_in_their_own_dtype(way) -> None:
    """NOTE [Messages in their own dtype]: standard dtypes are posted as they are, complex and
    bool as bytes; one all-to-all moves every dtype as bytes; the same bytes either way, the
    same values."""
    row = 3  # elements in one halo row; one row each way per rank (periodic, 2 ranks)
    as_is = {"messages": lambda dtype: [dtype], "all_to_all": lambda dtype: []}[way]
    as_bytes = [] if way == "all_to_all" else ["torch.uint8"]
    for result in run_on_ranks(2, _own_dtype_body, way):
        assert result == {
            "torch.float64": (as_is("torch.float64"), 2 * row * 8, 2 * row * 8, True),
            "torch.bfloat16": (as_is("torch.bfloat16"), 2 * row * 2, 2 * row * 2, True),
            "torch.int64": (as_is("torch.int64"), 2 * row * 8, 2 * row * 8, True),
            "torch.complex128": (as_bytes, 2 * row * 16, 2 * row * 16, True),
            "torch.bool": (as_bytes, 2 * row, 2 * row, True),
        }, result


def _too_wide_body() -> None:
    mesh = get_mesh((2,))
    x = shardsci.distribute_tensor(torch.randn(5, 2), mesh, [Shard(0)], {0: (3, 2)})
    from shardsci.testing import assert_raises_all_ranks

    assert_raises_all_ranks(ValueError, "reflect padding of 5", halo_exchange, x, {0: 5}, "reflect")


def test_reflect_wider_than_the_domain_is_refused() -> None:
    run_on_ranks(2, _too_wide_body)


def _block_zeros_bytes_body() -> None:
    """On a 2x2 block with a zeros boundary, corner cells beyond the domain do not travel:
    each rank receives exactly the halo cells inside the domain that it does not own."""
    sizes = {1: (4, 2), 2: (3, 4)}
    stats = _check(
        (2, 2),
        (2, 6, 7),
        [Shard(1), Shard(2)],
        sizes,
        {1: (1, 1), 2: (1, 1)},
        {1: "zeros", 2: "zeros"},
    )
    row, col = (int(c) for c in get_mesh((2, 2)).get_coordinate())
    h, w = sizes[1][row], sizes[2][col]
    h_lo, w_lo = (0, 4)[row], (0, 3)[col]
    inside_h = min(h_lo + h + 1, 6) - max(h_lo - 1, 0)
    inside_w = min(w_lo + w + 1, 7) - max(w_lo - 1, 0)
    lacking = 2 * (inside_h * inside_w - h * w) * 8
    assert_all_ranks(
        stats.received["halo"] == lacking,
        f"received {stats.received['halo']} halo bytes, the cells lacking are {lacking} bytes",
    )


def test_block_corners_beyond_a_zeros_boundary_do_not_travel() -> None:
    run_on_ranks(4, _block_zeros_bytes_body)


class _Ops(TorchDispatchMode):
    """The aten ops dispatched, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _local_pad_body() -> list[str]:
    mesh = get_mesh((1,))
    x = shardsci.ShardTensor.from_local(torch.randn(2, 5, 4, dtype=torch.float64), mesh, [Shard(1)])
    with _Ops() as counted:
        halo_exchange(x, {1: (2, 1), 2: 1}, "zeros")
    return counted.ops


def test_an_extension_that_moves_nothing_is_one_pad() -> None:
    """NOTE [A local extension is a pad]: on one rank, zeros beyond both dims' edges (the
    values and the adjoint are checked by ``test_one_d[1r-zeros]``)."""
    (ops,) = run_on_ranks(1, _local_pad_body)
    assert [op for op in ops if op.split(".")[0] not in ("view", "alias")] == [
        "constant_pad_nd.default"
    ], ops


def _repeated_body() -> list[int]:
    """A training step repeats its halo exchanges on one layout; H split 5/3, W whole."""
    mesh = get_mesh((2,))
    whole = torch.randn(2, 8, 4, dtype=torch.float64)
    x = shardsci.distribute_tensor(whole, mesh, [Shard(1)], {0: (5, 3)})
    planned = []
    with mock.patch.object(_halo, "_composed", wraps=_halo._composed) as composed:
        for _ in range(3):
            local = x.to_local().detach().requires_grad_(True)
            sharded = shardsci.ShardTensor.from_local(local, mesh, [Shard(1)], {0: (5, 3)})
            halo_exchange(sharded, {1: (2, 1), 2: 1}, {1: "reflect", 2: "zeros"}).sum().backward()
            planned.append(composed.call_count)
    return planned


def test_a_repeated_extension_is_planned_once() -> None:
    """Where each step's cells lie in the buffer (fills, boundary copies, received runs) is
    found on the first exchange of a layout, not on every one (``_Step.filled_here``,
    ``received``; values and adjoint: ``test_one_d``, ``test_block_...``)."""
    for planned in run_on_ranks(2, _repeated_body):
        assert planned[0] > 0 and planned[1:] == [planned[0]] * 2, planned
