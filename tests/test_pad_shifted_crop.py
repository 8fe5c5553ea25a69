"""A pad that crops one side and pads the other shifts every cell by the crop: each output
cell stays with the rank holding the input cell it copies, not with the layout remembered for
the input's extent (NOTE [Which rank owns an output of a windowed op]), against one process,
float64: values, gradients, the output's layout stated independently, and the bytes received
by ``count_traffic`` for a constant pad (none). A crop and pad of the same side keep the remembered layout."""

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

# (mesh, layout of a (1, 3, 4, 4) input, layout of F.pad(x, (-1, 1, -2, 1)): output cell j of
# dim 3 copies input cell j + 1, the last one is padding and goes to the last nonempty rank;
# dim 2's output cell i copies input cell i + 2, then padding)
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
}
SHIFT = (-1, 1, -2, 1)
SAME_FRAME = (-1, -1, 0, 0)  # cropped on both sides, then padded back below


def _body(name: str) -> None:
    mesh_shape, layout, shifted = LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(1, 3, 4, 4, dtype=torch.float64)
    spec = layout.spec(mesh, x)
    shard = from_local_spec(spec.narrow(x).contiguous(), spec)
    for mode in ("constant", "replicate"):
        fn = lambda t, m=mode: F.pad(t, SHIFT, m)  # noqa: E731
        check_against_reference(
            fn, [x], [layout], mesh, out_layouts=[shifted], what=f"{name}: {mode}"
        )
        if mode == "constant":  # replicate's halo exchange moves edge slices it need not
            with count_traffic() as traffic:
                fn(shard)
            assert_all_ranks(traffic.received == 0, f"{name}: received {traffic.received}")
        back = lambda t, m=mode: F.pad(F.pad(t, SAME_FRAME, m), (1, 1, 0, 0), m)  # noqa: E731
        check_against_reference(
            back, [x], [layout], mesh, out_layouts=[layout], what=f"{name}: {mode}, back"
        )


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_pad_that_shifts_the_cells_keeps_each_with_its_input(name: str) -> None:
    run_on_ranks(math.prod(LAYOUTS[name][0]), _body, name)
