"""Work each op used to repeat on every call, now skipped or cached (host cost, issue 21):
each test breaks if the work comes back.

- a view of a tensor that is no copy, on every rank alike (fast and propagation paths), marks
  nothing and does not ask whether torch.compile traces (``_copies.mark_view``);
- attention whose query, key and value share their batch dims does not call
  ``torch.broadcast_shapes`` (tens of us a call);
- the gather guard's largest-shard size of a layout is computed once (``check_result`` asks
  on every op with a pending result).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from shardsci import ShardTensor, attention_exchange
from shardsci.tensor import _copies, _gather_guard
from shardsci.testing import get_mesh, run_on_ranks


def _refuse(*args, **kwargs):
    raise AssertionError("called")


def _view_body() -> tuple[bool, bool]:
    mesh = get_mesh((torch.distributed.get_world_size(),))
    x = ShardTensor.from_local(torch.randn(2, 3, 4), mesh, [Shard(0)])
    asked = []
    tracing, _copies._tracing = _copies._tracing, lambda: asked.append(1) or False
    try:
        y = x.transpose(1, 2)  # a view on every rank (the default path)
        z = y.unsqueeze(0)
    finally:
        _copies._tracing = tracing
    return not asked, y._copy_of is None and z._copy_of is None


def test_a_view_of_an_unmarked_tensor_does_not_ask_whether_compile_traces() -> None:
    assert run_on_ranks(2, _view_body) == [(True, True)] * 2


def _attention_body() -> bool:
    mesh = get_mesh((torch.distributed.get_world_size(),))
    q, k, v = (
        ShardTensor.from_local(torch.randn(1, 2, 4, 8, dtype=torch.float64), mesh, [Shard(2)])
        for _ in range(3)
    )
    broadcast, torch.broadcast_shapes = torch.broadcast_shapes, _refuse
    try:
        with attention_exchange("ring"):  # "auto" would gather these few keys and values
            out = F.scaled_dot_product_attention(q, k, v)
    finally:
        torch.broadcast_shapes = broadcast
    want = F.scaled_dot_product_attention(*(t.full_tensor() for t in (q, k, v)))
    return torch.allclose(out.full_tensor(), want, rtol=1e-12, atol=1e-12)


def test_attention_of_equal_batch_dims_does_not_broadcast_shapes() -> None:
    assert all(run_on_ranks(2, _attention_body))


def _largest_body() -> tuple[int, int]:
    mesh = get_mesh((torch.distributed.get_world_size(),))
    x = ShardTensor.from_local(torch.randn(5, 3), mesh, [Shard(0)])
    _gather_guard._largest_elements.cache_clear()
    for _ in range(3):
        x.sum(0)  # a pending result: check_result compares largest shards
    info = _gather_guard._largest_elements.cache_info()
    return info.misses, info.hits


def test_the_gather_guards_shard_sizes_are_computed_once_per_layout() -> None:
    (misses, hits), _ = run_on_ranks(2, _largest_body)
    assert 0 < misses <= 3 and hits >= 2 * misses, (misses, hits)
