"""``channel_shuffle`` with sharded channels against one process: values, input gradients,
float64, uneven and empty shards on 2 and 4 ranks and a 2x2 mesh (channels and H), and the
output's layout: the input's (an output cell of the input's shape keeps its shard sizes,
NOTE [An output's layout is stated]); each rank gathers the channels it lacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from shardsci.testing import Layout, check_against_reference, get_mesh, run_on_ranks
from tests.layouts import Sharded

CASES = [
    Sharded("2r-C-1/5", (2,), (2, 6, 3, 2), Layout((Shard(1),), {1: (1, 5)})),
    Sharded("4r-C-0/3/1/2", (4,), (1, 6, 2, 3), Layout((Shard(1),), {1: (0, 3, 1, 2)})),
    Sharded(
        "2x2-C-4/2-H-1/2",
        (2, 2),
        (1, 6, 3, 2),
        Layout((Shard(1), Shard(2)), {1: (4, 2), 2: (1, 2)}),
    ),
    Sharded("2r-H-2/1", (2,), (1, 6, 3, 2), Layout((Shard(2),), {2: (2, 1)})),
]


def _body(case: Sharded) -> None:
    mesh = get_mesh(case.mesh)
    x = torch.randn(case.shape, dtype=torch.float64)
    for groups in (2, 3, 6):
        check_against_reference(
            lambda a, g=groups: F.channel_shuffle(a, g),
            [x],
            [case.layout],
            mesh,
            what=f"channel_shuffle({groups})",
        )


@pytest.mark.parametrize("case", CASES, ids=str)
def test_channel_shuffle_keeps_the_layout(case: Sharded) -> None:
    run_on_ranks(case.world, _body, case)
