"""``F.interpolate`` (and ``nn.Upsample``) on spatially sharded tensors against the
single-process reference: forward and input gradients, float64, every mode with ``size`` and
``scale_factor`` (up, down, non-integer), ``align_corners`` and ``recompute_scale_factor``,
uneven and empty shards, 1-D meshes, 2x2 block decompositions in 2-D and 3-D, and the layout
of a downsample followed by an upsample."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

from shardsci.tensor._api import from_local_spec
from shardsci.tensor._ops._interpolate_ops import resample
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    assert_close_all_ranks,
    assert_raises_all_ranks,
    check_against_reference,
    get_mesh,
    run_on_ranks,
)
from tests.expected_layouts import ExpectedLayout, interpolation_anchors, windowed
from tests.layouts import SPATIAL_2D, Sharded

# Keyword sets for F.interpolate: up and down, integer and not, explicit sizes, each way the
# scale reaches the kernel (given, or recomputed from the output size).
RESIZES = {
    "x2": dict(scale_factor=2),
    "x0.5": dict(scale_factor=0.5),
    "x1.5-recompute": dict(scale_factor=1.5, recompute_scale_factor=True),
    "x0.7-given": dict(scale_factor=0.7, recompute_scale_factor=False),
    "x(2.5,0.6)": dict(scale_factor=(2.5, 0.6)),
    "x1": dict(scale_factor=1.0),
    "size(17,4)": dict(size=(17, 4)),
    "size(3,13)": dict(size=(3, 13)),
}
MODES_2D = {
    "nearest": [{}],
    "nearest-exact": [{}],
    "area": [{}],
    "bilinear": [dict(align_corners=False), dict(align_corners=True)],
    "bicubic": [dict(align_corners=False), dict(align_corners=True)],
}


def _centred(case: Sharded, call, mode: str) -> ExpectedLayout:
    """Each output cell on the rank holding the input cell it is centred on (NOTE [Which rank
    owns an output of a windowed op])."""
    spatial = range(2, len(case.shape))
    anchors = interpolation_anchors(case.shape, spatial, call, area=mode == "area")
    return windowed(case.layout, case.shape, case.mesh, anchors)


def _interpolate_body(case: Sharded, mode: str, resizes: dict, variants: list) -> None:
    x = torch.randn(case.shape, dtype=torch.float64)
    mesh = get_mesh(case.mesh)
    for name, resize in resizes.items():
        for variant in variants:
            kw = {**resize, **variant}
            # Bicubic weights do not reproduce a ramp; they share bilinear's source coordinate.
            linear = {"bicubic": "bilinear"}.get(mode, mode)
            expected = _centred(
                case, lambda a, kw=kw, m=linear: F.interpolate(a, mode=m, **kw), mode
            )
            check_against_reference(
                lambda a, kw=kw: F.interpolate(a, mode=mode, **kw),
                [x],
                [case.layout],
                mesh,
                out_layouts=[expected],
                what=f"{case} {mode} {name} {variant}",
            )


@pytest.mark.parametrize("case", SPATIAL_2D, ids=str)
@pytest.mark.parametrize("mode", list(MODES_2D))
def test_interpolate_2d(case: Sharded, mode: str) -> None:
    run_on_ranks(case.world, _interpolate_body, case, mode, RESIZES, MODES_2D[mode])


RESIZES_1D = {
    "x2": dict(scale_factor=2),
    "x0.5": dict(scale_factor=0.5),
    "x1.5": dict(scale_factor=1.5),
    "x0.7-given": dict(scale_factor=0.7, recompute_scale_factor=False),
    "x3.3-recompute": dict(scale_factor=3.3, recompute_scale_factor=True),
    "size5": dict(size=5),
    "size1": dict(size=1),
    "size20": dict(size=20),
}
LAYOUTS_1D = [
    Sharded("2r-5/4", (2,), (2, 2, 9), Layout((Shard(2),), {2: (5, 4)})),
    Sharded("4r-2/0/6/1", (4,), (2, 2, 9), Layout((Shard(2),), {2: (2, 0, 6, 1)})),
]


@pytest.mark.parametrize("case", LAYOUTS_1D, ids=str)
@pytest.mark.parametrize(
    "mode, variants",
    [
        ("linear", [dict(align_corners=False), dict(align_corners=True)]),
        ("nearest", [{}]),
        ("area", [{}]),
    ],
    ids=["linear", "nearest", "area"],
)
def test_interpolate_1d(case: Sharded, mode: str, variants: list) -> None:
    run_on_ranks(case.world, _interpolate_body, case, mode, RESIZES_1D, variants)


BLOCK_3D = Sharded(
    "2x2-block-3d", (2, 2), (1, 2, 5, 6, 4), Layout((Shard(2), Shard(3)), {2: (3, 2), 3: (2, 4)})
)
RESIZES_3D = {
    "x2": dict(scale_factor=2),
    "x(1.5,0.5,2)": dict(scale_factor=(1.5, 0.5, 2.0)),
    "x0.7-given": dict(scale_factor=0.7, recompute_scale_factor=False),
    "size(3,11,5)": dict(size=(3, 11, 5)),
}


@pytest.mark.parametrize(
    "mode, variants",
    [
        ("trilinear", [dict(align_corners=False), dict(align_corners=True)]),
        ("nearest", [{}]),
        ("area", [{}]),
    ],
    ids=["trilinear", "nearest", "area"],
)
def test_interpolate_3d_block(mode: str, variants: list) -> None:
    run_on_ranks(BLOCK_3D.world, _interpolate_body, BLOCK_3D, mode, RESIZES_3D, variants)


def test_channel_sharded() -> None:
    case = Sharded("4r-C-2/0/3/1", (4,), (1, 6, 5, 4), Layout((Shard(1),), {1: (2, 0, 3, 1)}))
    resizes = {"x1.5": dict(scale_factor=1.5), "size(3,7)": dict(size=(3, 7))}
    run_on_ranks(4, _interpolate_body, case, "bicubic", resizes, [dict(align_corners=False)])


# ---------------------------------------------------------------------------- taps
TAPS = [
    (1, "nearest"),
    (1, "nearest-exact"),
    (1, "linear"),
    (1, "area"),
    (2, "nearest"),
    (2, "nearest-exact"),
    (2, "bilinear"),
    (2, "bicubic"),
    (3, "nearest"),
    (3, "trilinear"),
]


@pytest.mark.parametrize("spatial, mode", TAPS, ids=[f"{n}d-{m}" for n, m in TAPS])
def test_taps_match_torch(spatial: int, mode: str) -> None:
    """The taps of the last dim, as a matrix, against torch's forward on the identity (the
    other spatial dims of size 1), for many sizes and scales, in one process."""
    corners = [None] if mode in ("nearest", "nearest-exact", "area") else [False, True]
    ones = (1,) * (spatial - 1)
    sizes = [((*ones, s), None, None) for s in (1, 2, 3, 7, 16)]
    factors = [
        (None, (*map(float, ones), f), r)
        for f in (0.3, 0.5, 0.7, 1.05, 1.5, 2.0, 2.01, 2.7, 3.0)
        for r in (None, True)
    ]
    for n_in, align_corners, (size, factor, recompute) in itertools.product(
        (1, 2, 3, 5, 8, 13), corners, sizes + factors
    ):
        x = torch.eye(n_in, dtype=torch.float64).reshape(1, n_in, *ones, n_in)
        try:
            y = F.interpolate(
                x, size, factor, mode, align_corners, recompute_scale_factor=recompute
            )
        except RuntimeError:  # an empty output
            continue
        scale = None if recompute or mode == "area" or factor is None else factor[-1]
        taps = resample(mode, n_in, y.shape[-1], scale, bool(align_corners), torch.float64, spatial)
        weight = taps.weight if taps.weight is not None else torch.ones(taps.index.shape)
        got = torch.zeros(y.shape[-1], n_in, dtype=torch.float64)
        got.scatter_add_(1, taps.index, weight.double())
        what = (n_in, size, factor, recompute, align_corners)
        assert torch.allclose(got, y.reshape(n_in, -1).T, rtol=0, atol=1e-12), what


def _adjoint_body(case: Sharded, mode: str, resize: dict) -> None:
    """Forward against torch; gradient against the adjoint of torch's forward (from
    forward-mode AD, which reuses the forward kernel), not torch's backward kernel."""
    x = torch.randn(case.shape, dtype=torch.float64)
    mesh = get_mesh(case.mesh)

    def fn(a: torch.Tensor) -> torch.Tensor:
        return F.interpolate(a, mode=mode, **resize)

    def centre(a: torch.Tensor) -> torch.Tensor:
        return F.interpolate(a, mode={"bicubic": "bilinear"}.get(mode, mode), **resize)

    (out,) = check_against_reference(
        fn,
        [x],
        [case.layout],
        mesh,
        out_layouts=[_centred(case, centre, mode)],
        grad=False,
        what=mode,
    )
    projection = torch.randn(out.shape, dtype=torch.float64)
    expected = torch.tensordot(projection, torch.func.jacfwd(fn)(x), dims=x.ndim)
    spec = case.layout.spec(mesh, x)
    leaf = spec.narrow(x).clone().requires_grad_(True)
    out = fn(from_local_spec(leaf, spec))
    (out * from_local_spec(out._spec.narrow(projection), out._spec)).sum().full_tensor().backward()
    assert_close_all_ranks(leaf.grad, spec.narrow(expected), atol=1e-10, rtol=1e-10, what=mode)


ADJOINT = {
    "bicubic-x1.05": (SPATIAL_2D[0], "bicubic", dict(scale_factor=1.05, align_corners=False)),
    "nearest-1d-x1.05": (LAYOUTS_1D[0], "nearest", dict(scale_factor=1.05)),
    "nearest-3d-x(1.05,2.01,0.7)": (
        BLOCK_3D,
        "nearest",
        dict(scale_factor=(1.05, 2.01, 0.7), recompute_scale_factor=False),
    ),
}


@pytest.mark.parametrize("name", list(ADJOINT))
def test_gradient_is_the_adjoint_of_the_forward(name: str) -> None:
    """Where an output has its input's size but the scale factor is not 1 (or twice it, at
    another factor than 2), torch's CPU backward kernels take a shortcut its forward kernels
    do not: its gradient is not the adjoint of its forward. Ours is."""
    case, mode, resize = ADJOINT[name]
    run_on_ranks(case.world, _adjoint_body, case, mode, resize)


# ---------------------------------------------------------------------------- layouts
def _round_trip_body(case: Sharded, mode: str) -> None:
    """A stride-2 convolution, then ``nn.Upsample(scale_factor=2)``: the output has the
    input's shard sizes even though the shard boundaries are odd."""
    torch.manual_seed(0)
    channels = case.shape[1]
    module = nn.Sequential(
        nn.Conv2d(channels, channels, kernel_size=2, stride=2, dtype=torch.float64),
        nn.Upsample(scale_factor=2, mode=mode),
    )
    x = torch.randn(case.shape, dtype=torch.float64)
    (out,) = check_against_reference(
        lambda m, a: m(a), [x], [case.layout], get_mesh(case.mesh), module=module, what=mode
    )
    expected = {d: tuple(s) for d, s in case.layout.sizes.items()}
    got = {s.dim: s.sizes for s in out._spec.shardings}
    assert_all_ranks(got == expected, f"{mode}: output shard sizes {got}, expected {expected}")


ODD_LAYOUTS = [
    Sharded("2r-H-5/7", (2,), (1, 2, 12, 6), Layout((Shard(2),), {2: (5, 7)})),
    Sharded("4r-H-3/0/5/4", (4,), (1, 2, 12, 6), Layout((Shard(2),), {2: (3, 0, 5, 4)})),
    Sharded(
        "2x2-block-odd",
        (2, 2),
        (1, 2, 10, 14),
        Layout((Shard(2), Shard(3)), {2: (3, 7), 3: (5, 9)}),
    ),
]


@pytest.mark.parametrize("case", ODD_LAYOUTS, ids=str)
@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
def test_downsample_upsample_keeps_layout(case: Sharded, mode: str) -> None:
    run_on_ranks(case.world, _round_trip_body, case, mode)


# ---------------------------------------------------------------------------- errors
def _errors_body() -> None:
    case = SPATIAL_2D[1]
    x = torch.randn(case.shape, dtype=torch.float64)
    spec = case.layout.spec(get_mesh(case.mesh), x)
    sharded = from_local_spec(spec.narrow(x), spec)
    assert_raises_all_ranks(
        NotImplementedError,
        "antialias",
        F.interpolate,
        sharded,
        scale_factor=0.5,
        mode="bilinear",
        antialias=True,
    )
    assert_raises_all_ranks(
        ValueError, "only one of size or scale_factor", F.interpolate, sharded, 4, 2.0
    )
    assert_raises_all_ranks(
        NotImplementedError, "needs 5D input", F.interpolate, sharded, scale_factor=2,
        mode="trilinear",
    )  # fmt: skip


def test_bad_arguments_raise_on_every_rank() -> None:
    run_on_ranks(4, _errors_body)


def _empty_batch_body() -> None:
    """A rank group whose batch is empty (more data-parallel ranks than samples) still runs."""
    mesh = get_mesh((2,))
    x = torch.empty(0, 1, 6, 4, dtype=torch.float64)
    layout = Layout((Shard(2),), {2: (4, 2)})
    check_against_reference(
        lambda a: F.interpolate(a, scale_factor=2, mode="nearest"),
        [x],
        [layout],
        mesh,
        out_layouts=[Layout(layout.placements, {2: (8, 4)})],
    )


def test_empty_batch() -> None:
    run_on_ranks(2, _empty_batch_body)
