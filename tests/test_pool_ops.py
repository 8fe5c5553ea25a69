"""Max, average and adaptive pooling on spatially sharded tensors against the single-process
reference: forward values, global argmax indices and input gradients, float64, uneven and
empty shards, 1-D meshes of 2 and 4 ranks, 2x2 block decompositions in 2-D and 3-D.

The configurations of a family run in one rank call per layout (``what`` names the failing
one), to keep the file fast.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

from shardsci.tensor import distribute_tensor, gather_policy
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    assert_raises_all_ranks,
    check_against_reference,
    get_mesh,
    run_on_ranks,
)
from tests.expected_layouts import (
    ExpectedLayout,
    module_anchors,
    pad_anchors,
    renamed,
    window_anchor,
    windowed,
)
from tests.layouts import SPATIAL_2D, Sharded

LAYOUT_3D = Sharded(
    "2x2-block-3d", (2, 2), (1, 2, 7, 6, 5), Layout((Shard(2), Shard(3)), {2: (4, 3), 3: (2, 4)})
)
LAYOUTS_1D = [
    Sharded("2r-L-5/4", (2,), (2, 2, 9), Layout((Shard(2),), {2: (5, 4)})),
    Sharded("4r-L-2/0/6/1", (4,), (2, 2, 9), Layout((Shard(2),), {2: (2, 0, 6, 1)})),
]

# Configuration name -> keyword arguments of nn.MaxPoolNd / nn.AvgPoolNd.
MAX_POOL = {
    "k2": dict(kernel_size=2),
    "k3-s1-p1": dict(kernel_size=3, stride=1, padding=1),
    "k3-s2-p1-ceil": dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),
    "k2-s3-ceil": dict(kernel_size=2, stride=3, ceil_mode=True),
    "k3-s3": dict(kernel_size=3, stride=3),
    "k3-d2-p1": dict(kernel_size=3, padding=1, dilation=2),
    "k2-d2-s2-p1-ceil": dict(kernel_size=2, stride=2, padding=1, dilation=2, ceil_mode=True),
    "k2-ceil": dict(kernel_size=2, ceil_mode=True),
    "k3-s2-ceil": dict(kernel_size=3, stride=2, ceil_mode=True),
    "k2-indices": dict(kernel_size=2, return_indices=True),
    "k2-ceil-indices": dict(kernel_size=2, ceil_mode=True, return_indices=True),
    "k3-s2-p1-ceil-indices": dict(
        kernel_size=3, stride=2, padding=1, ceil_mode=True, return_indices=True
    ),
    "k3-d2-s1-p1-indices": dict(kernel_size=3, padding=1, dilation=2, return_indices=True),
}
AVG_POOL = {
    "k2": dict(kernel_size=2),
    "k3-s1-p1": dict(kernel_size=3, stride=1, padding=1),
    "k3-s1-p1-exclude": dict(kernel_size=3, stride=1, padding=1, count_include_pad=False),
    "k3-s2-p1-ceil": dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),
    "k3-s2-p1-ceil-exclude": dict(
        kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False
    ),
    "k2-s3-ceil": dict(kernel_size=2, stride=3, ceil_mode=True),
    "k2-ceil": dict(kernel_size=2, ceil_mode=True),
    "k3-s2-ceil-exclude": dict(kernel_size=3, stride=2, ceil_mode=True, count_include_pad=False),
    "k3-s3-p1-ceil-exclude": dict(
        kernel_size=3, stride=3, padding=1, ceil_mode=True, count_include_pad=False
    ),
    "k3-s2-p1-divisor": dict(kernel_size=3, stride=2, padding=1, divisor_override=2),
    "k2-s2-p1-ceil-divisor": dict(
        kernel_size=2, stride=2, padding=1, ceil_mode=True, divisor_override=3
    ),
}
# Family -> (its 1-D, 2-D and 3-D modules, its configurations).
POOLS = {
    "max": (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, MAX_POOL),
    "avg": (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, AVG_POOL),
}


def _pool_body(case: Sharded, kind: str) -> None:
    *classes, configs = POOLS[kind]
    n = len(case.shape) - 2
    mesh = get_mesh(case.mesh)
    x = torch.randn(case.shape, dtype=torch.float64)
    for name, config in configs.items():
        if n == 1 and "divisor_override" in config:
            continue  # AvgPool1d has no divisor_override
        module = classes[n - 1](**config)
        check_against_reference(
            lambda a, m=module: m(a),
            [x],
            [case.layout],
            mesh,
            out_layouts=_pooled(case, module_anchors(module, x.ndim), module),
            what=name,
        )


def _pooled(case: Sharded, anchors: dict, module: object = None) -> list[ExpectedLayout]:
    """Each output (and index) cell on the rank holding its window's centre (NOTE [Which rank
    owns an output of a windowed op])."""
    layout = windowed(case.layout, case.shape, case.mesh, anchors)
    return [layout] * (2 if getattr(module, "return_indices", False) else 1)


@pytest.mark.parametrize("kind", list(POOLS))
@pytest.mark.parametrize("case", [*LAYOUTS_1D, *SPATIAL_2D, LAYOUT_3D], ids=str)
def test_pool(case: Sharded, kind: str) -> None:
    run_on_ranks(case.world, _pool_body, case, kind)


# ---------------------------------------------------------------------------- function spellings
# Name -> (call, its window along H (kernel, stride, padding, dilation), number of outputs).
FUNCTIONS = {
    "F.max_pool2d": (lambda a: F.max_pool2d(a, 3, 2, 1, 1, True), (3, 2, 1, 1), 1),
    "F.max_pool2d-indices": (lambda a: F.max_pool2d(a, 3, 2, 1, 1, True, True), (3, 2, 1, 1), 2),
    "F.max_pool2d_with_indices": (
        lambda a: F.max_pool2d_with_indices(a, (3, 2), padding=(1, 0)),
        (3, 3, 1, 1),
        2,
    ),
    "torch.max_pool2d": (lambda a: torch.max_pool2d(a, 3, [], 1, 1, True), (3, 3, 1, 1), 1),
    "F.avg_pool2d": (lambda a: F.avg_pool2d(a, 3, 2, 1, True, False), (3, 2, 1, 1), 1),
    "F.adaptive_avg_pool2d": (lambda a: F.adaptive_avg_pool2d(a, (1, 3)), (11, 11, 0, 1), 1),
    "F.adaptive_max_pool2d-indices": (
        lambda a: F.adaptive_max_pool2d(a, (1, None), True),
        (11, 11, 0, 1),
        2,
    ),
}


def _functions_body(case: Sharded) -> None:
    """``case`` is sharded along H (dim 2) only."""
    x = torch.randn(case.shape, dtype=torch.float64)
    mesh = get_mesh(case.mesh)
    for name, (fn, window, outputs) in FUNCTIONS.items():
        layout = windowed(case.layout, case.shape, case.mesh, {2: window_anchor(*window)})
        check_against_reference(
            fn, [x], [case.layout], mesh, out_layouts=[layout] * outputs, what=name
        )
    # Unbatched: H is dim 1 of the input the pool sees.
    unbatched = renamed(case.layout, case.shape, case.mesh, {2: 1})
    layout = windowed(unbatched, case.shape[1:], case.mesh, {1: window_anchor(3, 2, 1, 1)})
    check_against_reference(
        lambda a: F.max_pool2d(a[0], 3, 2, 1, return_indices=True),
        [x],
        [case.layout],
        mesh,
        out_layouts=[layout] * 2,
        what="unbatched",
    )


def test_function_spellings() -> None:
    run_on_ranks(2, _functions_body, SPATIAL_2D[0])


def _all_inf_windows_body(case: Sharded) -> None:
    """Windows whose input cells are all -inf: torch's argmax (and gradient) is the window's
    first cell inside the input, never a padding cell."""
    x = torch.randn(case.shape, dtype=torch.float64)
    x[..., :3, :] = float("-inf")
    x[..., :, -3:] = float("-inf")
    for name, config in {
        "k3-s2-p1-ceil": dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),
        "k2-d2-s1-p1": dict(kernel_size=2, stride=1, padding=1, dilation=2),
    }.items():
        for pool in (nn.MaxPool2d(**config), nn.MaxPool2d(**config, return_indices=True)):
            check_against_reference(
                pool,
                [x],
                [case.layout],
                get_mesh(case.mesh),
                out_layouts=_pooled(case, module_anchors(pool, x.ndim), pool),
                what=name,
            )


@pytest.mark.parametrize("case", [SPATIAL_2D[1], SPATIAL_2D[3]], ids=str)
def test_max_pool_all_inf_windows(case: Sharded) -> None:
    run_on_ranks(case.world, _all_inf_windows_body, case)


# ---------------------------------------------------------------------------- adaptive
# Extents of the sharded dims divisible by the output sizes; unsharded pooled dims need not be.
ADAPTIVE = [
    (Sharded("2r-H-7/5", (2,), (2, 3, 12, 7), Layout((Shard(2),), {2: (7, 5)})), [(4, 3), (6, 7)]),
    (
        Sharded("4r-H-3/0/6/3", (4,), (2, 3, 12, 6), Layout((Shard(2),), {2: (3, 0, 6, 3)})),
        [(4, 4), (1, 2)],
    ),
    (
        Sharded("4r-W-even", (4,), (1, 2, 5, 12), Layout((Shard(3),), {3: (3, 3, 3, 3)})),
        [(3, 4), (2, 6)],
    ),
    (
        Sharded(
            "2x2-block",
            (2, 2),
            (2, 2, 12, 9),
            Layout((Shard(2), Shard(3)), {2: (7, 5), 3: (4, 5)}),
        ),
        [(4, 3), (12, 1)],
    ),
    (LAYOUTS_1D[0], [(3,), (1,)]),
    (LAYOUTS_1D[1], [(3,), (9,)]),
    (
        Sharded(
            "2x2-block-3d",
            (2, 2),
            (1, 2, 6, 6, 5),
            Layout((Shard(2), Shard(3)), {2: (4, 2), 3: (2, 4)}),
        ),
        [(3, 2, 2), (2, 6, 5)],
    ),
]
ADAPTIVE_CLASSES = {
    1: (nn.AdaptiveAvgPool1d, nn.AdaptiveMaxPool1d),
    2: (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d),
    3: (nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool3d),
}


def _adaptive_body(case: Sharded, sizes: list[tuple[int, ...]]) -> None:
    avg, max_ = ADAPTIVE_CLASSES[len(case.shape) - 2]
    mesh = get_mesh(case.mesh)
    x = torch.randn(case.shape, dtype=torch.float64)
    for size in sizes:
        # Aligned: each output averages a window of extent / size cells, no overlap.
        spatial = range(x.ndim - len(size), x.ndim)
        windows = {d: x.shape[d] // n for d, n in zip(spatial, size) if n is not None}
        anchors = {d: window_anchor(k, k, 0, 1) for d, k in windows.items()}
        for module in (avg(size), max_(size), max_(size, return_indices=True)):
            what = f"{type(module).__name__}{size}"
            check_against_reference(
                lambda a, m=module: m(a),
                [x],
                [case.layout],
                mesh,
                out_layouts=_pooled(case, anchors, module),
                what=what,
            )


@pytest.mark.parametrize(("case", "sizes"), ADAPTIVE, ids=[str(c) for c, _ in ADAPTIVE])
def test_adaptive_pool(case: Sharded, sizes: list[tuple[int, ...]]) -> None:
    run_on_ranks(case.world, _adaptive_body, case, sizes)


def _misaligned_body() -> None:
    x = torch.randn(1, 2, 12, 7, dtype=torch.float64)
    sharded = distribute_tensor(x, get_mesh((2,)), [Shard(2)], {0: (7, 5)})
    for pool in (nn.AdaptiveAvgPool2d((5, 3)), nn.AdaptiveMaxPool2d((5, 3), return_indices=True)):
        assert_raises_all_ranks(
            NotImplementedError,
            r"dim 2: the extent 12 is not a multiple of the output size 5",
            pool,
            sharded,
        )


def test_adaptive_misaligned_raises() -> None:
    run_on_ranks(2, _misaligned_body)


# ---------------------------------------------------------------------------- ownership
def _ownership_body() -> None:
    sizes = (4, 6, 2, 4)
    x = torch.randn(1, 2, sum(sizes), 5, dtype=torch.float64)
    layout = Layout((Shard(2),), {2: sizes})
    halves = tuple(s // 2 for s in sizes)
    (out,) = check_against_reference(
        nn.MaxPool2d(2),
        [x],
        [layout],
        get_mesh((4,)),
        out_layouts=[Layout(layout.placements, {2: halves})],
    )
    out_sizes = out._spec.sharding_by_dim[2].sizes
    assert_all_ranks(
        out_sizes == halves and out._local.shape[2] == halves[dist.get_rank()],
        f"output shards {out_sizes} (local {tuple(out._local.shape)}), expected {halves}",
    )


def test_stride2_pool_halves_even_shards() -> None:
    run_on_ranks(4, _ownership_body)


UNBATCHED_3D = Sharded("4r-W-0/3/1/1", (4,), (2, 6, 6, 5), Layout((Shard(3),), {3: (0, 3, 1, 1)}))


def _unbatched_ceil_body() -> None:
    x = torch.randn(UNBATCHED_3D.shape, dtype=torch.float64)
    # W: 5 cells on shards (0, 3, 1, 1); windows of 3 at stride 2 start at 0 and 2, centred
    # on cells 1 (rank 1) and 3 (rank 2).
    out = Layout((Shard(3),), {3: (0, 1, 1, 0)})
    for name, module in {
        "max": nn.MaxPool3d(3, stride=(2, 1, 2), ceil_mode=True),
        "max-indices": nn.MaxPool3d(3, stride=(2, 1, 2), ceil_mode=True, return_indices=True),
        "avg": nn.AvgPool3d(3, stride=(2, 1, 2), ceil_mode=True),
    }.items():
        check_against_reference(
            lambda a, m=module: m(a),
            [x],
            [UNBATCHED_3D.layout],
            get_mesh(UNBATCHED_3D.mesh),
            out_layouts=[out] * (2 if name == "max-indices" else 1),
            what=name,
        )


def test_ceil_mode_3d_pooling_of_an_unbatched_input() -> None:
    """Ceil-mode windows padded past the input on a rank: the padded block keeps the input's
    layout (max_pool3d refuses a 4-D input whose strides look channels-last; the op-database
    sweep caught ranks raising there while the others waited)."""
    run_on_ranks(4, _unbatched_ceil_body)


# ---------------------------------------------------------------------------- aten ops called directly
def _aten_max_pool_backward(x: torch.Tensor, *, pooled_grad: bool) -> torch.Tensor:
    """``aten.max_pool2d_with_indices_backward`` as torch's OpInfo calls it: of a gradient of
    ones, or (``pooled_grad``) of the pooled values squared, so that the input gradient flows
    through the backward op's own derivative too."""
    config = ([3, 3], [2, 2], [1, 1], [1, 1], True)
    out, indices = F.max_pool2d(x, *config, return_indices=True)
    grad = out.square() if pooled_grad else torch.ones_like(out)
    return torch.ops.aten.max_pool2d_with_indices_backward(grad, x, *config, indices)


def _aten_body(case: Sharded) -> None:
    """Each cell's gradient on the rank holding the cell (the input's layout); a constant pad
    (negative pads crop) by the pad's window rule."""
    x = torch.randn(case.shape, dtype=torch.float64)
    mesh = get_mesh(case.mesh)
    for pooled_grad in (False, True):
        # torch's derivative of the backward op for its input x is ``zeros_like(self)``: a
        # plain tensor of x's global shape, a gradient built whole on every rank, which the
        # guard counts (NOTE [Gathers an op was not asked to make]); the cells keep x's layout.
        with gather_policy("allow"):
            check_against_reference(
                lambda a, p=pooled_grad: _aten_max_pool_backward(a, pooled_grad=p),
                [x],
                [case.layout],
                mesh,
                what=f"max_pool2d_with_indices_backward (pooled_grad={pooled_grad})",
            )
    for pad in ([2, -1, 0, 3], [-2, 1, 3, -4], [0, 0, 1, 1, 1, 0]):
        check_against_reference(
            lambda a, p=pad: torch.constant_pad_nd(a, p, 1.5),
            [x],
            [case.layout],
            mesh,
            out_layouts=[windowed(case.layout, case.shape, case.mesh, pad_anchors(pad, x.ndim))],
            what=f"constant_pad_nd({pad})",
        )


@pytest.mark.parametrize("case", SPATIAL_2D, ids=str)
def test_aten_pooling_backward_and_constant_pad_keep_the_layout(case: Sharded) -> None:
    run_on_ranks(case.world, _aten_body, case)
