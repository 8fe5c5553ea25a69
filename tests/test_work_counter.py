"""What a step asks of its device (``shardsci.planning._work.WorkCounter``): FLOPs by torch's
formulas, the fused CPU attention counted as torch counts the GPU's, FFTs counted apart
(NOTE [FFT FLOPs are counted apart]) and complex matmuls counted apart (NOTE [Complex matmuls
are counted apart]), on real and meta tensors alike; the memory traffic, that of the ops
without FLOPs apart (NOTE [Kernels without FLOPs])."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from shardsci.models.fno import SpectralConv
from shardsci.planning._work import FLOP_FREE_FAMILIES, WorkCounter, contiguous_runs
from shardsci.tensor import _collectives
from shardsci.tensor._shape_probe import shape_probe


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_ffts_are_counted_apart_at_5_n_log2_n(device):
    x = torch.randn(2, 3, 16, 32, device=device)
    z = torch.randn(4, 8, dtype=torch.complex64, device=device)
    with WorkCounter() as work:
        spectrum = torch.fft.rfft2(x)  # real: half of 5 n log2 n per batch of n = 16 x 32
        torch.fft.irfft2(spectrum, s=(16, 32))  # the same, counted on the real output
        torch.fft.fft(z)  # complex, along the last dim: n = 8
    real = 2.5 * x.numel() * math.log2(16 * 32)
    assert work.fft_flops == int(real) + int(real) + int(5 * z.numel() * math.log2(8))
    assert work.flops == 0
    assert work.ops == 3


def test_the_fused_cpu_attention_counts_as_torch_counts_the_gpus():
    q, k, v = (torch.randn(1, 2, 64, 8, requires_grad=True) for _ in range(3))
    with WorkCounter() as work:
        out = F.scaled_dot_product_attention(q, k, v)
        out.sum().backward()
    shape = q.shape
    expected = sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(
        shape, shape, shape, shape
    )
    assert work.flops == expected
    assert work.fft_flops == 0


def test_a_matmul_counts_by_torchs_formula():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    with WorkCounter() as work:
        a @ b
    assert (work.flops, work.fft_flops, work.ops) == (2 * 8 * 16 * 4, 0, 1)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_spectral_contraction_is_counted_apart_from_the_matmuls(device):
    """NOTE [Complex matmuls are counted apart]: an FNO spectral layer's complex einsum,
    forward and backward, counts in ``complex_matmul_flops`` at torch's ``2 m n k``, not in
    ``flops``; a real matmul beside it stays in ``flops``."""
    batch, width, modes = 2, 4, (3, 5)
    layer = SpectralConv(width, width, modes).to(device)
    x = torch.randn(batch, width, 16, 16, device=device)
    with WorkCounter() as work:
        layer(x).sum().backward()
        torch.randn(8, 16, device=device) @ torch.randn(16, 4, device=device)
    retained = 2 * modes[0] * modes[1]
    forward = 2 * batch * width * width * retained
    # backward: one more product, the weight's gradient (the input needs none)
    assert work.complex_matmul_flops == 2 * forward
    assert work.flops == 2 * 8 * 16 * 4
    assert work.fft_flops > 0


def test_a_shape_probe_is_an_op_but_no_work():
    """NOTE [Shape probes hold no memory]: a probe runs torch's meta function on a stand-in
    of the whole field; it launches no kernel, so it counts no FLOPs."""
    x = torch.randn(2, 3, 16, 32, device="meta")
    with WorkCounter() as work, shape_probe():
        torch.fft.rfft2(x)
        x @ x.transpose(-1, -2)
    assert (work.flops, work.fft_flops) == (0, 0)
    assert work.ops >= 3


def test_the_ops_a_communication_module_dispatches_are_counted_apart():
    """NOTE [One price per op]: packing a peer's piece is a plain op on a local piece."""
    piece = torch.randn(4, 3)
    with WorkCounter() as work:
        _collectives._as_bytes(piece)  # a view of the piece as bytes, as a send buffer
        piece * 2
    assert work.communication_ops >= 1
    assert work.ops - work.communication_ops == 1


def _runs_from_addresses(tensor: torch.Tensor) -> int:
    """Runs of consecutive elements, counted from every element's storage offset in order:
    a new run wherever the next element is not the one after it in memory."""
    offsets = torch.as_strided(
        torch.arange(tensor.storage_offset() + tensor.numel() * 64),
        tensor.shape,
        tensor.stride(),
        tensor.storage_offset(),
    ).flatten()
    return 1 + int((offsets[1:] != offsets[:-1] + 1).sum())


@pytest.mark.parametrize(
    "piece",
    [
        lambda x: x[..., :3],  # a W split's piece: B C H runs
        lambda x: x[:, :, :2],  # an H split's: B C runs
        lambda x: x[:, 1:2, :, :5],
        lambda x: x[:, :, 1:3, 2:],
        lambda x: x[:1, :, :1],
        lambda x: x[1:],
    ],
)
def test_the_runs_of_a_strided_tensor(piece) -> None:
    """NOTE [Strided copies]: ``contiguous_runs`` of narrowed pieces (the innermost dim at
    stride 1) against the runs read off every element's address."""
    tensor = piece(torch.randn(2, 3, 4, 5))
    assert contiguous_runs(tensor) == _runs_from_addresses(tensor)


def test_copies_count_the_runs_of_their_strided_tensors() -> None:
    """Packing a W split's two pieces (narrowed along the last dim) of a ``(B, C, H, W)``
    field into one buffer reads ``2 B C H`` runs; the same bytes narrowed along H ``2 B C``;
    an op that is not a copy counts none."""
    x = torch.randn(2, 3, 4, 8)
    with WorkCounter() as along_w:
        torch.cat([x[..., :4].flatten(), x[..., 4:].flatten()])
        x[..., :4] * 2
    with WorkCounter() as along_h:
        torch.cat([x[:, :, :2].flatten(), x[:, :, 2:].flatten()])
    assert (along_w.strided_runs, along_h.strided_runs) == (2 * 2 * 3 * 4, 2 * 2 * 3)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_traffic_of_ops_without_flops_is_counted_apart(device):
    """NOTE [Kernels without FLOPs]: of a convolution and an FFT (FLOPs) and a GELU between
    them (none), the GELU's bytes read and written are the traffic without FLOPs; all three
    are the traffic; a view moves nothing."""
    conv = torch.nn.Conv2d(2, 3, 1, device=device)
    x = torch.randn(1, 2, 8, 8, device=device)
    with torch.no_grad(), WorkCounter() as work:
        spectrum = torch.fft.rfft2(F.gelu(conv(x)).view(1, 3, 64).view(1, 3, 8, 8))
    nbytes = 4  # float32
    gelu = 2 * 3 * 8 * 8 * nbytes
    convolution = (x.numel() + conv.weight.numel() + conv.bias.numel() + 3 * 8 * 8) * nbytes
    fft = 3 * 8 * 8 * nbytes + spectrum.numel() * spectrum.element_size()
    assert work.flop_free_bytes == gelu
    assert work.memory_bytes == gelu + convolution + fft


def test_an_unsafe_view_moves_no_bytes():
    """NOTE [Kernels without FLOPs]: ``aten._unsafe_view`` (a matmul's result reshaped, not
    marked a view by torch) aliases its input: no traffic; the matmul's is counted."""
    a, b = torch.randn(2, 3, 4), torch.randn(4, 5)
    with torch.no_grad(), WorkCounter() as work:
        out = torch.ops.aten._unsafe_view(torch.mm(a.view(6, 4), b), (2, 3, 5))
    assert out.shape == (2, 3, 5)
    assert work.flop_free_bytes == 0
    assert work.memory_bytes == (a.numel() + b.numel() + out.numel()) * 4


def test_a_collectives_buffers_are_not_memory_traffic():
    """NOTE [Kernels without FLOPs]: the bytes a collective moves are its communication's
    (priced by the collectives' costs), not the kernels' memory traffic."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x, y = torch.ones(256), torch.empty(256)
        with WorkCounter() as work:
            dist.all_reduce(x)
            dist.all_to_all_single(y, x)
    finally:
        dist.destroy_process_group()
    assert work.ops >= 2
    assert (work.memory_bytes, work.flop_free_bytes) == (0, 0)


def _paths_body() -> None:
    from shardsci import Shard, ShardTensor
    from shardsci.testing import get_mesh

    mesh = get_mesh((1,))
    x = ShardTensor.from_local(torch.randn(1, 2, 8, 8), mesh, [Shard(2)], {0: (8,)})
    weight = torch.randn(2, 2, 3, 3)
    with torch.no_grad(), WorkCounter() as work:
        y = x + x  # fast
        y = y.mean(dim=(-2, -1))  # propagation
        z = torch.constant_pad_nd(x, (1, 1))  # an aten handler
        z = F.conv2d(z, weight)  # a function handler, its own ops inside it
        z * 2.0  # fast
        torch.randn(3) * 2  # plain: no path
    assert dict(work.path_ops) == {"fast": 2, "propagation": 1, "handler": 1}, work.path_ops
    assert work.function_calls == 1
    assert isinstance(y, ShardTensor) and isinstance(z, ShardTensor)


def test_ops_on_shard_tensors_are_counted_by_dispatch_path_and_function_handler_calls():
    """NOTE [Host time by dispatch path] (``benchmarks/calibrate_dispatch.py``): a
    ShardTensor op's host time depends on its path, so ``WorkCounter`` counts them apart."""
    from shardsci.testing import run_on_ranks

    run_on_ranks(1, _paths_body)


_WORK = ("flops", "fft_flops", "complex_matmul_flops", "memory_bytes", "flop_free_bytes")


def _work_of(counter: WorkCounter) -> dict[str, int]:
    return {name: getattr(counter, name) for name in (*_WORK, "ops")}


def _fast_and_propagation_body() -> dict[str, dict[str, int]]:
    from shardsci import Shard, ShardTensor
    from shardsci.testing import get_mesh

    x = torch.randn(1, 4, 64, 64)
    shard = ShardTensor.from_local(x.clone(), get_mesh((1,)), [Shard(2)], {0: (64,)})
    counted = {}
    for name, t in (("plain", x), ("shard", shard)):
        with torch.no_grad(), WorkCounter() as work:
            F.gelu(t + t).mean(dim=(-2, -1))  # fast, fast, propagation
        counted[name] = _work_of(work)
    return counted


def test_the_local_kernels_of_an_op_on_shard_tensors_are_work():
    """NOTE [Work on local shards]: on one rank, the fast and propagation paths' local kernels
    count what the same ops count on the plain tensor (they counted nothing: 0 bytes for
    ``x + x``, GELU and ``mean``), and the op count is the step's top-level ops either way."""
    from shardsci.testing import run_on_ranks

    (counted,) = run_on_ranks(1, _fast_and_propagation_body)
    assert counted["shard"] == counted["plain"], counted
    assert counted["plain"]["memory_bytes"] > 0


_ZOO = ("unet", "fno", "vit", "transolver", "meshgraphnet")


def _zoo_step_body(name: str, mesh_shape: tuple[int, ...]) -> dict[str, int]:
    from benchmarks.cost_model import sharded_step
    from shardsci.testing import count_traffic

    ranks = math.prod(mesh_shape)
    graph = name == "meshgraphnet"
    _, step = sharded_step(name, mesh_shape, (200 // ranks,) if graph else (32 // ranks, 32))
    step()
    # entered last, as the dry run enters it (``measure_step``): above the traffic counter
    with count_traffic() as traffic, WorkCounter() as work:
        step()
    return _work_of(work) | {"received": traffic.received}


def _plain_work(name: str) -> dict[str, float]:
    from benchmarks.cost_model import work

    return dict(zip(_WORK, work(name, 200 if name == "meshgraphnet" else 32)))


@pytest.mark.parametrize("name", _ZOO)
def test_a_zoo_step_on_one_rank_counts_the_plain_steps_work(name):
    """NOTE [Work on local shards]: a training step of each zoo model on a 1-rank ShardTensor
    counts the plain step's FLOPs (matmul, FFT and complex matmul) exactly, its memory
    traffic within 5 % and that of its ops without FLOPs within 15 %: what sharding itself
    adds or saves (measured 2026-11-29, all traffic / without FLOPs: UNet +0.25 / +0.3 %,
    FNO 0 / 0, ViT +4.6 / +14.6 % and MeshGraphNet +1.1 / +1.8 % for gradients accumulated
    into zeros and a scatter's copies, Transolver -4.4 / -7.1 % for a reshape's copy a held
    layout avoids). Before NOTE [Work on local shards], the fast and propagation paths'
    kernels counted nothing."""
    from shardsci.testing import run_on_ranks

    (shard,) = run_on_ranks(1, _zoo_step_body, name, (1,))
    plain = _plain_work(name)
    for figure in ("flops", "fft_flops", "complex_matmul_flops"):
        assert shard[figure] == plain[figure], (figure, shard, plain)
    assert shard["memory_bytes"] == pytest.approx(plain["memory_bytes"], rel=0.05)
    assert shard["flop_free_bytes"] == pytest.approx(plain["flop_free_bytes"], rel=0.15)


def test_a_unet_step_on_two_ranks_counts_the_plain_steps_work_and_its_halos():
    """Two ranks' FLOPs sum to the plain step's exactly; their traffic exceeds its by less
    than twice the bytes the halos bring (packed, unpacked and sliced: measured 1.46x)."""
    from shardsci.testing import run_on_ranks

    ranks = run_on_ranks(2, _zoo_step_body, "unet", (2,))
    plain = _plain_work("unet")
    assert sum(r["flops"] for r in ranks) == plain["flops"]
    extra = sum(r["memory_bytes"] for r in ranks) - plain["memory_bytes"]
    halos = sum(r["received"] for r in ranks)
    assert 0 < extra < 2 * halos, (extra, halos)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_traffic_of_ops_without_flops_is_counted_by_family(device):
    """NOTE [Kernels without FLOPs by family]: a contiguous add, an add broadcasting a row, an
    add of a transposed operand, a sum and a clone each count their bytes in their own family,
    and the families add up to the flop-free traffic."""
    x, row = torch.randn(8, 16, device=device), torch.randn(16, device=device)
    square = torch.randn(16, 16, device=device)
    with torch.no_grad(), WorkCounter() as work:
        x + x
        x + row
        square.t() + square
        x.sum(dim=0)
        x.clone()
    nbytes = 4  # float32
    assert dict(work.flop_free_bytes_by_family) == {
        "pointwise_contiguous": 3 * 128 * nbytes,
        "pointwise_broadcast": (128 + 16 + 128) * nbytes,
        "pointwise_strided": 3 * 256 * nbytes,
        "reduction": (128 + 16) * nbytes,
        "copy": 2 * 128 * nbytes,
    }
    assert sum(work.flop_free_bytes_by_family.values()) == work.flop_free_bytes
    assert set(work.flop_free_bytes_by_family) == set(FLOP_FREE_FAMILIES)
