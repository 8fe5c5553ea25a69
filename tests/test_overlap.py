"""The overlap option gives the synchronous result, forward and gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard

import shardsci
from shardsci.testing import Layout, check_against_reference, get_mesh, run_on_ranks
from tests.expected_layouts import module_anchors, windowed

CONVS = {
    "k3": dict(kernel_size=3, padding=1),
    "k5-stride2": dict(kernel_size=5, stride=2, padding=2),
    "k3-valid": dict(kernel_size=3),
    "k3-dilation2": dict(kernel_size=3, padding=2, dilation=2),
}


def _body(sizes, name, mode) -> None:
    torch.manual_seed(0)
    module = nn.Conv2d(2, 3, padding_mode=mode, dtype=torch.float64, **CONVS[name])
    x = torch.randn(2, 2, sum(sizes), 6, dtype=torch.float64)
    layout = Layout((Shard(2),), {2: sizes})
    mesh = (len(sizes),)
    expected = windowed(layout, x.shape, mesh, module_anchors(module, x.ndim))
    with shardsci.overlap_halos():
        check_against_reference(
            lambda m, a: m(a),
            [x],
            [layout],
            get_mesh(mesh),
            module=module,
            out_layouts=[expected],
            what=name,
        )


@pytest.mark.parametrize("mode", ["zeros", "circular"])
@pytest.mark.parametrize("name", list(CONVS))
@pytest.mark.parametrize("sizes", [(9, 5), (6, 0, 2, 8)], ids=["9/5", "6/0/2/8"])
def test_overlapped_conv_matches_reference(sizes, name, mode) -> None:
    run_on_ranks(len(sizes), _body, sizes, name, mode)
