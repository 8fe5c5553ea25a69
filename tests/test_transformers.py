"""The zoo's attention models on one device: ViT (patch tokens) and Transolver (physics
attention): shapes, validation, symmetries, gradients and a short fit. Sharded == single is in
``tests/test_zoo_sharded.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardsci.models import Transolver, TransolverConfig, ViT, ViTConfig
from tests.zoo import assert_learns_a_fixed_pair

TINY_VIT: dict[str, Any] = {"patch_size": 2, "width": 8, "depth": 2, "heads": 2, "mlp_ratio": 2}
TINY_TRANSOLVER: dict[str, Any] = {"width": 8, "layers": 2, "heads": 2, "slices": 4}


def _model(kind: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "vit":
        return ViT(**{**TINY_VIT, **overrides}).double()
    return Transolver(**{**TINY_TRANSOLVER, **overrides}).double()


@pytest.mark.parametrize(
    ("kind", "overrides", "input_shape"),
    [
        ("vit", {}, (2, 1, 8, 12)),
        ("vit", {"in_channels": 3, "out_channels": 2, "coordinates": "linear"}, (1, 3, 4, 6)),
        ("vit", {"in_channels": 2, "residual": True, "patch_size": 4}, (2, 2, 8, 8)),
        ("transolver", {}, (2, 1, 6, 5)),
        ("transolver", {"spatial_dims": 3, "in_channels": 2, "out_channels": 3}, (1, 2, 3, 4, 5)),
        ("transolver", {"spatial_dims": 1, "residual": True}, (2, 1, 9)),
    ],
)
def test_output_shape(kind: str, overrides: dict[str, Any], input_shape: tuple[int, ...]) -> None:
    model = _model(kind, **overrides)
    expected = (input_shape[0], model.config.out_channels, *input_shape[2:])
    assert model(torch.randn(input_shape, dtype=torch.float64)).shape == expected


@pytest.mark.parametrize(
    ("kind", "input_shape", "message"),
    [
        ("vit", (1, 1, 7, 8), r"positive multiples of 2, got input shape \(1, 1, 7, 8\)"),
        ("vit", (1, 2, 8, 8), r"expects input \(B, 1, H, W\)"),
        ("transolver", (1, 1, 8, 8, 8), r"expects input \(B, 1, N_1, N_2\)"),
    ],
)
def test_rejects_input(kind: str, input_shape: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _model(kind)(torch.randn(input_shape, dtype=torch.float64))


@pytest.mark.parametrize(
    ("config", "overrides", "message"),
    [
        (ViTConfig, {"heads": 3}, "heads=3 must divide width=8"),
        (ViTConfig, {"patch_size": 0}, "patch_size must be a positive integer"),
        (ViTConfig, {"coordinates": "learned"}, "coordinates must be one of"),
        (ViTConfig, {"residual": True, "out_channels": 2}, "residual=True needs"),
        (TransolverConfig, {"slices": 0}, "slices must be a positive integer"),
        (TransolverConfig, {"spatial_dims": 4}, "spatial_dims must be 1, 2 or 3"),
        (TransolverConfig, {"heads": 5}, "heads=5 must divide width=8"),
    ],
)
def test_config_validation(config: type, overrides: dict[str, Any], message: str) -> None:
    tiny = TINY_VIT if config is ViTConfig else TINY_TRANSOLVER
    with pytest.raises(ValueError, match=message):
        config(**{**tiny, **overrides})


def test_transolver_is_equivariant_to_any_permutation_of_cells() -> None:
    """Without position features every op is per cell or a sum over all cells."""
    model = _model("transolver", coordinates="none")
    x = torch.randn(2, 1, 5, 6, dtype=torch.float64)
    order = torch.randperm(30)
    permuted = x.flatten(2)[..., order].reshape(x.shape)
    expected = model(x).flatten(2)[..., order].reshape(x.shape)
    torch.testing.assert_close(model(permuted), expected)


def test_vit_is_equivariant_to_periodic_shifts_by_whole_patches() -> None:
    model = _model("vit", coordinates="none")
    x = torch.randn(1, 1, 8, 6, dtype=torch.float64)
    shifted = model(torch.roll(x, (2, -4), dims=(2, 3)))
    torch.testing.assert_close(shifted, torch.roll(model(x), (2, -4), dims=(2, 3)))


@pytest.mark.parametrize("kind", ["vit", "transolver"])
def test_gradients_reach_every_parameter(kind: str) -> None:
    model = _model(kind)
    model(torch.randn(2, 1, 8, 8, dtype=torch.float64)).square().mean().backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert missing == []


@pytest.mark.parametrize("kind", ["vit", "transolver"])
def test_overfits_a_fixed_pair(kind: str) -> None:
    model = _model(kind, residual=True).float()
    x, target = torch.randn(2, 1, 8, 8), torch.randn(2, 1, 8, 8)
    assert_learns_a_fixed_pair(model, x, target)
