"""The single-device UNet of the model zoo: shapes, validation, symmetry, gradients, training."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from shardsci.models import UNet, UNetConfig
from tests.zoo import assert_learns_a_fixed_pair

TINY: dict[str, Any] = {"width": 8, "depth": 2, "norm_groups": 4, "blocks_per_level": 1}
"""Overrides for a UNet small enough to run many times in a fast test."""


def _tiny_unet(seed: int = 0, **overrides: Any) -> UNet:
    torch.manual_seed(seed)
    return UNet(**{**TINY, **overrides})


@pytest.mark.parametrize(
    ("overrides", "input_shape", "output_shape"),
    [
        ({}, (2, 1, 16, 16), (2, 1, 16, 16)),
        ({"in_channels": 3, "out_channels": 2}, (1, 3, 8, 24), (1, 2, 8, 24)),
        ({"depth": 3, "channel_multipliers": (1, 2, 2, 4)}, (1, 1, 16, 8), (1, 1, 16, 8)),
        ({"depth": 1, "blocks_per_level": 3, "down": "max"}, (3, 1, 6, 10), (3, 1, 6, 10)),
        ({"up": "bilinear", "activation": "gelu", "padding_mode": "reflect"}, (1, 1, 8, 8), None),
        ({"in_channels": 2, "residual": True, "padding_mode": "replicate"}, (2, 2, 4, 4), None),
        ({"coordinates": "periodic", "padding_mode": "circular"}, (1, 1, 8, 12), None),
    ],
)
def test_output_shape(
    overrides: dict[str, Any],
    input_shape: tuple[int, ...],
    output_shape: tuple[int, ...] | None,
) -> None:
    model = _tiny_unet(**overrides)
    expected = output_shape or (input_shape[0], model.config.out_channels, *input_shape[2:])
    assert model(torch.randn(input_shape)).shape == expected


def test_default_config() -> None:
    model = UNet()
    assert model.config == UNetConfig()
    assert model.config.level_channels == (32, 64, 128, 256)
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())


def test_overrides_replace_config_fields() -> None:
    base = UNetConfig(width=16, padding_mode="circular")
    model = UNet(base, depth=2, channel_multipliers=[1, 2, 3])
    assert model.config == UNetConfig(
        width=16, padding_mode="circular", depth=2, channel_multipliers=(1, 2, 3)
    )
    assert model.config.level_channels == (16, 32, 48)


@pytest.mark.parametrize(
    ("input_shape", "overrides"),
    [
        ((1, 1, 14, 16), {}),
        ((1, 1, 16, 10), {}),
        ((1, 1, 4, 4), {"padding_mode": "reflect"}),
    ],
)
def test_rejects_spatial_shape(input_shape: tuple[int, ...], overrides: dict[str, Any]) -> None:
    model = _tiny_unet(**overrides)
    shape = re.escape(str(input_shape))
    with pytest.raises(ValueError, match=rf"divisible by 4 .* got input shape {shape}"):
        model(torch.randn(input_shape))


@pytest.mark.parametrize("input_shape", [(1, 2, 8, 8), (1, 8, 8)])
def test_rejects_channels_and_rank(input_shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"expects input \(B, 1, H, W\)"):
        _tiny_unet()(torch.randn(input_shape))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"width": 0}, "width must be a positive integer"),
        ({"depth": 2.0}, "depth must be a positive integer"),
        ({"padding_mode": "periodic"}, "padding_mode must be one of"),
        ({"down": "stride"}, "down must be one of"),
        ({"channel_multipliers": (1, 2)}, "has 2 entries, expected depth \\+ 1 = 3"),
        ({"channel_multipliers": (1, 0, 2)}, "every entry of channel_multipliers"),
        ({"norm_groups": 3}, "norm_groups=3 must divide"),
        ({"coordinates": "xy"}, "coordinates must be one of"),
        ({"residual": True, "out_channels": 2}, "residual=True needs out_channels <= in_channels"),
    ],
)
def test_config_validation(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        UNetConfig(**{**TINY, **overrides})


def _periodic_shift_error(padding_mode: str) -> float:
    """Largest |model(roll(x)) - roll(model(x))| over shifts by multiples of ``2**depth``."""
    model = _tiny_unet(padding_mode=padding_mode).double()
    x = torch.randn(2, 1, 16, 24, dtype=torch.float64)
    y = model(x)
    errors = [
        (model(torch.roll(x, shift, dims=(2, 3))) - torch.roll(y, shift, dims=(2, 3))).abs().max()
        for shift in [(4, 0), (0, -8), (12, 20)]
    ]
    return max(errors).item()


def test_circular_padding_is_periodic_translation_equivariant() -> None:
    assert _periodic_shift_error("circular") < 1e-12


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect", "replicate"])
def test_other_padding_is_not_periodic_translation_equivariant(padding_mode: str) -> None:
    assert _periodic_shift_error(padding_mode) > 1e-3


@pytest.mark.parametrize("residual", [False, True])
def test_gradients_reach_every_parameter(residual: bool) -> None:
    model = _tiny_unet(residual=residual, padding_mode="circular")
    model(torch.randn(2, 1, 8, 8)).square().mean().backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert missing == []


def test_residual_adds_the_input_to_the_correction() -> None:
    plain = _tiny_unet(in_channels=3, out_channels=2)
    residual = _tiny_unet(in_channels=3, out_channels=2, residual=True)
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(residual(x), x[:, :2] + plain(x))


def test_init_is_deterministic_under_a_seed() -> None:
    first, second = _tiny_unet(seed=3).state_dict(), _tiny_unet(seed=3).state_dict()
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_float64() -> None:
    model = _tiny_unet(up="bilinear").double()
    y = model(torch.randn(1, 1, 8, 8, dtype=torch.float64))
    assert y.dtype == torch.float64


def test_overfits_a_fixed_pair() -> None:
    model = _tiny_unet(padding_mode="circular")
    x, target = torch.randn(2, 1, 16, 16), torch.randn(2, 1, 16, 16)
    assert_learns_a_fixed_pair(model, x, target)
