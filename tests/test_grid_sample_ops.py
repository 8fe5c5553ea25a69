"""``F.grid_sample`` (``grid_sampler_2d`` and ``grid_sampler_3d``) with the input split along
its channels against one process, float64: values, the gradients of the input and of the
grid (held whole), and the output's layout (the input's channel split: every channel is
sampled at the grid's points, so each rank samples its own); uneven and empty shards, 1-D
meshes and 2x2 meshes (channels nested over both axes, and batch by channels); nearest and
bilinear sampling, each padding mode, ``align_corners`` both ways.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from shardsci.testing import Layout, check_against_reference, get_mesh, run_on_ranks
from tests.layouts import Sharded

# The input's layouts; the grid is (N, *T, ndim), with T (3, 4) or (2, 3, 2).
CASES = [
    Sharded("2d-4r-C-2/0/2/1", (4,), (2, 5, 6, 7), Layout((Shard(1),), {1: (2, 0, 2, 1)})),
    Sharded(
        "2d-2x2-C-nested", (2, 2), (1, 7, 5, 6), Layout((Shard(1), Shard(1)), {1: (3, 0, 2, 2)})
    ),
    Sharded(
        "2d-2x2-N-by-C", (2, 2), (3, 5, 4, 6), Layout((Shard(0), Shard(1)), {0: (2, 1), 1: (4, 1)})
    ),
    Sharded("3d-2r-C-3/2", (2,), (2, 5, 4, 3, 5), Layout((Shard(1),), {1: (3, 2)})),
    Sharded(
        "3d-2x2-C-nested", (2, 2), (1, 6, 3, 4, 3), Layout((Shard(1), Shard(1)), {1: (1, 2, 3, 0)})
    ),
]
# mode, padding_mode, align_corners
SAMPLINGS = [
    ("bilinear", "zeros", False),
    ("bilinear", "border", True),
    ("nearest", "reflection", False),
]


def _body(case: Sharded) -> None:
    mesh = get_mesh(case.mesh)
    torch.manual_seed(0)
    n = len(case.shape) - 2
    x = torch.randn(case.shape, dtype=torch.float64)
    points = (3, 4) if n == 2 else (2, 3, 2)
    # a little past [-1, 1]: every padding mode reads outside the plane somewhere
    grid = 1.2 * (2 * torch.rand(case.shape[0], *points, n, dtype=torch.float64) - 1)
    output_shape = (*case.shape[:2], *points)  # the input's split holds: N and C are the input's
    for mode, padding_mode, align_corners in SAMPLINGS:

        def sample(a, g, mode=mode, padding_mode=padding_mode, align_corners=align_corners):
            return F.grid_sample(
                a, g, mode=mode, padding_mode=padding_mode, align_corners=align_corners
            )

        out = check_against_reference(
            sample, [x, grid], [case.layout, None], mesh, out_layouts=[case.layout],
            what=f"{mode}, {padding_mode}, align_corners={align_corners}",
        )  # fmt: skip
        assert tuple(out[0].shape) == output_shape


@pytest.mark.parametrize("case", CASES, ids=str)
def test_grid_sample_keeps_the_channel_split(case: Sharded) -> None:
    run_on_ranks(case.world, _body, case)
