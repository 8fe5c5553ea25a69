"""Outputs keep their input's layout (NOTE [Which rank owns an output of a windowed op] in
``shardsci/tensor/_ops/_windows.py``): each op or module fixed for it, against one process in
float64, forward and gradients, on an uneven 1-D split, one with an empty shard and an uneven
2x2 block decomposition, with the output's placements and shard sizes stated.

The configurations of a layout run in one rank call (``what`` names the failing one).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard

from shardsci.testing import (
    Layout,
    check_against_reference,
    get_mesh,
    run_on_ranks,
)
from tests.layouts import Sharded

# (B, C, H, W) fields: H split unevenly, W split unevenly, H with an empty shard, 2x2 blocks
# uneven in opposite directions.
FIELDS = [
    Sharded("2r-H-7/3", (2,), (2, 4, 10, 6), Layout((Shard(2),), {2: (7, 3)})),
    Sharded("2r-W-1/5", (2,), (2, 4, 10, 6), Layout((Shard(3),), {3: (1, 5)})),
    Sharded("4r-H-0/5/2/3", (4,), (2, 4, 10, 6), Layout((Shard(2),), {2: (0, 5, 2, 3)})),
    Sharded(
        "2x2-6/4x2/4", (2, 2), (2, 4, 10, 6), Layout((Shard(2), Shard(3)), {2: (6, 4), 3: (2, 4)})
    ),
]


# ---------------------------------------------------------------------------- flatten, unflatten
class ChannelMLP(nn.Module):
    """neuraloperator's channel MLP: spatial dims flattened, a pointwise conv1d, unflattened."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, *spatial = x.shape
        return self.conv(x.reshape(b, x.shape[1], -1)).reshape(b, -1, *spatial)


class TokenMixer(nn.Module):
    """diffusers' attention block around its tokens: ``(B, C, H W)`` transposed to tokens, a
    linear map of channels, transposed back and unflattened."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.linear = nn.Linear(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        tokens = x.view(b, c, h * w).transpose(1, 2)
        return self.linear(tokens).transpose(1, 2).reshape(b, c, h, w) + x


def _flatten_unflatten(x: torch.Tensor) -> torch.Tensor:
    return torch.flatten(x, 2).unflatten(2, x.shape[2:]) * 2


def _views_body(case: Sharded) -> None:
    mesh = get_mesh(case.mesh)
    x = torch.randn(case.shape, dtype=torch.float64)
    channels = case.shape[1]
    runs: dict[str, tuple[Callable, nn.Module | None]] = {
        "flatten-unflatten": (_flatten_unflatten, None),
        "channel-mlp": (lambda m, a: m(a), ChannelMLP(channels).double()),
        "token-mixer": (lambda m, a: m(a), TokenMixer(channels).double()),
    }
    for name, (fn, module) in runs.items():
        check_against_reference(fn, [x], [case.layout], mesh, module=module, what=name)


@pytest.mark.parametrize("case", FIELDS, ids=str)
def test_unflatten_returns_to_the_input_layout(case: Sharded) -> None:
    """An op on the flattened spatial dims, unflattened again, returns the input's layout
    (on 2x2 blocks it returned H-slabs over all four ranks)."""
    run_on_ranks(case.world, _views_body, case)
