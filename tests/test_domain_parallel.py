"""``shardsci.parallel.parallelize``: gradients of the single-process model, in few collectives.

Each test trains on a mesh of (dp, domain) ranks: each data-parallel replica takes its part of
the global batch, each domain rank an uneven slab of H. After ``loss.backward()`` every
parameter's ``.grad`` must be the single-process gradient on the whole batch, with the
reductions bucketed (NOTE [A reducer's gradients are final or absent]).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

import shardsci
from shardsci.models import UNet
from shardsci.parallel import domain_parallel
from shardsci.testing import (
    assert_all_ranks,
    assert_close_all_ranks,
    assert_raises_all_ranks,
    counted_comm,
    get_mesh,
    run_on_ranks,
)

BATCH, H, W = 8, 16, 8
TINY_UNET = dict(width=8, depth=2, norm_groups=4, blocks_per_level=1, padding_mode="circular")
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}


class SharedWeights(nn.Module):
    """A convolution applied twice, and a scale used on the sharded field and on its own."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 3, padding=1, padding_mode="circular", dtype=dtype)
        self.scale = nn.Parameter(torch.tensor([1.5], dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.tanh(self.conv(x))) * self.scale + self.scale.square().sum()


def _model(name: str, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return UNet(**TINY_UNET).to(dtype) if name == "unet" else SharedWeights(dtype)


def _data(dtype: torch.dtype, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(batch, 1, H, W, dtype=dtype), torch.randn(batch, 1, H, W, dtype=dtype)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, regularised: bool) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    if isinstance(loss, shardsci.ShardTensor):
        loss = loss.full_tensor()
    if regularised:  # plain uses of parameters, outside the model's forward
        loss = loss + 0.01 * sum(p.square().sum() for p in model.parameters())
    return loss


def _reference_grads(name, dtype, regularised, batches=1) -> dict[str, torch.Tensor]:
    model = _model(name, dtype)
    x, y = _data(dtype, BATCH * batches)
    for k in range(batches):
        part = slice(k * BATCH, (k + 1) * BATCH)
        _loss(model, x[part], y[part], regularised).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _sharded_batch(mesh, dtype, h_sizes, batches=1):
    """This rank's part of each of ``batches`` global batches: its dp rows, its H slab."""
    dp = mesh.get_coordinate()[0]
    replicas = mesh.size(0)
    x, y = _data(dtype, BATCH * batches)
    per_replica = BATCH // replicas
    for k in range(batches):
        rows = slice(k * BATCH + dp * per_replica, k * BATCH + (dp + 1) * per_replica)
        yield tuple(
            shardsci.distribute_tensor(t[rows], mesh["domain"], [Shard(2)], {0: h_sizes})
            for t in (x, y)
        )


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    result = {}
    for n, p in model.named_parameters():
        grad = p.grad
        result[n] = grad.full_tensor() if isinstance(grad, DTensor) else grad
    return result


def _assert_grads(model, expected, dtype) -> None:
    for name, grad in _grads(model).items():
        assert_all_ranks(grad is not None, f"{name} has no gradient")
        tolerance = TOLERANCE[dtype]
        assert_close_all_ranks(grad, expected[name], atol=tolerance, rtol=tolerance, what=name)


# ---------------------------------------------------------------------------- exactness
def _step_body(mesh_shape, h_sizes, name, dtype, dp_mode, regularised) -> None:
    mesh = get_mesh(mesh_shape, ("dp", "domain"))
    expected = _reference_grads(name, dtype, regularised)
    model = domain_parallel(
        _model(name, dtype), mesh, dp_axis="dp", domain_axes=["domain"], dp_mode=dp_mode
    )
    (x, y) = next(_sharded_batch(mesh, dtype, h_sizes))
    _loss(model, x, y, regularised).backward()
    _assert_grads(model, expected, dtype)


@pytest.mark.parametrize(
    ("name", "dtype", "dp_mode"),
    [
        ("unet", torch.float64, "ddp"),
        ("unet", torch.float32, "ddp"),
        ("unet", torch.float64, "fsdp2"),
    ],
)
def test_a_4x2_step_gives_the_single_process_gradients(name, dtype, dp_mode) -> None:
    run_on_ranks(8, _step_body, (4, 2), (11, 5), name, dtype, dp_mode, False)


@pytest.mark.parametrize("dp_mode", ["ddp", "fsdp2"])
def test_weights_used_twice_and_outside_sharded_ops(dp_mode) -> None:
    """The convolution is used twice; ``scale`` multiplies the sharded field and is squared
    on its own (a plain use, identical on every domain rank); with DDP-like reduction also a
    regulariser over all parameters after the forward, and an empty shard."""
    regularised = dp_mode == "ddp"
    run_on_ranks(4, _step_body, (2, 2), (H, 0), "shared", torch.float64, dp_mode, regularised)


def _collectives_body() -> tuple[dict[str, int], dict[str, int]]:
    mesh = get_mesh((1, 2), ("dp", "domain"))
    model = domain_parallel(
        _model("unet", torch.float32), mesh, dp_axis="dp", domain_axes=["domain"]
    )
    (x, y) = next(_sharded_batch(mesh, torch.float32, (8, 8)))
    with counted_comm() as forward:
        loss = _loss(model, x, y, False)
    with counted_comm() as backward:
        loss.backward()
    return dict(forward.calls), dict(backward.calls)


def test_a_step_issues_one_collective_per_layer_and_bucket() -> None:
    """The tiny UNet at 2 ranks: each 3x3 convolution one halo exchange forward and one
    backward (none for the first one's input, which needs no gradient; none for pooling,
    upsampling and the 1x1 head), each GroupNorm one all-gather forward and one all-reduce
    backward, the loss one all-reduce, and one all-reduce for the gradients' single bucket
    (under 1 MiB): no per-parameter reduction."""
    forward, backward = run_on_ranks(2, _collectives_body)[0]
    modules = list(UNet(**TINY_UNET).modules())
    convs = sum(isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3) for m in modules)
    norms = sum(isinstance(m, nn.GroupNorm) for m in modules)
    assert forward == {"halo": convs, "all_gather": norms, "all_reduce": 1}, forward
    assert backward == {"halo": convs - 1, "all_reduce": norms, "grad_all_reduce": 1}, backward


# ---------------------------------------------------------------------------- accumulation
def _no_sync_body(dp_mode: str) -> None:
    mesh = get_mesh((2, 2), ("dp", "domain"))
    dtype = torch.float64
    expected = _reference_grads("unet", dtype, False, batches=3)
    model = domain_parallel(
        _model("unet", dtype), mesh, dp_axis="dp", domain_axes=["domain"], dp_mode=dp_mode
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = list(_sharded_batch(mesh, dtype, (5, 11), batches=3))
    with model.no_sync():
        for x, y in batches[:2]:
            _loss(model, x, y, False).backward()
        if dp_mode == "ddp":
            assert_all_ranks(
                all(p.grad is None for p in model.parameters()),
                "a backward inside no_sync() wrote partial sums into .grad",
            )
            assert_raises_all_ranks(RuntimeError, "inside no_sync", optimizer.step)
    _loss(model, *batches[2], False).backward()
    _assert_grads(model, expected, dtype)
    optimizer.step()


@pytest.mark.parametrize("dp_mode", ["ddp", "fsdp2"])
def test_no_sync_accumulates_and_the_last_backward_reduces(dp_mode) -> None:
    run_on_ranks(4, _no_sync_body, dp_mode)


# ---------------------------------------------------------------------------- .grad readers
def _readers_body() -> None:
    mesh = get_mesh((1, 2), ("dp", "domain"))
    dtype = torch.float64
    reference = _model("unet", dtype)
    x, y = _data(dtype)
    full = torch.autograd.grad(_loss(reference, x, y, False), list(reference.parameters()))
    _loss(reference, x, y, False).backward()
    reference_norm = nn.utils.clip_grad_norm_(reference.parameters(), 0.01)

    model = domain_parallel(_model("unet", dtype), mesh, dp_axis="dp", domain_axes=["domain"])
    (xs, ys) = next(_sharded_batch(mesh, dtype, (3, 13)))
    captured = torch.autograd.grad(_loss(model, xs, ys, False), list(model.parameters()))
    for got, want in zip(captured, full):
        assert_close_all_ranks(got, want, atol=1e-12, rtol=1e-12, what="autograd.grad")
    assert_all_ranks(
        all(p.grad is None for p in model.parameters()), "autograd.grad wrote into .grad"
    )
    _loss(model, xs, ys, False).backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    assert_close_all_ranks(norm, reference_norm, atol=1e-12, rtol=1e-12, what="norm")
    for p, q in zip(model.parameters(), reference.parameters()):
        assert_close_all_ranks(p.grad, q.grad, atol=1e-12, rtol=1e-12, what="clipped")


def test_autograd_grad_and_clipping_see_whole_gradients() -> None:
    run_on_ranks(2, _readers_body)


def _twice_body() -> None:
    mesh = get_mesh((1, 2), ("dp", "domain"))
    model = domain_parallel(
        _model("unet", torch.float64), mesh, dp_axis="dp", domain_axes=["domain"]
    )
    assert_raises_all_ranks(
        ValueError, "already parallelised", domain_parallel, model, mesh, domain_axes=["domain"]
    )


def test_a_model_is_parallelised_once() -> None:
    run_on_ranks(2, _twice_body)


def _eager_sums_body(wrapped: bool) -> list[str]:
    from shardsci.tensor import _promotion

    _promotion._EAGER_SUMS_SAID[0] = False  # once per process: this pool's ranks run on
    mesh = get_mesh((1, 2), ("dp", "domain"))
    model = _model("shared", torch.float64)
    if wrapped:
        model = domain_parallel(model, mesh, dp_axis="dp", domain_axes=["domain"])
    (x, y) = next(_sharded_batch(mesh, torch.float64, (8, 8)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            _loss(model, x, y, False).backward()
            with torch.no_grad():
                model(x)
    return [str(w.message) for w in caught if "all-reduced once per use" in str(w.message)]


@pytest.mark.parametrize("wrapped", [False, True])
def test_an_unwrapped_model_is_told_once_on_rank_0_what_its_gradients_cost(wrapped) -> None:
    said = run_on_ranks(2, _eager_sums_body, wrapped)
    expected = [0, 0] if wrapped else [1, 0]
    assert [len(s) for s in said] == expected, said
    assert wrapped or "domain_parallel(model, mesh" in said[0][0]
