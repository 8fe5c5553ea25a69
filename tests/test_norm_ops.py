"""Group, batch, instance and layer normalisation on sharded tensors against the single-process
reference: forward, input and parameter gradients, running statistics (equal to the reference
and bitwise identical on every rank), eval mode, float64, uneven and empty shards, spatial and
batch sharding, 1-D meshes and 2x2 block decompositions, 1-D, 2-D and 3-D inputs."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from shardsci.tensor._api import from_local_spec
from shardsci.tensor._ops import _norm_ops
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    assert_close_all_ranks,
    assert_raises_all_ranks,
    check_against_reference,
    counted_comm,
    get_mesh,
    run_on_ranks,
)
from tests.layouts import Sharded

F64 = torch.float64


SPATIAL = [
    Sharded("2r-H-7/4", (2,), (2, 4, 11, 6), Layout((Shard(2),), {2: (7, 4)})),
    Sharded("4r-H-3/0/5/3", (4,), (2, 4, 11, 6), Layout((Shard(2),), {2: (3, 0, 5, 3)})),
    Sharded("4r-W-even", (4,), (2, 4, 5, 12), Layout((Shard(3),), {3: (3, 3, 3, 3)})),
    Sharded(
        "2x2-block", (2, 2), (2, 4, 11, 9), Layout((Shard(2), Shard(3)), {2: (6, 5), 3: (4, 5)})
    ),
]
BATCH = [
    Sharded("2r-N-3/1", (2,), (4, 4, 5, 6), Layout((Shard(0),), {0: (3, 1)})),
    Sharded("4r-N-2/0/1/2", (4,), (5, 4, 3, 4), Layout((Shard(0),), {0: (2, 0, 1, 2)})),
    Sharded("2x2-N-H", (2, 2), (5, 4, 7, 6), Layout((Shard(0), Shard(2)), {0: (3, 2), 2: (4, 3)})),
]
VOLUME = Sharded(
    "2x2-D-H-3d", (2, 2), (2, 4, 5, 6, 4), Layout((Shard(2), Shard(3)), {2: (3, 2), 3: (2, 4)})
)

Factory = Callable[[tuple[int, ...]], nn.Module]
_BATCH_NORM = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}
_INSTANCE_NORM = {3: nn.InstanceNorm1d, 4: nn.InstanceNorm2d, 5: nn.InstanceNorm3d}

MODULES: dict[str, Factory] = {
    "GroupNorm(2)": lambda s: nn.GroupNorm(2, s[1], dtype=F64),
    "GroupNorm(4)-no-affine": lambda s: nn.GroupNorm(4, s[1], affine=False, dtype=F64),
    "BatchNorm": lambda s: _BATCH_NORM[len(s)](s[1], dtype=F64),
    "BatchNorm-cumulative-no-affine": lambda s: _BATCH_NORM[len(s)](
        s[1], momentum=None, affine=False, dtype=F64
    ),
    "BatchNorm-untracked": lambda s: _BATCH_NORM[len(s)](
        s[1], track_running_stats=False, dtype=F64
    ),
    "InstanceNorm-affine-tracked": lambda s: _INSTANCE_NORM[len(s)](
        s[1], affine=True, track_running_stats=True, momentum=0.3, dtype=F64
    ),
    "InstanceNorm": lambda s: _INSTANCE_NORM[len(s)](s[1], dtype=F64),
    "LayerNorm(C,*S)": lambda s: nn.LayerNorm(s[1:], dtype=F64),
    "LayerNorm(S)-no-bias": lambda s: nn.LayerNorm(s[2:], bias=False, dtype=F64),
    "LayerNorm(last)-no-affine": lambda s: nn.LayerNorm(s[-1], elementwise_affine=False, dtype=F64),
}


def _randomized(module: nn.Module) -> nn.Module:
    """Non-trivial weights, biases and running statistics (defaults are 1, 0, 0 and 1)."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p))
        for name, b in module.named_buffers():
            if name == "running_mean":
                b.copy_(torch.randn_like(b))
            elif name == "running_var":
                b.copy_(torch.rand_like(b) + 0.5)
    return module


def _sharded(x: torch.Tensor, case: Sharded) -> torch.Tensor:
    spec = case.layout.spec(get_mesh(case.mesh), x)
    return from_local_spec(spec.narrow(x), spec)


def _check_buffers(module: nn.Module, reference: nn.Module, what: str) -> None:
    """Buffers equal the reference's and are bitwise identical on every rank."""
    for (name, b), expected in zip(module.named_buffers(), reference.buffers()):
        label = f"{what}: {name}"
        if b.is_floating_point():
            assert_close_all_ranks(b, expected, atol=1e-10, rtol=0, what=label)
        else:
            assert_all_ranks(bool((b == expected).all()), f"{label}: {b} != {expected}")
        everyone = [torch.empty_like(b) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, b.contiguous())
        assert_all_ranks(all(torch.equal(o, b) for o in everyone), f"{label} differs on ranks")


def _module_body(case: Sharded, name: str) -> None:
    torch.manual_seed(0)
    mesh = get_mesh(case.mesh)
    module = _randomized(MODULES[name](case.shape))
    reference = copy.deepcopy(module)
    x = torch.randn(case.shape, dtype=F64)
    what = f"{case}/{name}"
    tiny = math.prod(case.shape[2:]) == 1  # statistics weigh as much as the shards
    check_against_reference(
        lambda m, a: m(a),
        [x],
        [case.layout],
        mesh,
        module=module,
        rtol=0,
        not_a_gather="per-channel statistics of a (N, C) input" if tiny else "",
        what=what,
    )
    with torch.no_grad():
        reference(x)
        _check_buffers(module, reference, f"{what} after step 1")
        second = torch.randn(case.shape, dtype=F64)
        module(_sharded(second, case))
        reference(second)
        _check_buffers(module, reference, f"{what} after step 2")
    module.eval()
    module.zero_grad(set_to_none=True)
    check_against_reference(
        lambda m, a: m(a), [x], [case.layout], mesh, module=module, rtol=0, what=f"{what} eval"
    )


@pytest.mark.parametrize("case", SPATIAL, ids=str)
@pytest.mark.parametrize("name", list(MODULES))
def test_modules_spatial(case: Sharded, name: str) -> None:
    run_on_ranks(case.world, _module_body, case, name)


@pytest.mark.parametrize("case", BATCH, ids=str)
@pytest.mark.parametrize(
    "name", ["GroupNorm(2)", "BatchNorm", "InstanceNorm-affine-tracked", "LayerNorm(C,*S)"]
)
def test_modules_batch_sharded(case: Sharded, name: str) -> None:
    run_on_ranks(case.world, _module_body, case, name)


@pytest.mark.parametrize("name", list(MODULES))
def test_modules_3d(name: str) -> None:
    run_on_ranks(VOLUME.world, _module_body, VOLUME, name)


CHANNELS = [
    Sharded("2r-C-1/3", (2,), (2, 4, 5, 6), Layout((Shard(1),), {1: (1, 3)})),
    Sharded("4r-C-2/0/2/0", (4,), (3, 4, 5, 2), Layout((Shard(1),), {1: (2, 0, 2, 0)})),
    Sharded("2x2-C-H", (2, 2), (2, 4, 7, 3), Layout((Shard(1), Shard(2)), {1: (3, 1), 2: (4, 3)})),
]
CHANNEL_MODULES = [
    "GroupNorm(2)",
    "GroupNorm(4)-no-affine",
    "BatchNorm",
    "InstanceNorm-affine-tracked",
]


@pytest.mark.parametrize("case", CHANNELS, ids=str)
def test_modules_channels_sharded(case: Sharded) -> None:
    """Channels stay sharded (the output's layout is the input's): rows of BatchNorm and
    InstanceNorm, groups moved whole for GroupNorm; the running statistics whole on every
    rank."""
    for name in CHANNEL_MODULES:
        run_on_ranks(case.world, _module_body, case, name)


# No row's statistics split between ranks (one rank; H on an axis of size 1; channels split
# between groups; a layer norm over an unsharded dim): torch's norm kernel on the shard, not
# the sharded statistics' autograd Functions.
LOCAL_ROWS = [
    Sharded("1r-H", (1,), (2, 4, 11, 6), Layout((Shard(2),), {2: (11,)})),
    Sharded("2x1-N-H", (2, 1), (2, 4, 11, 6), Layout((Shard(0), Shard(2)), {0: (1, 1)})),
]
LOCAL_KERNEL_CASES = [
    *[
        (case, name)
        for case in LOCAL_ROWS
        for name in ["GroupNorm(2)", "GroupNorm(4)-no-affine", "LayerNorm(C,*S)"]
    ],
    (Sharded("2r-C-2/2", (2,), (2, 4, 5, 6), Layout((Shard(1),), {1: (2, 2)})), "GroupNorm(2)"),
    (SPATIAL[0], "LayerNorm(last)-no-affine"),
]


def _local_kernel_body(case: Sharded, name: str) -> None:
    grouped, rows = (
        mock.patch.object(f, "apply", wraps=f.apply)
        for f in (_norm_ops._ChannelNorm, _norm_ops._Normalize)
    )
    with grouped as grouped_calls, rows as row_calls:
        _module_body(case, name)
    calls = grouped_calls.call_count + row_calls.call_count
    assert calls == 0, f"{calls} sharded statistics on rows no rank splits"


@pytest.mark.parametrize(("case", "name"), LOCAL_KERNEL_CASES, ids=str)
def test_norm_of_unsplit_rows_is_the_local_kernel(case: Sharded, name: str) -> None:
    run_on_ranks(case.world, _local_kernel_body, case, name)


ONE_D = [
    Sharded("2r-L-5/4", (2,), (3, 2, 9), Layout((Shard(2),), {2: (5, 4)})),
    Sharded("4r-N-2/0/3/1", (4,), (6, 3), Layout((Shard(0),), {0: (2, 0, 3, 1)})),
]


@pytest.mark.parametrize("case", ONE_D, ids=str)
def test_batch_norm_1d(case: Sharded) -> None:
    run_on_ranks(case.world, _module_body, case, "BatchNorm")


def test_instance_norm_1d() -> None:
    run_on_ranks(2, _module_body, ONE_D[0], "InstanceNorm-affine-tracked")


def _unbatched_body() -> None:
    """InstanceNorm on a (C, H, W) input (the module adds and removes the batch dim)."""
    torch.manual_seed(0)
    module = _randomized(nn.InstanceNorm2d(3, affine=True, dtype=F64))
    x = torch.randn(3, 7, 5, dtype=F64)
    layout = Layout((Shard(1),), {1: (2, 0, 4, 1)})
    check_against_reference(lambda m, a: m(a), [x], [layout], get_mesh((4,)), module=module, rtol=0)


def test_instance_norm_unbatched() -> None:
    run_on_ranks(4, _unbatched_body)


# ---------------------------------------------------------------------------- functional forms
def _functional_body(case: Sharded) -> None:
    torch.manual_seed(0)
    channels, trailing = case.shape[1], case.shape[1:]
    x = torch.randn(case.shape, dtype=F64)
    w, b = torch.randn(channels, dtype=F64), torch.randn(channels, dtype=F64)
    lw, lb = torch.randn(trailing, dtype=F64), torch.randn(trailing, dtype=F64)
    calls = {
        "F.group_norm": lambda a, w, b, lw, lb: F.group_norm(a, 2, weight=w, bias=b, eps=1e-3),
        "torch.group_norm": lambda a, w, b, lw, lb: torch.group_norm(a, 4, w, b, 1e-5, False),
        "F.batch_norm": lambda a, w, b, lw, lb: F.batch_norm(a, None, None, w, b, training=True),
        "torch.batch_norm": lambda a, w, b, lw, lb: torch.batch_norm(
            a, w, b, None, None, True, 0.1, 1e-5, False
        ),
        "F.instance_norm": lambda a, w, b, lw, lb: F.instance_norm(a, weight=w, bias=b),
        "torch.instance_norm": lambda a, w, b, lw, lb: torch.instance_norm(
            a, w, None, None, None, True, 0.1, 1e-5, False
        ),
        "F.layer_norm": lambda a, w, b, lw, lb: F.layer_norm(a, trailing, lw, lb, eps=1e-4),
        "torch.layer_norm": lambda a, w, b, lw, lb: torch.layer_norm(
            a, trailing[1:], lw[0], None, 1e-5, False
        ),
    }
    layouts = [case.layout, None, None, None, None]
    for what, call in calls.items():
        check_against_reference(
            call, [x, w, b, lw, lb], layouts, get_mesh(case.mesh), rtol=0, what=f"{case}/{what}"
        )


@pytest.mark.parametrize("case", [SPATIAL[1], SPATIAL[3]], ids=str)
def test_functional_spellings(case: Sharded) -> None:
    run_on_ranks(case.world, _functional_body, case)


def _rms_norm_body(case: Sharded) -> None:
    torch.manual_seed(0)
    x = torch.randn(case.shape, dtype=F64)
    trailing = case.shape[1:]
    w, w_all = torch.randn(trailing, dtype=F64), torch.randn(case.shape, dtype=F64)
    calls = {
        "F.rms_norm(N,C,*S)": lambda a, w, w_all: F.rms_norm(a, case.shape, w_all, eps=0.5),
        "F.rms_norm(C,*S)": lambda a, w, w_all: F.rms_norm(a, trailing, w),
        "F.rms_norm(S)": lambda a, w, w_all: F.rms_norm(a, trailing[1:], w[0], eps=1e-3),
        "torch.rms_norm(last)": lambda a, w, w_all: torch.rms_norm(a, trailing[-1:]),
    }
    for what, call in calls.items():
        check_against_reference(
            call,
            [x, w, w_all],
            [case.layout, None, None],
            get_mesh(case.mesh),
            rtol=0,
            what=f"{case}/{what}",
        )


TINY = Sharded("4r-L-0/1/1/1", (4,), (1, 2, 3), Layout((Shard(2),), {2: (0, 1, 1, 1)}))


@pytest.mark.parametrize("case", [SPATIAL[1], SPATIAL[3], CHANNELS[2], TINY], ids=str)
def test_rms_norm(case: Sharded) -> None:
    """Over sharded dims (uneven, empty shards) like LayerNorm, in the input's layout."""
    run_on_ranks(case.world, _rms_norm_body, case)


def _native_batch_norm_body(case: Sharded, statistics: Layout) -> None:
    """aten's batch norms called directly: the output in the input's layout, the batch mean
    and inverse standard deviation sharded like the channels; ``_batch_norm_with_update``
    (what ``F.batch_norm`` becomes in traced graphs; before, it had no handler and gathered
    the input) also updates the running statistics as one process does."""
    torch.manual_seed(0)
    channels = case.shape[1]
    x = torch.randn(case.shape, dtype=F64)
    w, b = torch.randn(channels, dtype=F64), torch.randn(channels, dtype=F64)
    initial = torch.rand(channels, dtype=F64), torch.rand(channels, dtype=F64) + 1
    running: list[tuple[torch.Tensor, torch.Tensor]] = []  # the reference's, then the shards'

    def with_update(a, w, b):
        mean, var = initial[0].clone(), initial[1].clone()
        running.append((mean, var))
        return torch.ops.aten._batch_norm_with_update(a, w, b, mean, var, 0.3, 1e-4)[:3]

    for what, call in {
        "aten._batch_norm_with_update": with_update,
        "torch.native_batch_norm": lambda a, w, b: torch.native_batch_norm(
            a, w, b, None, None, True, 0.1, 1e-5
        ),
        "torch._native_batch_norm_legit": lambda a, w, b: torch._native_batch_norm_legit(
            a, w, b, True, 0.1, 1e-3
        ),
    }.items():
        check_against_reference(
            call,
            [x, w, b],
            [case.layout, None, None],
            get_mesh(case.mesh),
            out_layouts=[None, statistics, statistics],
            rtol=0,
            what=f"{case}/{what}",
        )
    (mean, var), (sharded_mean, sharded_var) = running
    assert_all_ranks(
        torch.allclose(sharded_mean, mean, rtol=0, atol=1e-12)
        and torch.allclose(sharded_var, var, rtol=0, atol=1e-12),
        f"{case}: running statistics {sharded_mean}, {sharded_var}; one process {mean}, {var}",
    )


@pytest.mark.parametrize(
    "case, statistics",
    [
        (SPATIAL[1], Layout((Replicate(),), {})),
        (SPATIAL[3], Layout((Replicate(), Replicate()), {})),
        (BATCH[1], Layout((Replicate(),), {})),
        (CHANNELS[1], Layout((Shard(0),), {0: (2, 0, 2, 0)})),
        (CHANNELS[2], Layout((Shard(0), Replicate()), {0: (3, 1)})),
    ],
    ids=str,
)
def test_native_batch_norm(case: Sharded, statistics: Layout) -> None:
    run_on_ranks(case.world, _native_batch_norm_body, case, statistics)


def _running_stats_functional_body() -> None:
    """``F.batch_norm`` / ``F.instance_norm`` update given running statistics in place, with the
    given momentum, and use them when not training."""
    case = SPATIAL[1]
    torch.manual_seed(0)
    x = torch.randn(case.shape, dtype=F64)
    mean, var = torch.randn(4, dtype=F64), torch.rand(4, dtype=F64) + 0.5
    for what, call in {
        "batch_norm": lambda a, m, v: F.batch_norm(a, m, v, training=True, momentum=0.25),
        "instance_norm": lambda a, m, v: F.instance_norm(a, m, v, momentum=0.7),
        "batch_norm eval": lambda a, m, v: F.batch_norm(a, m, v, training=False),
        "instance_norm eval": lambda a, m, v: F.instance_norm(a, m, v, use_input_stats=False),
    }.items():
        expected_mean, expected_var = mean.clone(), var.clone()
        expected = call(x, expected_mean, expected_var)
        got_mean, got_var = mean.clone(), var.clone()
        got = call(_sharded(x, case), got_mean, got_var).full_tensor()
        assert_close_all_ranks(got, expected, atol=1e-10, rtol=0, what=what)
        assert_close_all_ranks(got_mean, expected_mean, atol=1e-10, rtol=0, what=what)
        assert_close_all_ranks(got_var, expected_var, atol=1e-10, rtol=0, what=what)


def test_functional_running_stats() -> None:
    run_on_ranks(4, _running_stats_functional_body)


# ---------------------------------------------------------------------------- communication
def _collectives_body(affine: bool) -> None:
    """Forward: one all-gather of the statistics. Backward: one all-reduce for the input
    gradient, and one (over both mesh axes) for each affine parameter."""
    case = SPATIAL[3]
    torch.manual_seed(0)
    module = nn.GroupNorm(2, 4, affine=affine, dtype=F64)
    x = _sharded(torch.randn(case.shape, dtype=F64), case).requires_grad_()
    with counted_comm("forward") as forward:
        y = module(x).to_local()
    with counted_comm("backward") as backward:
        (y * torch.randn_like(y)).sum().backward()
    expected_backward = {"all_reduce": 1 + (2 if affine else 0)}
    assert_all_ranks(dict(forward.calls) == {"all_gather": 1}, f"forward: {dict(forward.calls)}")
    assert_all_ranks(dict(backward.calls) == expected_backward, f"backward: {dict(backward.calls)}")


@pytest.mark.parametrize("affine", [False, True])
def test_collectives_per_call(affine: bool) -> None:
    run_on_ranks(4, _collectives_body, affine)


# ---------------------------------------------------------------------------- bad input
SINGLE = Sharded("4r-H-1/0/0/0", (4,), (1, 4, 1, 1), Layout((Shard(2),), {2: (1, 0, 0, 0)}))


def _bad_input_body() -> None:
    case = SPATIAL[1]
    x = _sharded(torch.randn(case.shape, dtype=F64), case)
    assert_raises_all_ranks(RuntimeError, "num_groups=3", F.group_norm, x, 3)
    assert_raises_all_ranks(RuntimeError, "normalized_shape", F.layer_norm, x, (5, 6))
    assert_raises_all_ranks(
        RuntimeError, r"weight has shape \(3,\)", F.group_norm, x, 2, torch.ones(3, dtype=F64)
    )
    single = _sharded(torch.randn(1, 4, 1, 1, dtype=F64), SINGLE)
    assert_raises_all_ranks(
        ValueError, "more than 1 value", F.batch_norm, single, None, None, training=True
    )
    assert_raises_all_ranks(
        ValueError, "eps must be positive", F.batch_norm, x, None, None, training=True, eps=0.0
    )
    assert_raises_all_ranks(RuntimeError, "evaluation mode", F.batch_norm, x, None, None)
    assert_raises_all_ranks(
        RuntimeError, "use_input_stats is false", F.instance_norm, x, use_input_stats=False
    )


def test_bad_input_raises_on_every_rank() -> None:
    run_on_ranks(4, _bad_input_body)
