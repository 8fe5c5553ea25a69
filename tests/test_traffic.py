"""The independent traffic count: every kind of collective is seen and sized, whoever issues
it, under its kind; messages are grouped in rounds and the order of events is logged; and
``counted_comm`` fails when traffic goes around shardsci's own count."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Replicate, Shard

import shardsci
from shardsci.tensor._comm_stats import record_comm
from shardsci.testing import (
    assert_all_ranks,
    count_traffic,
    counted_comm,
    get_mesh,
    run_on_ranks,
)

F64 = 8  # bytes per float64


def _rank() -> int:
    return dist.get_rank()


# Each: issue one collective on 4 ranks of float64 rows; expected (sent, received) bytes on rank r.
def _all_to_all_single() -> None:
    r = _rank()
    splits = [(r + k) % 3 for k in range(4)]  # rows to each rank
    incoming = [(k + r) % 3 for k in range(4)]
    out = torch.empty(sum(incoming), 2, dtype=torch.float64)
    dist.all_to_all_single(out, torch.ones(sum(splits), 2, dtype=torch.float64), incoming, splits)


def _expected_all_to_all(r: int) -> tuple[int, int]:
    own = (2 * r) % 3
    total = sum((r + k) % 3 for k in range(4))
    return (total - own) * 2 * F64, (total - own) * 2 * F64


def _p2p() -> None:
    r = _rank()
    ops = [
        dist.P2POp(dist.isend, torch.ones(r + 1, dtype=torch.float64), (r + 1) % 4),
        dist.P2POp(dist.irecv, torch.empty((r - 1) % 4 + 1, dtype=torch.float64), (r - 1) % 4),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _functional_all_to_all_backward() -> None:
    x = torch.ones(8, dtype=torch.float64, requires_grad=True)
    y = funcol.all_to_all_single_autograd(x, [2, 2, 2, 2], [2, 2, 2, 2], dist.group.WORLD)
    funcol.wait_tensor(y).sum().backward()


CASES: dict[str, tuple[Callable[[], None], Callable[[int], tuple[int, int]], int, int]] = {
    # name -> (body, expected (sent, received) on rank r, collectives, messages); the kind
    # they are counted under is in KIND_OF
    "all_reduce": (
        lambda: dist.all_reduce(torch.ones(10, dtype=torch.float64)),
        lambda r: (2 * 3 * 80 // 4,) * 2,
        1,
        0,
    ),
    "all_to_all_single": (_all_to_all_single, _expected_all_to_all, 1, 0),
    "broadcast": (
        lambda: dist.broadcast(torch.ones(5, dtype=torch.float64), src=2),
        lambda r: (3 * 40, 0) if r == 2 else (0, 40),
        1,
        0,
    ),
    "all_gather_into_tensor": (
        lambda: dist.all_gather_into_tensor(
            torch.empty(12, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
        ),
        lambda r: (3 * 24, 3 * 24),
        1,
        0,
    ),
    "all_gather_list": (
        lambda: dist.all_gather(
            [torch.empty(3, dtype=torch.float64) for _ in range(4)],
            torch.ones(3, dtype=torch.float64),
        ),
        lambda r: (3 * 24, 3 * 24),
        1,
        0,
    ),
    "reduce_scatter_tensor": (
        lambda: dist.reduce_scatter_tensor(
            torch.empty(2, dtype=torch.float64), torch.ones(8, dtype=torch.float64)
        ),
        lambda r: (6 * F64, 6 * F64),
        1,
        0,
    ),
    "p2p": (_p2p, lambda r: ((r + 1) * F64, ((r - 1) % 4 + 1) * F64), 0, 2),
    "funcol_all_reduce": (
        lambda: funcol.wait_tensor(
            funcol.all_reduce(torch.ones(6, dtype=torch.float64), "sum", dist.group.WORLD)
        ),
        lambda r: (2 * 3 * 48 // 4,) * 2,
        1,
        0,
    ),
    "funcol_all_gather": (
        lambda: funcol.wait_tensor(
            funcol.all_gather_tensor(torch.ones(2, dtype=torch.float64), 0, dist.group.WORLD)
        ),
        lambda r: (3 * 16, 3 * 16),
        1,
        0,
    ),
    "funcol_all_to_all_and_its_backward": (
        _functional_all_to_all_backward,
        lambda r: (2 * 6 * F64, 2 * 6 * F64),
        2,
        0,
    ),
}


KIND_OF = {
    "all_reduce": "all_reduce",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "all_gather_into_tensor": "all_gather",
    "all_gather_list": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "p2p": "p2p",
    "funcol_all_reduce": "all_reduce",
    "funcol_all_gather": "all_gather",
    "funcol_all_to_all_and_its_backward": "all_to_all",
}


def _count_body(name: str) -> None:
    body, expected, collectives, messages = CASES[name]
    with count_traffic() as traffic:
        body()
    got = (traffic.sent, traffic.received, traffic.collective_calls, traffic.messages)
    want = (*expected(_rank()), collectives, messages)
    assert_all_ranks(
        got == want and not traffic.unknown,
        f"{name}: (sent, received, collectives, messages) = {got}, expected {want} "
        f"(unknown ops {traffic.unknown})",
    )
    kind = KIND_OF[name]
    by_kind = traffic.as_dict()
    want_by_kind = {
        "sent": {kind: want[0]},
        "received": {kind: want[1]},
        "calls": {kind: collectives + messages},
        "p2p_rounds": int(messages > 0),
    }
    assert_all_ranks(by_kind == want_by_kind, f"{name}: {by_kind}, expected {want_by_kind}")


@pytest.mark.parametrize("name", list(CASES))
def test_every_kind_of_collective_is_counted_with_its_bytes(name: str) -> None:
    run_on_ranks(4, _count_body, name)


# ---------------------------------------------------------------------------- spans
def _spans_on_a_2x2_mesh() -> dict:
    """On a 2x2 mesh (rank r at row r // 2, column r % 2): an all-reduce over the row axis's
    group, an all-to-all over all 4 whose pieces go to one's row only, and a message to the
    rank below."""
    r, mesh = _rank(), get_mesh((2, 2), ("rows", "cols"))
    column = mesh.get_group("rows")  # the ranks of this rank's column: along the rows axis
    with count_traffic() as traffic:
        dist.all_reduce(torch.ones(3, dtype=torch.float64), group=column)
        in_row = [1 if k // 2 == r // 2 else 0 for k in range(4)]
        out = torch.empty(sum(in_row), dtype=torch.float64)
        dist.all_to_all_single(out, torch.ones(sum(in_row), dtype=torch.float64), in_row, in_row)
        below = (r + 2) % 4
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, torch.ones(5, dtype=torch.float64), below),
                dist.P2POp(dist.irecv, torch.empty(5, dtype=torch.float64), below),
            ]
        )
        for work in works:
            work.wait()
    return {
        "calls": {(s.kind, s.ranks, s.group): n for s, n in traffic.calls_by_span.items()},
        "received": {(s.kind, s.ranks, s.group): n for s, n in traffic.received_by_span.items()},
    }


def test_each_collective_is_kept_with_the_ranks_it_connects() -> None:
    """NOTE [The span of a collective], against the rank grid ``arange(4).view(2, 2)``: the
    all-reduce spans one column, the all-to-all the ranks it sends non-empty pieces to (one
    row, though issued over all 4: its group, which its host time grows with), each message
    its two ends."""
    grid = torch.arange(4).view(2, 2)
    for r, result in enumerate(run_on_ranks(4, _spans_on_a_2x2_mesh)):
        column = tuple(grid[:, r % 2].tolist())
        row = tuple(grid[r // 2].tolist())
        pair = tuple(sorted((r, (r + 2) % 4)))
        assert result["calls"] == {
            ("all_reduce", column, 2): 1,
            ("all_to_all", row, 4): 1,
            ("p2p", pair, 4): 2,
        }
        assert result["received"] == {
            ("all_reduce", column, 2): 3 * F64,  # the ring's 2 (P - 1) / P of 3 float64
            ("all_to_all", row, 4): F64,
            ("p2p", pair, 4): 5 * F64,
        }


# ---------------------------------------------------------------------------- rounds and the log
def _two_batches_and_a_read() -> dict:
    r = _rank()
    with count_traffic(watch={"aten::mul"}) as traffic:
        for _ in range(2):
            works = dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend, torch.full((3,), float(r)), (r + 1) % 4),
                    dist.P2POp(dist.irecv, received := torch.empty(3), (r - 1) % 4),
                ]
            )
            torch.ones(2) * 2  # computed while the messages fly
            for work in works:
                work.wait()
            received.sum()  # the first read of the message
    return {"rounds": traffic.p2p_rounds, "log": [tuple(e) for e in traffic.log]}


def test_rounds_of_messages_and_the_order_of_events() -> None:
    post, mul = ("post", "c10d::send", None), ("op", "aten::mul", None)
    one = [post, ("post", "c10d::recv_", 0), mul, ("read", "aten::sum", 0)]
    two = [post, ("post", "c10d::recv_", 1), mul, ("read", "aten::sum", 1)]
    for result in run_on_ranks(4, _two_batches_and_a_read):
        assert result == {"rounds": 2, "log": one + two}


# ---------------------------------------------------------------------------- counted_comm
def _sharded() -> shardsci.ShardTensor:
    mesh = get_mesh((4,))
    x = torch.randn(9, 5, dtype=torch.float64)
    return shardsci.distribute_tensor(x, mesh, [Shard(0)], {0: (4, 0, 3, 2)})


def _shardsci_traffic() -> None:
    x = _sharded().requires_grad_()
    with counted_comm("redistribute"):
        y = x.redistribute(placements=[Shard(1)]) * 2
        y.redistribute(placements=[Replicate()]).to_local().sum().backward()


def _around_record_comm(how: str) -> str:
    x = _sharded()
    try:
        with counted_comm(how):
            x.redistribute(placements=[Shard(1)])
            if how == "c10d":
                dist.all_reduce(torch.ones(4))
            elif how == "functional":
                funcol.wait_tensor(funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD))
            elif how == "dtensor":
                d = DTensor.from_local(torch.ones(2, 3), get_mesh((4,)), [Shard(0)])
                d.redistribute(placements=[Replicate()])
            elif how == "record_without_collective":
                record_comm("all_gather", 0, 64)
    except AssertionError as exc:
        return str(exc)
    return ""


def test_shardsci_traffic_agrees_with_the_independent_count() -> None:
    run_on_ranks(4, _shardsci_traffic)


@pytest.mark.parametrize("how", ["c10d", "functional", "dtensor", "record_without_collective"])
def test_traffic_around_record_comm_fails(how: str) -> None:
    messages = run_on_ranks(4, _around_record_comm, how)
    assert messages == [messages[0]] * 4
    assert messages[0].startswith("assertion failed on 4 of 4 ranks"), messages[0]
    assert "shardsci recorded" in messages[0]
