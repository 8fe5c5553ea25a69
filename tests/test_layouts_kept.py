"""Outputs keep their input's layout (NOTE [Outputs keep their input's layout] and NOTE
[Which rank owns an output of a windowed op] in ``shardsci/tensor/_ops/_windows.py``): each
op or module fixed for it, against one process in float64, forward and gradients, on an
uneven 1-D split, one with an empty shard and an uneven 2x2 block decomposition, with the
output's placements and shard sizes stated.

The configurations of a layout run in one rank call (``what`` names the failing one).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

from shardsci.tensor._api import from_local_spec
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    assert_raises_all_ranks,
    check_against_reference,
    count_traffic,
    get_mesh,
    run_on_ranks,
)
from tests.expected_layouts import (
    ExpectedLayout,
    module_anchors,
    pad_anchors,
    window_anchor,
    windowed,
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


# ---------------------------------------------------------------------------- pixel shuffle
def _shuffled(case: Sharded, r: int) -> Callable[[tuple[int, ...]], Layout]:
    """Pixel shuffle by ``r``: output row ``i`` from input row ``i // r``; output channel ``c``
    from input channels ``[c r^2, (c + 1) r^2)`` (anchored at the middle one)."""
    n = len(case.shape)
    spatial = lambda j: j // r  # noqa: E731
    return windowed(
        case.layout,
        case.shape,
        case.mesh,
        {n - 3: lambda c: c * r * r + (r * r - 1) // 2, n - 2: spatial, n - 1: spatial},
    )


def _unshuffled(case: Sharded, r: int) -> Callable[[tuple[int, ...]], Layout]:
    """Pixel unshuffle by ``r``: output row ``j`` reads input rows ``[j r, (j + 1) r)`` and is
    anchored at ``j r + (r - 1) // 2``; output channel ``c`` from input channel ``c // r^2``."""
    n = len(case.shape)
    spatial = lambda j: j * r + (r - 1) // 2  # noqa: E731
    return windowed(
        case.layout,
        case.shape,
        case.mesh,
        {n - 3: lambda c: c // (r * r), n - 2: spatial, n - 1: spatial},
    )


def espcn() -> nn.Module:
    """An ESPCN-style super-resolution head (Shi et al. 2016): convolutions, then a sub-pixel
    shuffle by 2."""
    return nn.Sequential(
        nn.Conv2d(4, 8, 3, padding=1), nn.Tanh(), nn.Conv2d(8, 4, 3, padding=1), nn.PixelShuffle(2)
    ).double()


def _pixel_shuffle_body(case: Sharded) -> None:
    mesh = get_mesh(case.mesh)
    x = torch.randn(case.shape, dtype=torch.float64)
    runs: dict[str, tuple[Callable, nn.Module | None, ExpectedLayout]] = {
        "espcn": (lambda m, a: m(a), espcn(), _shuffled(case, 2)),
        "shuffle-2": (lambda a: F.pixel_shuffle(a, 2), None, _shuffled(case, 2)),
        "unshuffle-2": (lambda a: F.pixel_unshuffle(a, 2), None, _unshuffled(case, 2)),
        "unshuffle-then-shuffle": (
            lambda a: F.pixel_shuffle(F.pixel_unshuffle(a, 2), 2),
            None,
            None,  # back to the input's layout: the unshuffle's input is remembered
        ),
    }
    for name, (fn, module, expected) in runs.items():
        check_against_reference(
            fn, [x], [case.layout], mesh, module=module, out_layouts=[expected], what=name
        )


@pytest.mark.parametrize("case", FIELDS, ids=str)
def test_pixel_shuffle_keeps_placements(case: Sharded) -> None:
    """Pixel (un)shuffle with H or W sharded keeps the input's placements, sizes by the
    window rule (it returned a Replicate output, gathered on every rank)."""
    run_on_ranks(case.world, _pixel_shuffle_body, case)


CHANNELS = Sharded(
    "2x2-C-1/2xW", (2, 2), (2, 3, 6, 6), Layout((Shard(1), Shard(3)), {1: (1, 2), 3: (5, 1)})
)
SHUFFLE_3 = Sharded("2r-C-9/9", (2,), (1, 18, 3, 2), Layout((Shard(1),), {1: (4, 14)}))


def _channels_body(case: Sharded, op: str, r: int) -> None:
    mesh = get_mesh(case.mesh)
    x = torch.randn(case.shape, dtype=torch.float64)
    fn = F.pixel_shuffle if op == "shuffle" else F.pixel_unshuffle
    expected = (_shuffled if op == "shuffle" else _unshuffled)(case, r)
    check_against_reference(lambda a: fn(a, r), [x], [case.layout], mesh, out_layouts=[expected])


@pytest.mark.parametrize(
    ("case", "op", "r"), [(CHANNELS, "unshuffle", 2), (SHUFFLE_3, "shuffle", 3)], ids=str
)
def test_pixel_shuffle_with_sharded_channels(case: Sharded, op: str, r: int) -> None:
    """Channels are a window too: unshuffle spreads each channel over ``r^2``; shuffle
    realigns channel boundaries that are not multiples of ``r^2``."""
    run_on_ranks(case.world, _channels_body, case, op, r)


def _realignment_body() -> None:
    mesh = get_mesh((2,))
    x = torch.randn(1, 2, 10, 4, dtype=torch.float64)
    spec = Layout((Shard(2),), {2: (5, 5)}).spec(mesh, x)
    sharded = from_local_spec(spec.narrow(x), spec)
    with count_traffic() as traffic:
        out = F.pixel_unshuffle(sharded, 2)
    # Output row 2 reads input rows 4 and 5 and belongs to rank 0 (its anchor, row 4): rank 0
    # receives input row 5 (2 channels x 4 cells), rank 1 nothing, and nothing else moves.
    expected = [2 * 4 * 8, 0][mesh.get_coordinate()[0]]
    assert_all_ranks(
        traffic.received == expected,
        f"received {traffic.received} bytes, the rows lacked are {expected}",
    )
    assert_all_ranks(out._spec.shardings[0].sizes == (3, 2), f"layout {out._spec}")


def test_unshuffle_realigns_at_the_byte_bound() -> None:
    """Shard boundaries that are not multiples of the factor move only the rows a rank lacks,
    not a gather."""
    run_on_ranks(2, _realignment_body)


# ---------------------------------------------------------------------------- unfold
def _unfold_body(case: Sharded) -> None:
    mesh = get_mesh(case.mesh)
    x = torch.randn(case.shape, dtype=torch.float64)
    n = len(case.shape)
    for dim in (n - 2, n - 1):
        for size, step in ((3, 1), (2, 2), (4, 3)):
            # output window j reads input [j step, j step + size), anchored at its middle
            expected = windowed(
                case.layout, case.shape, case.mesh, {dim: window_anchor(size, step, 0, 1)}
            )
            for name, fn in (
                ("Tensor.unfold", lambda a, d=dim, k=size, s=step: a.unfold(d, k, s)),
                (
                    "torch.unfold_copy",
                    lambda a, d=dim, k=size, s=step: torch.unfold_copy(a, d, k, s),
                ),
            ):
                check_against_reference(
                    fn, [x], [case.layout], mesh, out_layouts=[expected],
                    what=f"{name}(dim={dim}, size={size}, step={step})",
                )  # fmt: skip


@pytest.mark.parametrize("case", FIELDS, ids=str)
def test_unfold_keeps_placements(case: Sharded) -> None:
    """Windows along a sharded dim (``Tensor.unfold`` and ``torch.unfold_copy``) stay sharded
    by the window rule (``unfold_copy`` gathered the whole field)."""
    run_on_ranks(case.world, _unfold_body, case)


def _unfold_halo_body() -> None:
    mesh = get_mesh((2,))
    x = torch.randn(1, 2, 10, 4, dtype=torch.float64)
    spec = Layout((Shard(2),), {2: (5, 5)}).spec(mesh, x)
    sharded = from_local_spec(spec.narrow(x), spec)
    with count_traffic() as traffic:
        out = torch.unfold_copy(sharded, 2, 3, 1)
    # Windows 0-3 (anchors 1-4) are rank 0's and reach row 5; windows 4-7 (anchors 5-8) are
    # rank 1's and reach row 4: each rank receives one row (2 channels x 4 cells x 8 bytes).
    assert_all_ranks(traffic.received == 2 * 4 * 8, f"received {traffic.received} bytes, not 64")
    assert_all_ranks(out._spec.shardings[0].sizes == (4, 4), f"layout {out._spec}")


def test_unfold_receives_only_the_halo() -> None:
    run_on_ranks(2, _unfold_halo_body)


# ---------------------------------------------------------------------------- integer pooling
def _integer_pool_body(case: Sharded) -> None:
    from tests.test_pool_ops import AVG_POOL, MAX_POOL

    mesh = get_mesh(case.mesh)
    x = torch.randint(-50, 50, case.shape)
    runs = [
        *((f"max-{name}-int32", nn.MaxPool2d(**c), torch.int32) for name, c in MAX_POOL.items()),
        *((f"avg-{name}-int64", nn.AvgPool2d(**c), torch.int64) for name, c in AVG_POOL.items()),
    ]
    for name, module, dtype in runs:
        anchors = module_anchors(module, x.ndim)
        layout = windowed(case.layout, case.shape, case.mesh, anchors)
        check_against_reference(
            lambda a, m=module: m(a),
            [x.to(dtype)],
            [case.layout],
            mesh,
            out_layouts=[layout] * (2 if getattr(module, "return_indices", False) else 1),
            what=name,
        )


@pytest.mark.parametrize("case", FIELDS, ids=str)
def test_integer_pooling_keeps_placements(case: Sharded) -> None:
    """Max and average pooling of integer fields (a label map) are windowed like floating
    ones (they returned Replicate outputs); averages truncate as torch's do."""
    run_on_ranks(case.world, _integer_pool_body, case)


def _integer_pool_1d_body() -> None:
    mesh = get_mesh((2,))
    x = torch.randint(-50, 50, (2, 3, 9))
    layout = Layout((Shard(2),), {2: (7, 2)})
    module = nn.MaxPool1d(3, stride=2, padding=1, return_indices=True)
    expected = windowed(layout, x.shape, (2,), module_anchors(module, x.ndim))
    check_against_reference(module, [x], [layout], mesh, out_layouts=[expected] * 2)
    spec = layout.spec(mesh, x)
    sharded = from_local_spec(spec.narrow(x), spec)
    assert_raises_all_ranks(NotImplementedError, "max_pool1d", F.max_pool1d, sharded, 2)


def test_integer_1d_max_pooling_as_torch() -> None:
    """torch max-pools integers in 1-d only when it returns indices: that call keeps its
    layout, the other raises torch's error on every rank (not a result, nor on some ranks)."""
    run_on_ranks(2, _integer_pool_1d_body)


# ---------------------------------------------------------------------------- cropping pads
CROPS = {  # name: (pad, mode, value)
    "crop": ((-1, -2, -3, -1), "constant", 0.0),
    "crop-and-pad": ((2, -1, -2, 3), "constant", 0.5),
    "crop-one-side": ((-1, 0, 0, -2), "constant", 0.0),
    "replicate crop-and-pad": ((2, -1, -2, 3), "replicate", None),
    "replicate crop": ((-1, -2, 0, -1), "replicate", None),
}


def _crop_body(case: Sharded) -> None:
    mesh = get_mesh(case.mesh)
    x = torch.randn(case.shape, dtype=torch.float64)
    for name, (pad, mode, value) in CROPS.items():
        check_against_reference(
            lambda a, p=pad, m=mode, v=value: F.pad(a, p, mode=m, value=v),
            [x],
            [case.layout],
            mesh,
            out_layouts=[windowed(case.layout, case.shape, case.mesh, pad_anchors(pad, x.ndim))],
            what=name,
        )
    sharded = case.layout.spec(mesh, x)
    sharded = from_local_spec(sharded.narrow(x), sharded)
    for pad in [(1, 2, 3), (-4, -3)]:
        assert_raises_all_ranks(RuntimeError, "Padding length|negative", F.pad, sharded, pad)


@pytest.mark.parametrize("case", FIELDS, ids=str)
def test_cropping_pad_keeps_placements(case: Sharded) -> None:
    """A constant or replicate pad with negative amounts crops like a slice, each output cell
    on the rank holding the input cell it copies (both went to the default path, which
    replicated the output of a replicate one); a pad list torch refuses
    raises torch's error on every rank (an odd-length one returned a result)."""
    run_on_ranks(case.world, _crop_body, case)
