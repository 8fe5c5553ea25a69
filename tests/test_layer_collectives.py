"""The collectives of a training step's layers: a layer's halo is one batched exchange (a
circular convolution, ``F.pad`` then the convolution, exchanges once forward and once
backward, at the face lower bound), the padded tensor's halo is used only while it is valid
(NOTE [A padded tensor carries the halo its convolution reads]), and equal shards are gathered
with the native all-gather."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

import shardsci
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    assert_close_all_ranks,
    check_against_reference,
    counted_comm,
    get_mesh,
    run_on_ranks,
)

F64 = torch.float64
SIZES = (5, 3, 4, 6)  # H per rank, every shard at least the halo wide
B, C, W = 2, 3, 5


def _conv(mode: str) -> nn.Conv2d:
    torch.manual_seed(0)
    return nn.Conv2d(C, C, 3, padding=1, padding_mode=mode, dtype=F64)


def _one_exchange_body(mode: str) -> None:
    mesh = get_mesh((4,))
    conv = _conv(mode)
    whole = torch.randn(B, C, sum(SIZES), W, dtype=F64)
    x = shardsci.distribute_tensor(whole, mesh, [Shard(2)], {0: SIZES}).requires_grad_()
    with counted_comm() as forward:
        y = conv(x)
    with counted_comm() as backward:
        y.to_local().sum().backward()
    rank = mesh.get_local_rank()
    neighbours = 2 if mode == "circular" else (rank > 0) + (rank < len(SIZES) - 1)
    faces = neighbours * B * C * W * 8  # a face: one row of H
    for what, stats in (("forward", forward), ("backward", backward)):
        assert_all_ranks(
            stats.calls["halo"] == 1 and stats.received["halo"] == faces,
            f"{what}: {dict(stats.calls)} calls, {dict(stats.received)} bytes received; "
            f"expected one exchange of {neighbours} faces ({faces} bytes)",
        )


@pytest.mark.parametrize("mode", ["circular", "reflect", "replicate", "zeros"])
def test_a_padded_convolution_exchanges_once_each_way(mode: str) -> None:
    """``zeros`` convolves with its own padding, the other modes pad first; either way one
    exchange of the neighbours' faces (the edge ranks of a non-periodic domain have one
    neighbour: reflect and replicate fill their padding from their own cells)."""
    run_on_ranks(4, _one_exchange_body, mode)


def _changed_in_place_body(change: str) -> None:
    """A padded tensor changed in place, or convolved further than its halo, is exchanged
    again: the result stays the single-process one."""
    conv = _conv("zeros")
    x = torch.randn(B, C, sum(SIZES), W, dtype=F64)

    def fn(module: nn.Module, a: torch.Tensor) -> torch.Tensor:
        padded = F.pad(a, (1, 1, 1, 1), mode="circular")
        if change == "in_place":
            padded = padded.clone()
            padded.mul_(2.0)
            return F.conv2d(padded, module.weight, module.bias)
        return module(padded)  # padding=1 reads beyond the pad's halo

    # The pad's cells belong to the edge shards; a same-size convolution keeps that layout,
    # and the unpadded one returns to the input's.
    padded_sizes = (SIZES[0] + 1, *SIZES[1:-1], SIZES[-1] + 1)
    out_sizes = SIZES if change == "in_place" else padded_sizes
    check_against_reference(
        fn,
        [x],
        [Layout((Shard(2),), {2: SIZES})],
        get_mesh((4,)),
        module=conv,
        what=change,
        out_layouts=[Layout((Shard(2),), {2: out_sizes})],
    )


@pytest.mark.parametrize("change", ["in_place", "reads_further"])
def test_the_halo_is_used_only_while_valid(change: str) -> None:
    run_on_ranks(4, _changed_in_place_body, change)


def _mutated_view_body() -> None:
    """The halo's buffer shares its version counter with the padded shard (a view of it):
    an in-place change of the padded tensor itself must not be hidden by the halo."""
    mesh = get_mesh((4,))
    torch.manual_seed(0)
    weight = torch.randn(C, C, 3, 3, dtype=F64)
    whole = torch.randn(B, C, sum(SIZES), W, dtype=F64)
    x = shardsci.distribute_tensor(whole, mesh, [Shard(2)], {0: SIZES})
    padded = F.pad(x, (1, 1, 1, 1), mode="circular")
    padded.mul_(3.0)
    got = F.conv2d(padded, weight).full_tensor()
    expected = F.conv2d(3.0 * F.pad(whole, (1, 1, 1, 1), mode="circular"), weight)
    assert_close_all_ranks(got, expected, atol=1e-12, rtol=1e-12, what="in-place pad")


def test_an_in_place_change_of_the_padded_tensor_is_seen() -> None:
    run_on_ranks(4, _mutated_view_body)


def _native_gather_body(sizes: tuple[int, ...]) -> int:
    """Gathering a tensor sharded in equal pieces uses the native all-gather (NCCL's tuned
    algorithms on GPUs); unequal pieces the exact exchange. Returns the native calls."""
    calls = [0]
    original = dist.all_gather_single

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    mesh = get_mesh((4,))
    whole = torch.randn(sum(sizes), 3, dtype=F64)
    x = shardsci.distribute_tensor(whole, mesh, [Shard(0)], {0: sizes})
    dist.all_gather_single = counting
    try:
        got = x.full_tensor()
    finally:
        dist.all_gather_single = original
    assert_close_all_ranks(got, whole, atol=0, rtol=0, what="gathered")
    return calls[0]


@pytest.mark.parametrize(("sizes", "native"), [((3, 3, 3, 3), 1), ((5, 3, 4, 0), 0)])
def test_equal_shards_gather_natively(sizes, native) -> None:
    assert run_on_ranks(4, _native_gather_body, sizes) == [native] * 4
