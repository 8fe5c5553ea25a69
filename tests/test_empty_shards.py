"""Ops whose torch kernels reject an empty dim they do not act on ("non-zero size for
non-batch dimensions"), on layouts where some ranks hold an empty shard of such a dim:
every rank computes, none raises while the others wait (NOTE [A rank with an empty shard
computes nothing]), against the single-process reference: forward, input gradient, float64,
the output in the input's layout (placements and shard sizes).

Found by the op-database sweep's random layouts (``tests/op_db_sweep.py``, ``4r-random``):
pooling and replicate padding with channels split so that a rank held none.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from shardsci.testing import Layout, check_against_reference, get_mesh, run_on_ranks
from tests.layouts import Sharded

# Name -> (the op, the pooled or padded dims: the trailing ones).
OPS: dict[str, tuple[Callable[[torch.Tensor], object], int]] = {
    "max_pool1d": (lambda a: F.max_pool1d(a, 2), 1),
    "max_pool2d-indices": (lambda a: F.max_pool2d(a, 3, 2, 1, return_indices=True), 2),
    "max_pool3d": (lambda a: F.max_pool3d(a, 2, ceil_mode=True), 3),
    "avg_pool1d": (lambda a: F.avg_pool1d(a, 3, 2, 1), 1),
    "avg_pool2d": (lambda a: F.avg_pool2d(a, 2), 2),
    "avg_pool3d": (lambda a: F.avg_pool3d(a, (1, 2, 2)), 3),
    "adaptive_avg_pool1d": (lambda a: F.adaptive_avg_pool1d(a, 3), 1),
    "adaptive_avg_pool2d": (lambda a: F.adaptive_avg_pool2d(a, (3, 2)), 2),
    "adaptive_max_pool2d-indices": (lambda a: F.adaptive_max_pool2d(a, (2, 3), True), 2),
    "adaptive_max_pool3d": (lambda a: F.adaptive_max_pool3d(a, (1, 2, 3)), 3),
    "pad-reflect-1d": (lambda a: F.pad(a, (2, 1), mode="reflect"), 1),
    "pad-replicate-2d": (lambda a: F.pad(a, (1, 2, 2, 0), mode="replicate"), 2),
    "pad-replicate-negative-2d": (lambda a: F.pad(a, (-1, 2, 1, -2), mode="replicate"), 2),
    "pad-reflect-3d": (lambda a: F.pad(a, (1, 1, 0, 1, 1, 0), mode="reflect"), 3),
    "interpolate-nearest-2x": (lambda a: F.interpolate(a, scale_factor=2.0), 2),
    "interpolate-bilinear": (lambda a: F.interpolate(a, size=(5, 7), mode="bilinear"), 2),
}
SPATIAL = {1: (9,), 2: (6, 8), 3: (3, 4, 6)}

# Non-spatial dims split so that some ranks hold none of them.
LAYOUTS = [
    Sharded("4r-C-0/3/2/0", (4,), (2, 5), Layout((Shard(1),), {1: (0, 3, 2, 0)})),
    Sharded("4r-N-0/2/0/1", (4,), (3, 4), Layout((Shard(0),), {0: (0, 2, 0, 1)})),
    Sharded("2x2-N-C-empty", (2, 2), (2, 5), Layout((Shard(0), Shard(1)), {0: (2, 0), 1: (0, 5)})),
    # Unbatched (C, *spatial): the channels are dim 0.
    Sharded("4r-unbatched-C-0/3/0/2", (4,), (5,), Layout((Shard(0),), {0: (0, 3, 0, 2)})),
]


def _empty_shards_body(case: Sharded) -> None:
    mesh = get_mesh(case.mesh)
    for name, (op, n) in OPS.items():
        if len(case.shape) == 1 and (name.startswith("interpolate") or n == 1):
            continue  # interpolate takes batched input only; 1-D ops would pool the channels
        x = torch.randn(*case.shape, *SPATIAL[n], dtype=torch.float64)
        outputs = 2 if name.endswith("indices") else 1
        check_against_reference(
            op, [x], [case.layout], mesh, out_layouts=[case.layout] * outputs, what=name
        )


@pytest.mark.parametrize("case", LAYOUTS, ids=str)
def test_kernels_that_reject_empty_dims_on_empty_shards(case: Sharded) -> None:
    run_on_ranks(case.world, _empty_shards_body, case)
