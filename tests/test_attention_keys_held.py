"""Attention whose keys this rank all holds is torch's own SDPA of the local blocks (NOTE
[Attention over keys all held here is torch's] in ``shardsci/tensor/_ops/_ring_attention.py``):
against one process in float64 (values, gradients, the output's layout), plain and causal, a
batch split over 2 ranks (uneven and empty) and a one-rank mesh; the node torch records is its
SDPA's, and a split sequence still takes the ring's Function. On CUDA that is what keeps the
L x S scores out of memory (an H200 measured 32x plain torch's peak without it); the CPU checks
the route.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from shardsci import attention_exchange
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    check_against_reference,
    get_mesh,
    run_on_ranks,
)
from tests.test_conv_ops import _graph_nodes

# (B, H, L, E): the batch split (every key held here) or the sequence split (the ring).
BATCH = {1: Layout((Shard(0),)), 2: Layout((Shard(0),), {0: (3, 0)})}
SEQUENCE = Layout((Shard(2),), {2: (5, 3)})


def _attention(causal: bool):
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _keys_held_body(world: int, causal: bool) -> None:
    mesh = get_mesh((world,))
    torch.manual_seed(0)
    qkv = [torch.randn(3, 2, 8, 4, dtype=torch.float64) for _ in range(3)]
    (out,) = check_against_reference(_attention(causal), qkv, [BATCH[world]] * 3, mesh)
    nodes = _graph_nodes(out.grad_fn)
    held = [n for n in nodes if "ScaledDotProduct" in n]
    assert_all_ranks(
        out.to_local().numel() == 0 or (held and "_AttentionBackward" not in nodes),
        f"keys all held here: torch's SDPA node expected, found {nodes}",
    )


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
@pytest.mark.parametrize("world", [1, 2], ids=["1r", "2r-batch-3/0"])
def test_attention_over_keys_all_held_here_is_torchs(world: int, causal: bool) -> None:
    run_on_ranks(world, _keys_held_body, world, causal)


def _split_sequence_body() -> None:
    mesh = get_mesh((2,))
    torch.manual_seed(0)
    qkv = [torch.randn(3, 2, 8, 4, dtype=torch.float64) for _ in range(3)]
    with attention_exchange("ring"):
        (out,) = check_against_reference(_attention(False), qkv, [SEQUENCE] * 3, mesh)
    nodes = _graph_nodes(out.grad_fn)
    assert_all_ranks("_AttentionBackward" in nodes, f"the ring's Function expected: {nodes}")


def test_a_split_sequence_still_takes_the_ring() -> None:
    run_on_ranks(2, _split_sequence_body)
