"""``torch.histogram`` with ``density=True`` of split data, against one process, float64 (NOTE
[A histogram is a pending sum of each rank's counts]).

The density is a pending sum over the axes splitting the input, each rank's counts over the
global total times the bins' widths, and the edges are replicated, every rank computing them
alike; with or without weights (split like the input), with a given range or the data's own,
on 2 uneven ranks, 4 ranks with empty shards (rank 0 holding every element: the sweep's
sample 34) and a 2x2 mesh. The density costs, beyond the plain histogram, fewer bytes
(``count_traffic``) than one all-reduce of the counts, which is what it cost before: one
all-reduce of the total.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardsci import gather_policy
from shardsci.handlers import from_local_spec
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    check_against_reference,
    count_traffic,
    get_mesh,
    run_on_ranks,
)

SHAPE = (6, 5)
BINS = 4  # the counts, held whole by every rank, stay smaller than a shard
LAYOUTS = {
    "2r-uneven": ((2,), Layout((Shard(0),), {0: (1, 5)})),
    "4r-all-on-one": ((4,), Layout((Shard(1),), {1: (5, 0, 0, 0)})),
    "2x2-uneven": ((2, 2), Layout((Shard(0), Shard(1)), {0: (4, 2), 1: (3, 2)})),
}
CALLS = {
    "the data's range": lambda x, w, density: torch.histogram(x, BINS, density=density),
    "a given range, weights": lambda x, w, density: torch.histogram(
        x, BINS, range=(-1.0, 2.0), weight=w, density=density
    ),
}


def _body(name: str) -> None:
    mesh_shape, layout = LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(SHAPE, dtype=torch.float64)
    weight = torch.rand(SHAPE, dtype=torch.float64)
    pending = Layout(tuple(Partial() for _ in mesh_shape))
    replicated = Layout(tuple(Replicate() for _ in mesh_shape))
    spec = layout.spec(mesh, x)
    shards = [from_local_spec(spec.narrow(t).contiguous(), spec) for t in (x, weight)]
    for what, call in CALLS.items():
        with gather_policy("error"):
            check_against_reference(
                lambda x, w, call=call: call(x, w, True), [x, weight], [layout, layout], mesh,
                out_layouts=[pending, replicated], grad=False, what=f"{name}: {what}",
            )  # fmt: skip
        received = []
        for density in (False, True):
            with count_traffic() as forward:
                call(*shards, density)
            received.append(forward.received)
        with count_traffic() as counts:  # the counts' all-reduce, as the density made it
            call(*shards, False)[0].redistribute(mesh, replicated.placements)
        density, reduced = (n - received[0] for n in (received[1], counts.received))
        assert_all_ranks(
            density < reduced,
            f"{name}: {what}: the density received {density} B more than the counts, an "
            f"all-reduce of the counts {reduced} B",
        )


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_histogram_density_is_a_pending_sum(name: str) -> None:
    run_on_ranks(math.prod(LAYOUTS[name][0]), _body, name)
