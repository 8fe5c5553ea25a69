"""Ops along a sharded dim move only what they must: byte counts per op, on uneven shards.

Correctness is checked in ``test_ops_core``; here each handled op must not fall back to
gathering the whole tensor. Bounds are per rank, bytes received, float64.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import shardsci
from shardsci.testing import assert_all_ranks, counted_comm, get_mesh, run_on_ranks

SIZES = (5, 0, 3, 4)  # rows per rank of a (12, 6, 4) tensor sharded on dim 0 (4 ranks)
SHAPE = (12, 6, 4)
ITEM = 8


def _ring(numel: int, ranks: int = 4) -> int:
    return 2 * (ranks - 1) * numel * ITEM // ranks


# name -> (fn on the ShardTensor, bound on the bytes this rank receives)
OPS = {
    "slice": (lambda x: x[2:11:3], lambda local: 0),
    "narrow_other_dim": (lambda x: x[:, 1:4], lambda local: 0),
    "sum_lazy": (lambda x: x.sum(0), lambda local: 0),
    "mean_lazy": (lambda x: x.mean(0), lambda local: 0),
    "flatten_trailing": (lambda x: x.flatten(0), lambda local: 0),
    "view_split_rows": (lambda x: x.reshape(12, 3, 2, 4), lambda local: 0),
    "linear": (lambda x: F.linear(x, torch.ones(5, 4, dtype=torch.float64)), lambda local: 0),
    "matmul": (lambda x: x @ torch.ones(4, 2, dtype=torch.float64), lambda local: 0),
    "softmax": (lambda x: torch.softmax(x, 0), lambda local: 2 * _ring(6 * 4)),
    "log_softmax": (lambda x: F.log_softmax(x, 0), lambda local: 2 * _ring(6 * 4)),
    "var": (lambda x: x.var(0), lambda local: _ring(6 * 4)),
    "cumsum": (lambda x: x.cumsum(0), lambda local: 3 * 6 * 4 * ITEM),
    "argmax": (lambda x: x.argmax(0), lambda local: 3 * 3 * 6 * 4 * ITEM),
    "flip": (lambda x: x.flip(0), lambda local: local),
    "roll": (lambda x: x.roll(5, 0), lambda local: local),
    "select": (lambda x: x[7], lambda local: 6 * 4 * ITEM),
    "amax": (lambda x: x.amax(0), lambda local: 0),
}


def _body(name: str) -> None:
    mesh = get_mesh((4,))
    fn, bound = OPS[name]
    x = shardsci.distribute_tensor(
        torch.randn(SHAPE, dtype=torch.float64), mesh, [Shard(0)], {0: SIZES}
    )
    local_bytes = x._local.numel() * ITEM
    with counted_comm(name) as stats:
        fn(x)
    received = stats.total_received
    assert_all_ranks(
        received <= bound(local_bytes),
        f"{name} received {received} bytes ({dict(stats.received)}), bound {bound(local_bytes)}",
    )


@pytest.mark.parametrize("name", list(OPS))
def test_op_moves_at_most_its_bound(name: str) -> None:
    run_on_ranks(4, _body, name)


def _realign_body() -> None:
    mesh = get_mesh((4,))
    a = shardsci.distribute_tensor(
        torch.randn(SHAPE, dtype=torch.float64), mesh, [Shard(0)], {0: SIZES}
    )
    b = shardsci.distribute_tensor(
        torch.randn(SHAPE, dtype=torch.float64), mesh, [Shard(0)], {0: (3, 3, 3, 3)}
    )
    row = math.prod(SHAPE[1:]) * ITEM
    mine = torch.distributed.get_rank()
    start_a, start_b = sum(SIZES[:mine]), 3 * mine
    overlap = max(0, min(start_a + SIZES[mine], start_b + 3) - max(start_a, start_b))
    with counted_comm("realign") as stats:
        c = a * b
    lacking = (SIZES[mine] - overlap) * row  # the smaller operand moves to the larger's layout
    assert_all_ranks(
        tuple(c._local.shape) == (SIZES[mine], *SHAPE[1:]),
        f"result shard {tuple(c._local.shape)}",
    )
    assert_all_ranks(
        stats.total_received == lacking and set(stats.received) == {"all_to_all"},
        f"realignment received {dict(stats.received)}, lower bound {lacking}",
    )


def test_operands_with_different_boundaries_realign_at_the_lower_bound() -> None:
    run_on_ranks(4, _realign_body)
