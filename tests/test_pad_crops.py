"""Pads by negative amounts, in every mode, keep the input's layout: a crop then a pad
(``_pad_ops.crop_then_pad``), against one process in float64: values, gradients, the
output's layout stated below by hand, and the bytes received by ``count_traffic``.

A pad that crops one side of a dim and pads the other shifts every cell by the crop: each
output cell stays with the rank holding the input cell it copies, not with the layout
remembered for the input's extent (NOTE [Which rank owns an output of a windowed op]); a
crop and a pad in two calls that return to the input's frame keep the remembered layout.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from shardsci.handlers import from_local_spec
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    check_against_reference,
    count_traffic,
    get_mesh,
    run_on_ranks,
)

MODES = ("constant", "replicate", "circular", "reflect")
SHIFT = (-1, 1, -2, 1)  # W: crop 1 on the left, pad 1 on the right; H: crop 2, pad 1
# (mesh, layout of a (1, 3, 4, 4) input, layout of F.pad(x, SHIFT): output cell j of W
# copies input cell j + 1 and the last one is padding, on the last nonempty rank; output
# cell i of H copies input cell i + 2, then padding)
LAYOUTS = {
    "4r-empty": (
        (4,),
        Layout((Shard(3),), {3: (0, 2, 1, 1)}),
        Layout((Shard(3),), {3: (0, 1, 1, 2)}),
    ),
    "2x2": (
        (2, 2),
        Layout((Shard(2), Shard(3)), {2: (3, 1), 3: (3, 1)}),
        Layout((Shard(2), Shard(3)), {2: (1, 2), 3: (2, 2)}),
    ),
    "2r-uneven": (
        (2,),
        Layout((Shard(3),), {3: (1, 3)}),
        Layout((Shard(3),), {3: (0, 4)}),
    ),
}
SAME_FRAME = (-1, -1, 0, 0)  # cropped on both sides, then padded back in a second call
# (6, 2, 4, 4) padded by (0, 0, 2, -4): the crop of H leaves no row, so torch's replicate pad
# copies input row 0 twice (on row 0's owner) and its constant pad is all fill (on the first
# shard: NOTE [Which rank owns an output of a windowed op]); sharded on W, which is kept, or
# on H.
EMPTIED = (0, 0, 2, -4)
EMPTIED_LAYOUTS = {
    "4r-empty": (
        Layout((Shard(3),), {3: (0, 2, 1, 1)}),
        dict.fromkeys(("constant", "replicate"), Layout((Shard(3),), {3: (0, 2, 1, 1)})),
    ),
    "2x2": (
        Layout((Shard(2), Shard(3)), {2: (3, 1), 3: (1, 3)}),
        dict.fromkeys(
            ("constant", "replicate"), Layout((Shard(2), Shard(3)), {2: (2, 0), 3: (1, 3)})
        ),
    ),
    "2r-uneven": (
        Layout((Shard(2),), {2: (0, 4)}),
        {
            "constant": Layout((Shard(2),), {2: (2, 0)}),
            "replicate": Layout((Shard(2),), {2: (0, 2)}),
        },
    ),
}


def _sharded(x: torch.Tensor, layout: Layout, mesh) -> torch.Tensor:
    spec = layout.spec(mesh, x)
    return from_local_spec(spec.narrow(x).contiguous(), spec)


def _received(fn, x: torch.Tensor) -> int:
    with count_traffic() as traffic:
        fn(x)
    return traffic.received


def _body(name: str) -> None:
    mesh_shape, layout, shifted = LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(1, 3, 4, 4, dtype=torch.float64)
    shard = _sharded(x, layout, mesh)
    for mode in MODES:
        what = f"{name}: {mode}"
        fn = lambda t, m=mode: F.pad(t, SHIFT, m)  # noqa: E731
        check_against_reference(fn, [x], [layout], mesh, out_layouts=[shifted], what=what)
        received = _received(fn, shard)
        if mode == "constant":
            assert_all_ranks(received == 0, f"{what}: received {received} bytes, expected 0")
        else:
            # NOTE [A padded tensor carries the halo its convolution reads]: at most the
            # shard's own cells widened by the pad widths (1) and the crop (2) on both sides
            # of each sharded dim, never the field
            local = shard.to_local()
            bound = sum(
                6 * local.numel() // max(local.shape[d], 1) * x.element_size()
                for d in shard._spec.sharding_by_dim
            )
            assert_all_ranks(received <= bound, f"{what}: received {received} > {bound}")
        back = lambda t, m=mode: F.pad(F.pad(t, SAME_FRAME, m), (1, 1, 0, 0), m)  # noqa: E731
        check_against_reference(
            back, [x], [layout], mesh, out_layouts=[layout], what=f"{what}, back"
        )
    aten_pad = lambda t: torch.constant_pad_nd(t, SHIFT, 2.0)  # noqa: E731
    what = f"{name}: aten constant_pad_nd"
    check_against_reference(aten_pad, [x], [layout], mesh, out_layouts=[shifted], what=what)
    received = _received(aten_pad, shard)
    assert_all_ranks(received == 0, f"{what}: received {received} bytes, expected 0")

    layout, emptied = EMPTIED_LAYOUTS[name]
    y = torch.randn(6, 2, 4, 4, dtype=torch.float64)
    for mode in ("constant", "replicate"):
        fn = lambda t, m=mode: F.pad(t, EMPTIED, m)  # noqa: E731
        what = f"{name}: {mode}, a crop that leaves no row"
        out_layouts = [emptied[mode]]
        check_against_reference(fn, [y], [layout], mesh, out_layouts=out_layouts, what=what)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_pad_that_crops_keeps_each_cell_with_its_input(name: str) -> None:
    run_on_ranks(math.prod(LAYOUTS[name][0]), _body, name)


# (5, 3) padded by (-1, -2, 1, 1): W is cropped away, H padded by one row on each side, so
# the output is (7, 0). Its backward pads the empty W back to 3 columns: a rank whose
# columns lie in that padding reads nothing but fill, and its empty shard lies outside the
# range it reads (rank (1, 0) of the 2x2 layouts raised an IndexError while the others
# waited in the exchange). (mesh, layout of the input, layout of the output)
CROPPED_AWAY = (-1, -2, 1, 1)
CROPPED_AWAY_LAYOUTS = {
    "2x2-uneven": (
        (2, 2),
        Layout((Shard(0), Shard(1)), {0: (2, 3), 1: (1, 2)}),
        Layout((Shard(0), Shard(1)), {0: (3, 4), 1: (0, 0)}),
    ),
    "2x2-last": (
        (2, 2),
        Layout((Shard(0), Shard(1)), {0: (2, 3), 1: (2, 1)}),
        Layout((Shard(0), Shard(1)), {0: (3, 4), 1: (0, 0)}),
    ),
    "2r-W": ((2,), Layout((Shard(1),), {1: (1, 2)}), Layout((Shard(1),), {1: (0, 0)})),
}


def _cropped_away_body(name: str) -> None:
    mesh_shape, layout, out_layout = CROPPED_AWAY_LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(5, 3, dtype=torch.float64)
    for what, fn in (
        ("aten constant_pad_nd", lambda t: torch.constant_pad_nd(t, CROPPED_AWAY, 1.0)),
        ("F.pad constant", lambda t: F.pad(t, CROPPED_AWAY, "constant", 1.0)),
    ):
        check_against_reference(
            fn, [x], [layout], mesh, out_layouts=[out_layout], what=f"{name}: {what}"
        )


@pytest.mark.parametrize("name", list(CROPPED_AWAY_LAYOUTS))
def test_a_pad_of_a_dim_cropped_away_reads_only_fill(name: str) -> None:
    run_on_ranks(math.prod(CROPPED_AWAY_LAYOUTS[name][0]), _cropped_away_body, name)
