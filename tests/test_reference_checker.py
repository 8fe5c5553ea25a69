"""The reference checker fails for the right reasons.

Deliberate errors (a forward off by 1e-7 relative, a wrong gradient, a weight gradient not
summed over shards, a running statistic taken over one shard, a wrong layout, a plain result,
traffic shardsci does not count, a shard whose size is not its spec's) each make
``check_against_reference`` fail, naming the problem; several at once are all reported, each
under its aspect.
And for every op family, an implementation that gathers its input, computes on the whole
tensor and lays the result out again (as a plain tensor, replicated, re-split with
``torch.chunk`` sizes, or re-split exactly as it should be) fails: the first three by their
layout, the last by its traffic.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

from shardsci.tensor import ShardTensor, ShardTensorSpec
from shardsci.tensor._api import from_local_spec
from shardsci.tensor._spec import replicated_spec
from shardsci.testing import (
    ExpectedLayout,
    Layout,
    check_against_reference,
    get_mesh,
    run_on_ranks,
)
from shardsci.testing._reference import ReferenceMismatch
from tests.expected_layouts import module_anchors, renamed, window_anchor, windowed
from tests.layouts import SPATIAL_2D, Sharded

F64 = torch.float64
TWO_RANKS, FOUR_RANKS = SPATIAL_2D[0], SPATIAL_2D[1]  # (2, 3, 11, 6) split along H


def _failure(check: Callable[[], Any]) -> str:
    """The checker's message on every rank (they must agree), or "" if it passed."""
    try:
        check()
    except AssertionError as exc:
        return str(exc)
    return ""


def _check(case: Sharded, fn, inputs, layouts, **kwargs) -> str:
    return _failure(
        lambda: check_against_reference(fn, inputs, layouts, get_mesh(case.mesh), **kwargs)
    )


def _sharded(t: object) -> bool:
    return isinstance(t, ShardTensor)


# ---------------------------------------------------------------------------- deliberate errors
class _ScaledGradient(torch.autograd.Function):
    """Identity whose backward is off by 0.1 %."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad * 1.001


class _LocalWeight(nn.Module):
    """``x * weight``, with the weight applied to each shard as a plain local tensor: its
    gradient is this shard's contribution only, never summed over the shards."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, dtype=F64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _sharded(x):
            return from_local_spec(x.to_local() * self.weight, x._spec)
        return x * self.weight


class _LocalRunningMean(nn.Module):
    """``sin(x)``, keeping a running mean of the channels over this rank's shard only (a
    batch-norm statistic that was never reduced over the shards)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(3, dtype=F64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = x.to_local() if _sharded(x) else x
        with torch.no_grad():
            self.running_mean += local.detach().sum(dim=(0, 2, 3)) / x.shape[2]
        return x.sin()


def _shrunk(x: ShardTensor) -> ShardTensor:
    """Rank 0's shard loses a row its spec still counts."""
    local = x.to_local()
    if dist.get_rank() == 0:
        local = local[:, :, :-1]
    return ShardTensor(local.detach(), x._spec)


def _uncounted_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _sharded(x):
        dist.all_reduce(torch.zeros(4, dtype=F64))
    return x.sin()


ERRORS: dict[str, tuple[Callable[[Sharded, torch.Tensor], str], str]] = {
    # name -> (run the checker on the broken computation, what its message must contain)
    "forward off by 1e-7": (
        lambda c, x: _check(c, lambda a: a.sin() * (1 + 1e-7 * _sharded(a)), [x], [c.layout]),
        "output 0: Tensor-likes are not close",
    ),
    "wrong gradient": (
        lambda c, x: _check(
            c,
            lambda a: (
                from_local_spec(_ScaledGradient.apply(a.to_local()), a._spec)
                if _sharded(a)
                else a.clone()
            ),
            [x],
            [c.layout],
        ),
        "grad of input 0: Tensor-likes are not close",
    ),
    "weight gradient not summed over shards": (
        lambda c, x: _check(c, lambda m, a: m(a), [x], [c.layout], module=_LocalWeight()),
        "grad of parameter weight: Tensor-likes are not close",
    ),
    "running statistic over one shard": (
        lambda c, x: _check(c, lambda m, a: m(a), [x], [c.layout], module=_LocalRunningMean()),
        "buffer running_mean: Tensor-likes are not close",
    ),
    "wrong layout": (
        lambda c, x: _check(
            c,
            lambda a: a.sin().redistribute(placements=[Shard(3)]) if _sharded(a) else a.sin(),
            [x],
            [c.layout],
        ),
        "output 0: laid out as ShardTensorSpec(shape=(2, 3, 11, 6), placements=(Shard(dim=3),)",
    ),
    "plain result": (
        lambda c, x: _check(
            c, lambda a: a.sin().full_tensor() if _sharded(a) else a.sin(), [x], [c.layout]
        ),
        "output 0: a plain Tensor, expected a ShardTensor",
    ),
    "unstated layout of a new shape": (
        lambda c, x: _check(c, lambda a: a[:, :, :5], [x], [c.layout]),
        "output 0: shape (2, 3, 5, 6) differs from the sharded input's (2, 3, 11, 6): state",
    ),
    "traffic shardsci does not count": (
        lambda c, x: _check(c, _uncounted_all_reduce, [x], [c.layout]),
        "forward: shardsci recorded 0 bytes sent and 0 received",
    ),
    "shard smaller than its spec": (
        lambda c, x: _check(
            c, lambda a: _shrunk(a.detach()) if _sharded(a) else a, [x], [c.layout], grad=False
        ),
        "output 0: shard has shape (2, 3, 6, 6) but its spec says (2, 3, 7, 6)",
    ),
}


def _error_body(name: str) -> str:
    run, _ = ERRORS[name]
    return run(TWO_RANKS, torch.randn(TWO_RANKS.shape, dtype=F64))


def _correct_body() -> str:
    x = torch.randn(TWO_RANKS.shape, dtype=F64)
    return _check(TWO_RANKS, lambda m, a: m(a).sin(), [x], [TWO_RANKS.layout], module=nn.Identity())


def test_a_correct_computation_passes() -> None:
    assert run_on_ranks(2, _correct_body) == ["", ""]


@pytest.mark.parametrize("name", list(ERRORS))
def test_a_deliberate_error_fails_the_checker(name: str) -> None:
    messages = run_on_ranks(2, _error_body, name)
    assert messages[0] == messages[1]
    assert ERRORS[name][1] in messages[0], messages[0]


def _several_errors_body() -> tuple[list[str], str]:
    """A result off by 1e-7 (so its gradient too) and laid out along W: all three are
    reported, each with its aspect."""

    def wrong(a: torch.Tensor) -> torch.Tensor:
        if not _sharded(a):
            return a.sin()
        return (a.sin() * (1 + 1e-7)).redistribute(placements=[Shard(3)])

    x = torch.randn(TWO_RANKS.shape, dtype=F64)
    try:
        check_against_reference(wrong, [x], [TWO_RANKS.layout], get_mesh(TWO_RANKS.mesh))
    except ReferenceMismatch as exc:
        return sorted(exc.aspects), str(exc)
    return [], ""


def test_every_problem_is_reported_with_its_aspect() -> None:
    aspects, message = run_on_ranks(2, _several_errors_body)[0]
    assert aspects == ["gradients", "layout", "values"], message
    assert "output 0: laid out as" in message and "Tensor-likes are not close" in message


# ---------------------------------------------------------------------------- gathering fallbacks
def _relaid(out: torch.Tensor, like: ShardTensor, how: str, exact: Layout) -> torch.Tensor:
    """A whole result laid out again on ``like``'s mesh, differentiably."""
    mesh = like._spec.mesh
    if how == "plain":
        return out
    if how == "replicated":
        return from_local_spec(out, replicated_spec(out, mesh))
    if how == "chunk":
        spec = ShardTensorSpec.build(mesh, exact.placements, out.shape, out.dtype)
    else:
        spec = exact.spec(mesh, out)
    return from_local_spec(spec.narrow(out), spec)


def _gathering(fn: Callable, how: str, expected: ExpectedLayout, shape: tuple) -> Callable:
    """``fn`` the lazy way: gather every sharded input, compute, lay the result out again."""

    def fallback(*args: Any) -> torch.Tensor:
        like = next((a for a in args if _sharded(a)), None)
        if like is None:
            return fn(*args)
        out = fn(*(a.full_tensor() if _sharded(a) else a for a in args))
        exact = expected if isinstance(expected, Layout) else expected(tuple(out.shape))
        return _relaid(out, like, how, exact)

    return fallback


def _conv(case: Sharded):
    module = nn.Conv2d(3, 3, 3, padding=1, dtype=F64)
    return (lambda m, a: m(a)), module, case.layout


def _norm(case: Sharded):
    return (lambda m, a: m(a)), nn.GroupNorm(1, 3, dtype=F64), case.layout


def _pool(case: Sharded):
    module = nn.MaxPool2d(2)
    layout = windowed(case.layout, case.shape, case.mesh, module_anchors(module, 4))
    return (lambda m, a: m(a)), module, layout


def _interpolate(case: Sharded):
    layout = windowed(case.layout, case.shape, case.mesh, {2: lambda j: j // 2})
    return (lambda a: F.interpolate(a, scale_factor=2)), None, layout


def _fft(case: Sharded):
    def round_trip(a: torch.Tensor) -> torch.Tensor:
        return torch.fft.irfft(torch.fft.rfft(a, dim=2) * 0.5, n=11, dim=2)

    return round_trip, None, case.layout


def _reduction(case: Sharded):
    return (lambda a: torch.softmax(a, 2) + a.mean(dim=(2, 3), keepdim=True)), None, case.layout


def _view(case: Sharded):
    layout = renamed(case.layout, case.shape, case.mesh, {}, {2: 6})
    return (lambda a: a.flatten(2)), None, layout


def _matmul(case: Sharded):
    weight = torch.randn(6, 4, dtype=F64)
    return (lambda a: a @ weight), None, case.layout


def _window(case: Sharded):
    layout = windowed(case.layout, case.shape, case.mesh, {2: window_anchor(1, 1, 2, 1)})
    return (lambda a: F.pad(a, (0, 0, 2, 1), mode="replicate")), None, layout


FAMILIES = {
    "conv": _conv,
    "norm": _norm,
    "pool": _pool,
    "interpolate": _interpolate,
    "fft": _fft,
    "reduction": _reduction,
    "view": _view,
    "matmul": _matmul,
    "pad": _window,
}
# How each fallback lays its result out -> what the checker says. On two ranks the gather
# traffic is that of a legitimate swap, so the layout must catch it; on four, the traffic.
FALLBACKS = {
    (2, "plain"): "a plain Tensor, expected a ShardTensor",
    (2, "replicated"): "laid out as ShardTensorSpec(shape=",
    (2, "chunk"): "laid out as ShardTensorSpec(shape=",
    (4, "exact"): "an op on shards must not gather its input",
}


def _family_body(family: str, world: int) -> dict[str, str]:
    case = TWO_RANKS if world == 2 else FOUR_RANKS
    fn, module, expected = FAMILIES[family](case)
    x = torch.randn(case.shape, dtype=F64)
    kwargs = {"module": module} if module is not None else {}
    messages = {"honest": _check(case, fn, [x], [case.layout], out_layouts=[expected], **kwargs)}
    for w, how in FALLBACKS:
        if w == world:
            lazy = _gathering(fn, how, expected, case.shape)
            messages[how] = _check(case, lazy, [x], [case.layout], out_layouts=[expected], **kwargs)
    return messages


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_gathering_fallback_fails_the_checker(family: str, world: int) -> None:
    messages = run_on_ranks(world, _family_body, family, world)[0]
    assert messages.pop("honest") == ""
    for how, message in messages.items():
        assert FALLBACKS[world, how] in message, f"{family} {how}: {message!r}"
