"""The host cost of one redistribution, or of one exchange among neighbours, does not grow
with the number of peers.

NOTE [One pack and one unpack per collective] (``shardsci/tensor/_box_packing.py``): each box
exchange packs what it sends in one go and unpacks what it receives in one go. Counted here by
a ``TorchDispatchMode`` around ``redistribute_local`` on this rank's shard (every aten op the
redistribution dispatches: views, copies, index ops, the collective), on 2, 4 and 8 ranks of a
1-D mesh: the busiest rank's count may not grow from 2 ranks to 8. Values and layouts of the
same transitions are checked against one process in ``tests/test_redistribute.py``; the
values are checked here too, so a cheap wrong answer cannot pass. ``exchange`` itself (graph
halos, scans) packs a piece per peer that sends or receives something, and nothing for the
others: an exchange with one neighbour costs the same on 4 ranks as on 8.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from shardsci.tensor._caches import clear_caches
from shardsci.tensor._collectives import axis_group, exchange
from shardsci.tensor._redistribute import redistribute_local
from shardsci.testing import Layout, assert_all_ranks, get_mesh, run_on_ranks
from tests.boxes import box, narrow

RANKS = (2, 4, 8)


class _Ops(TorchDispatchMode):
    """Counts the aten ops dispatched, the integer tensors made from Python values (indices)
    and the largest of them."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.indices = 0
        self.largest_index = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.ops[str(func)] += 1
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.lift_fresh.default and not out.is_floating_point():
            self.indices += 1
            self.largest_index = max(self.largest_index, out.numel())
        return out


# name -> (global shape, dtype, source placements, target placements). Shard sizes follow
# torch.chunk: 24 and 16 split evenly over 2, 4 and 8 ranks; 25 and 13 do not (13 over 8
# leaves ranks empty).
TRANSITIONS = {
    "transpose-even": ((2, 3, 24, 16), torch.float64, Shard(2), Shard(3)),
    "transpose-uneven-source": ((2, 3, 25, 16), torch.float64, Shard(2), Shard(3)),
    "transpose-uneven-target": ((2, 3, 24, 13), torch.float64, Shard(2), Shard(3)),
    "transpose-complex": ((2, 3, 24, 16), torch.complex128, Shard(3), Shard(2)),
    "gather-even": ((2, 3, 24, 5), torch.float64, Shard(2), Replicate()),
    "gather-uneven": ((2, 3, 13, 5), torch.float64, Shard(2), Replicate()),
    "gather-leading-dim": ((13, 3, 5), torch.complex128, Shard(0), Replicate()),
    "gather-1d": ((13,), torch.float64, Shard(0), Replicate()),
    "reduce-scatter": ((2, 3, 13, 5), torch.float64, Partial("sum"), Shard(3)),
}
# The busiest rank's aten ops on 2 / 4 / 8 ranks, pinned: an op more per redistribution fails.
# (One pack, the collective's byte views, one unpack and the own piece's copy; the byte views
# reshape nothing that already has its shape.)
PINNED = {
    "transpose-even": (18, 20, 20),
    "transpose-uneven-source": (18, 20, 20),
    "transpose-uneven-target": (18, 20, 20),
    "transpose-complex": (22, 24, 24),
    "gather-even": (15, 15, 15),
    "gather-uneven": (16, 17, 17),
    "gather-leading-dim": (19, 21, 21),
    "gather-1d": (14, 17, 17),
    "reduce-scatter": (16, 16, 16),
}


def _ops_body(shape, dtype, before, after) -> int:
    world = torch.distributed.get_world_size()
    mesh = get_mesh((world,))
    me = tuple(mesh.get_coordinate())
    value = torch.randn(shape, dtype=dtype)
    torch.distributed.broadcast(value, 0)
    src, dst = Layout((before,)), Layout((after,))
    partial = isinstance(before, Partial)
    # A Partial source: rank 0 holds the value, the others zeros.
    local = narrow(value, box(src, shape, (world,), me)).clone()
    if partial and me[0] != 0:
        local.zero_()
    src_spec, dst_spec = src.spec(mesh, value), dst.spec(mesh, value)
    clear_caches()  # the first call builds its plan and indices anew
    with _Ops() as first:
        redistribute_local(local, src_spec, dst_spec)
    with _Ops() as counter:  # plans cached: count the steady state
        out = redistribute_local(local, src_spec, dst_spec)
    expected = narrow(value, box(dst, shape, (world,), me))
    assert_all_ranks(torch.equal(out, expected), f"{before} -> {after}: wrong shard")
    # An index has an entry per row of a shard at most, never more entries than it has elements.
    held = max(local.numel(), out.numel())
    assert_all_ranks(
        counter.largest_index <= held,
        f"{before} -> {after}: an index of {counter.largest_index} entries for shards of {held}",
    )
    # NOTE [An exchange's index is built once]: on a GPU each new index is a host-to-device
    # copy.
    assert_all_ranks(
        counter.indices == 0,
        f"{before} -> {after}: a repeated redistribution built {counter.indices} indices "
        f"(its first call {first.indices})",
    )
    return sum(counter.ops.values()), first.indices


@pytest.mark.parametrize("name", list(TRANSITIONS))
def test_ops_of_a_redistribution_do_not_grow_with_the_peers(name: str) -> None:
    per_rank = {n: run_on_ranks(n, _ops_body, *TRANSITIONS[name]) for n in RANKS}
    counts = {n: max(ops for ops, _ in results) for n, results in per_rank.items()}
    if name == "transpose-even":  # the index check above can see an index: the first call has
        assert max(indices for _, indices in per_rank[4]) > 0
    # On 2 ranks a rank's own piece is never between the pieces it sends or receives, so one
    # narrow packs (or unpacks) them where 4 ranks and more need an index and an index op;
    # beyond that nothing may grow (the per-peer path added about 8 ops per peer).
    assert counts[4] <= counts[2] + 4 and counts[8] <= counts[4], (
        f"{name}: aten ops per rank by ranks {counts}"
    )
    pinned = dict(zip(RANKS, PINNED[name]))
    assert all(counts[n] <= pinned[n] for n in RANKS), (
        f"{name}: aten ops per rank by ranks {counts}, pinned at {pinned}"
    )


def _neighbour_body() -> int:
    """Each rank sends a (3, 2) piece to the next rank of a ring and nothing to the others."""
    world = torch.distributed.get_world_size()
    group = axis_group(get_mesh((world,)), (0,))
    me = group.index
    nxt, prev = (me + 1) % world, (me - 1) % world

    def shape_of(src: int, dst: int) -> tuple[int, int]:
        return (3, 2) if dst == (src + 1) % world else (0, 2)

    mine = torch.full((3, 2), float(me))
    pieces = [mine if k == nxt else None for k in range(world)]
    kwargs = {"dtype": mine.dtype, "device": mine.device, "kind": "p2p"}
    exchange(group, pieces, shape_of, **kwargs)
    with _Ops() as counter:
        received = exchange(group, pieces, shape_of, **kwargs)
    wanted = torch.full((3, 2), float(prev))
    right = torch.equal(received[prev], wanted) and all(
        received[k].numel() == 0 for k in range(world) if k not in (me, prev)
    )
    assert_all_ranks(right, "the ring exchange received the wrong pieces")
    return sum(counter.ops.values())


def test_ops_of_an_exchange_grow_with_the_neighbours_not_the_ranks() -> None:
    counts = {n: max(run_on_ranks(n, _neighbour_body)) for n in (4, 8)}
    assert counts[8] <= counts[4], f"aten ops per rank by ranks {counts}"
