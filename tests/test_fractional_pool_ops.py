"""Fractional max pooling of sharded tensors against one process, float64: values, global
indices, the input's gradient, and the output's layout, which the cells' dependencies state
(NOTE [An output cell belongs to the shard it depends on] in ``tests/expected_layouts.py``:
an output index belongs to the shard holding every plane's window, found by probing the op on
one process); samples given or drawn by torch from the same seed; H split over 2 and 4 ranks
(an empty shard), no plane at all, channels split, 2x2 blocks in 2-D and 3-D; and nothing gathered: the
reference checker's traffic check (every rank receives less than it lacks of the input).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from shardsci.tensor import ShardTensor
from shardsci.testing import Layout, check_against_reference, get_mesh, run_on_ranks
from tests.boxes import dim_shardings
from tests.expected_layouts import cell_owners
from tests.layouts import Sharded

CASES = [
    Sharded("2d-2r-H-6/5", (2,), (2, 3, 11, 9), Layout((Shard(2),), {2: (6, 5)})),
    Sharded("2d-4r-H-3/0/5/3", (4,), (2, 3, 11, 9), Layout((Shard(2),), {2: (3, 0, 5, 3)})),
    Sharded("2d-2r-H-no-plane", (2,), (0, 3, 11, 9), Layout((Shard(2),), {2: (6, 5)})),
    Sharded("2d-4r-C-1/0/2/0", (4,), (2, 3, 11, 9), Layout((Shard(1),), {1: (1, 0, 2, 0)})),
    Sharded(
        "2d-2x2-HW", (2, 2), (1, 2, 11, 12), Layout((Shard(2), Shard(3)), {2: (5, 6), 3: (7, 5)})
    ),
    Sharded(
        "3d-2x2-TW", (2, 2), (1, 2, 9, 5, 10), Layout((Shard(2), Shard(4)), {2: (4, 5), 4: (6, 4)})
    ),
]


def _calls(n: int, samples: torch.Tensor) -> dict:
    pool = F.fractional_max_pool2d if n == 2 else F.fractional_max_pool3d
    size = (5, 4) if n == 2 else (4, 2, 5)

    def drawn(a):
        torch.manual_seed(3)  # torch draws the samples, alike on every rank and in one process
        return pool(a, 2, output_ratio=(0.5,) * n, return_indices=True)

    def drawn_apart(a):
        """Ranks whose generators differ: the first rank's samples are everyone's."""
        sharded = isinstance(a, ShardTensor) and dist.get_rank() != 0
        torch.manual_seed(3 + 100 * dist.get_rank() * sharded)
        return pool(a, 2, output_ratio=(0.5,) * n, return_indices=True)

    return {
        "given samples": lambda a: pool(a, 3, output_size=size, _random_samples=samples),
        "given samples, indices": lambda a: pool(
            a, (2,) * n, output_size=size, return_indices=True, _random_samples=samples
        ),
        "drawn samples": drawn,
        "drawn samples, generators apart": drawn_apart,
    }


def _stated(call, x: torch.Tensor, case: Sharded, output: int) -> Layout:
    """Output ``output``'s layout as its cells' dependencies state it, probed on one process:
    each split dim's outputs on the shard every plane's window lies in, those whose windows
    straddle a boundary in some plane (no owner) with the previous output's owner."""
    sizes = {}
    for dim, (_, split) in dim_shardings(case.layout, x.shape, case.mesh).items():
        dependence = cell_owners(lambda a: list(_flat(call(a))), x, dim, split)[output]
        extent = _flat(call(x))[output].shape[dim]
        owners = dependence.carrying.get(dim, (None,) * extent)  # no cell: no owner
        held, previous = [], next(r for r, size in enumerate(split) if size)
        for owner in owners:
            previous = previous if owner is None else owner
            held.append(previous)
        sizes[dim] = tuple(held.count(r) for r in range(len(split)))
    return Layout(case.layout.placements, sizes)


def _flat(out):
    return out if isinstance(out, tuple) else (out,)


def _body(case: Sharded) -> None:
    mesh = get_mesh(case.mesh)
    n = len(case.shape) - 2
    torch.manual_seed(0)
    x = torch.randn(case.shape, dtype=torch.float64)
    samples = torch.rand(case.shape[0], case.shape[1], n, dtype=torch.float64)
    for what, call in _calls(n, samples).items():
        stated = [_stated(call, x, case, i) for i in range(len(_flat(call(x))))]
        check_against_reference(call, [x], [case.layout], mesh, out_layouts=stated, what=what)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_fractional_max_pool_keeps_the_layout_its_windows_state(case: Sharded) -> None:
    run_on_ranks(case.world, _body, case)
