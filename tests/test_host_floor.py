"""The floor benchmark's wrapper subclass (``benchmarks.host_floor.Unwrapping``) does plain
torch's work: its step is a floor only if it computes the same values through every op."""

from __future__ import annotations

import copy

import torch
from torch import nn

from benchmarks.host_floor import Unwrapping, wrap_parameters


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1, padding_mode="circular"),
        nn.GroupNorm(2, 4),
        nn.ReLU(inplace=True),  # an in-place op returns the wrapper it wrote into
        nn.Flatten(),
        nn.Linear(4 * 8 * 8, 3),
    ).double()


def test_unwrapping_step_matches_plain_torch_in_float64():
    plain = _net()
    wrapped = wrap_parameters(copy.deepcopy(plain))
    x = torch.randn(2, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = plain(x)
    (expected * expected).mean().backward()
    out = wrapped(Unwrapping(x))
    (out * out).mean().backward()
    assert type(out) is Unwrapping
    torch.testing.assert_close(out.elem, expected, rtol=0, atol=1e-14)
    for (name, p), w in zip(plain.named_parameters(), wrapped.parameters()):
        assert isinstance(w, Unwrapping) and type(w.grad) is Unwrapping, name
        torch.testing.assert_close(w.grad.elem, p.grad, rtol=0, atol=1e-14, msg=name)
