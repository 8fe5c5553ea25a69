"""The FNO of the model zoo: the spectral convolution against ``rfftn`` with the modes cut,
shapes, validation, symmetry and training on one device; and, domain-parallel, the bytes its
spectral convolution moves (only kept modes are transposed) and the layout it returns.

Sharded == single-device for the whole model on every zoo layout is in
``tests/test_zoo_sharded.py``.
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Any

import pytest
import torch
from torch.distributed.tensor import Shard

from shardsci.models import FNO, FNOConfig
from shardsci.models.fno import SpectralConv
from shardsci.tensor._api import from_local_spec
from shardsci.tensor._spec import chunk_sizes
from shardsci.testing import Layout, assert_all_ranks, counted_comm, get_mesh, run_on_ranks
from tests.zoo import assert_learns_a_fixed_pair

TINY: dict[str, Any] = {"width": 6, "modes": (3, 3), "layers": 2, "projection_channels": 8}
"""Overrides for an FNO small enough to run many times in a fast test."""


def _tiny_fno(seed: int = 0, **overrides: Any) -> FNO:
    torch.manual_seed(seed)
    return FNO(**{**TINY, **overrides}).double()


def _reference_spectral_conv(layer: SpectralConv, x: torch.Tensor) -> torch.Tensor:
    """``rfftn``, keep the corner blocks of low modes, mix channels, zero the rest, ``irfftn``."""
    k = len(layer.modes)
    dims = tuple(range(-k, 0))
    spectrum = torch.fft.rfftn(x, dim=dims, norm="ortho")
    weight = torch.view_as_complex(layer.weight)
    out_shape = (x.shape[0], weight.shape[1], *spectrum.shape[2:])
    full = torch.zeros(out_shape, dtype=spectrum.dtype)
    letters = "xyz"[:k]
    for corner in itertools.product((0, 1), repeat=k - 1):
        grid, kept = [], []
        for i, high in enumerate(corner):
            m, n = layer.modes[i], x.shape[2 + i]
            grid.append(slice(n - m, n) if high else slice(0, m))
            kept.append(slice(m, 2 * m) if high else slice(0, m))
        grid.append(slice(0, layer.modes[-1]))
        kept.append(slice(None))
        block = torch.einsum(
            f"bi{letters},io{letters}->bo{letters}",
            spectrum[(..., *grid)],
            weight[(slice(None), slice(None), *kept)],
        )
        full[(..., *grid)] = block
    return torch.fft.irfftn(full, s=x.shape[2:], dim=dims, norm="ortho")


@pytest.mark.parametrize(
    ("modes", "shape"), [((3, 4), (2, 3, 10, 12)), ((2, 3, 2), (1, 2, 6, 7, 5))], ids=["2d", "3d"]
)
def test_spectral_conv_is_rfftn_with_the_modes_cut(modes: tuple[int, ...], shape: tuple) -> None:
    torch.manual_seed(0)
    layer = SpectralConv(shape[1], 4, modes).double()
    x = torch.randn(shape, dtype=torch.float64)
    torch.testing.assert_close(layer(x), _reference_spectral_conv(layer, x), atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    ("overrides", "input_shape"),
    [
        ({}, (2, 1, 16, 12)),
        ({"in_channels": 3, "out_channels": 2, "coordinates": "periodic"}, (1, 3, 8, 10)),
        ({"modes": (2, 2, 3), "coordinates": "linear", "padding": 2}, (1, 1, 6, 5, 8)),
        ({"padding": 3, "activation": "silu"}, (2, 1, 7, 9)),
        ({"in_channels": 2, "residual": True}, (2, 2, 8, 8)),
    ],
)
def test_output_shape(overrides: dict[str, Any], input_shape: tuple[int, ...]) -> None:
    model = _tiny_fno(**overrides)
    expected = (input_shape[0], model.config.out_channels, *input_shape[2:])
    x = torch.randn(input_shape, dtype=torch.float64)
    assert model(x).shape == expected


def test_defaults_and_overrides() -> None:
    model = FNO(FNOConfig(width=16), modes=[4, 4, 4])
    assert model.config == FNOConfig(width=16, modes=(4, 4, 4))
    assert model.config.spatial_dims == 3
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("input_shape", "overrides", "message"),
    [
        ((1, 1, 5, 12), {}, r"needs at most \(2, 7\) modes"),
        ((1, 1, 12, 3), {}, r"needs at most \(6, 2\) modes"),
        ((1, 1, 5, 12), {"padding": 1}, None),
        ((1, 2, 8, 8), {}, r"expects input \(B, 1, N_1, N_2\)"),
        ((1, 1, 8, 8, 8), {}, r"expects input \(B, 1, N_1, N_2\)"),
    ],
)
def test_rejects_input(
    input_shape: tuple[int, ...], overrides: dict[str, Any], message: str | None
) -> None:
    model = _tiny_fno(**overrides)
    x = torch.randn(input_shape, dtype=torch.float64)
    if message is None:
        assert model(x).shape == input_shape
        return
    with pytest.raises(ValueError, match=message):
        model(x)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"width": 0}, "width must be a positive integer"),
        ({"layers": True}, "layers must be a positive integer"),
        ({"modes": (4,)}, "must have one entry per spatial dim"),
        ({"modes": (4, 0)}, "every entry of modes"),
        ({"padding": -1}, "padding must be a non-negative integer"),
        ({"coordinates": "grid"}, "coordinates must be one of"),
        ({"activation": "relu"}, "activation must be one of"),
        ({"residual": True, "out_channels": 2}, "residual=True needs out_channels <= in_channels"),
    ],
)
def test_config_validation(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message) if "(" in message else message):
        FNOConfig(**{**TINY, **overrides})


def test_periodic_translation_equivariance() -> None:
    """Without position features or padding every layer commutes with any periodic shift."""
    model = _tiny_fno()
    x = torch.randn(2, 1, 12, 10, dtype=torch.float64)
    y = model(x)
    for shift in [(1, 0), (0, -3), (5, 7)]:
        shifted = model(torch.roll(x, shift, dims=(2, 3)))
        torch.testing.assert_close(shifted, torch.roll(y, shift, dims=(2, 3)))
    located = _tiny_fno(coordinates="periodic")
    difference = located(torch.roll(x, (5, 7), dims=(2, 3))) - torch.roll(
        located(x), (5, 7), dims=(2, 3)
    )
    assert difference.abs().max() > 1e-3


@pytest.mark.parametrize(
    "overrides", [{"residual": True, "coordinates": "periodic"}, {"padding": 2}]
)
def test_gradients_reach_every_parameter(overrides: dict[str, Any]) -> None:
    model = _tiny_fno(**{**overrides, "in_channels": 1})
    model(torch.randn(2, 1, 8, 8, dtype=torch.float64)).square().mean().backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert missing == []


def test_bf16_autocast_runs_the_spectral_path_in_float32() -> None:
    """FFTs take no bfloat16 on CPU: under autocast the spectral convolution computes in
    float32 and returns bfloat16, close to the float32 model."""
    torch.manual_seed(0)
    model = FNO(**TINY)
    x = torch.randn(2, 1, 16, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
        spectral = model.spectral[0](torch.randn(2, 6, 16, 12, dtype=torch.bfloat16))
    assert spectral.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), model(x), atol=0.05, rtol=0.05)


def test_overfits_a_fixed_pair() -> None:
    model = _tiny_fno(residual=True).float()
    x, target = torch.randn(2, 1, 12, 12), torch.randn(2, 1, 12, 12)
    assert_learns_a_fixed_pair(model, x, target)


# ---------------------------------------------------------------------------- domain-parallel
# (B, C, *spatial), the sharded dim's sizes over the ranks, modes; see _spectral_bytes_body.
SPECTRAL_CASES = {
    "2d-H-4r": ((2, 3, 16, 16), (6, 2, 4, 4), (3, 3)),
    "3d-D-2r": ((1, 2, 8, 6, 10), (5, 3), (2, 2, 3)),
}


def _spectral_bytes_body(name: str) -> None:
    """One spectral convolution on a field split along its first spatial dim: forward, one
    all-to-all of the kept modes there and one back; backward, the same two reversed plus the
    all-gather of the weight's gradient (each rank holds the gradient of its modes); the output
    in the input's layout."""
    shape, sizes, modes = SPECTRAL_CASES[name]
    mesh = get_mesh((len(sizes),))
    rank = torch.distributed.get_rank()
    batch, channels, first = shape[:3]
    layer = SpectralConv(channels, channels, modes).double()
    layout = Layout((Shard(2),), {2: sizes})
    x = torch.randn(shape, dtype=torch.float64)
    spec = layout.spec(mesh, x)
    sharded = from_local_spec(spec.narrow(x).requires_grad_(True), spec)
    with counted_comm() as forward:
        y = layer(sharded)
    # The last dim's kept modes are split (torch.chunk) over the ranks while the first
    # spatial dim is whole; the dims between hold 2 m modes each.
    mode_share = chunk_sizes(modes[-1], len(sizes))[rank]
    complex_bytes = 16 * batch * channels * math.prod(2 * m for m in modes[1:-1])
    there = complex_bytes * mode_share * (first - sizes[rank])
    back = complex_bytes * sizes[rank] * (modes[-1] - mode_share)
    expected = there + back
    assert_all_ranks(
        dict(forward.calls) == {"all_to_all": 2} and forward.received["all_to_all"] == expected,
        f"{name}: forward moved {forward.as_dict()}, expected {expected} bytes in 2 all-to-alls",
    )
    assert_all_ranks(
        y._spec.same_layout(spec.with_dtype(y.dtype)), f"{name}: output layout {y._spec}"
    )
    loss = (y * y).sum().full_tensor()
    with counted_comm() as backward:
        loss.backward()
    weight_share = layer.weight.numel() // modes[-1] * 8 * mode_share
    assert_all_ranks(
        backward.calls["all_to_all"] == 2
        and backward.sent["all_to_all"] == expected
        and backward.sent["all_gather"] == weight_share * (len(sizes) - 1),
        f"{name}: backward moved {backward.as_dict()}, expected the forward's all-to-alls "
        f"reversed and the weight gradient's all-gather",
    )


@pytest.mark.parametrize("name", list(SPECTRAL_CASES))
def test_spectral_conv_moves_only_kept_modes(name: str) -> None:
    run_on_ranks(len(SPECTRAL_CASES[name][1]), _spectral_bytes_body, name)


def _block_body() -> None:
    """A 2x2 block (H, W split): the whole field moves W -> H before rfft and back after
    irfft, the kept modes move twice in between; the output is in the input's layout."""
    mesh = get_mesh((2, 2))
    layer = SpectralConv(2, 2, (2, 2)).double()
    layout = Layout((Shard(2), Shard(3)), {2: (5, 3), 3: (2, 4)})
    x = torch.randn(1, 2, 8, 6, dtype=torch.float64)
    spec = layout.spec(mesh, x)
    with counted_comm() as forward:
        y = layer(from_local_spec(spec.narrow(x), spec))
    assert_all_ranks(
        dict(forward.calls) == {"all_to_all": 4} and y._spec.same_layout(spec),
        f"block: moved {forward.as_dict()} into {y._spec}",
    )


def test_spectral_conv_on_a_block() -> None:
    run_on_ranks(4, _block_body)
