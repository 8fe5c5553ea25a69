"""Physics attention on a sharded field moves sums over the cells, never the cells themselves.

A Transolver block contracts the sharded spatial dims twice (the slice tokens and their
weights' totals, ``einsum`` over the cells) and broadcasts back with the cells as batch dims.
Each contraction is a local product whose pending sum ``(B, heads, slices, D / heads)`` is
all-reduced, and the backward of a sum over the cells broadcasts a gradient that every rank
already holds whole; nothing the size of the field crosses the network (NOTE [A pending sum is
reduced rather than an operand gathered] in ``shardsci/tensor/_propagation.py``). So the bytes
a rank receives in a training step must not change when the field grows: counted here with
``count_traffic`` (at the dispatcher, not by the library's own counter) at two field sizes, on
uneven slabs and an uneven 2x2 block. Values, every gradient and the output's layout are
checked against one process in float64 at the smaller size, under ``gather_policy("error")``.

The model has no position features: the coordinates' gradients are lines ``(C, N_i)`` of the
field that cross from ShardTensors back to the plain tensors they were built from (an all-gather
or all-reduce of ``N_i x C`` per spatial dim), traffic that grows with the field's side, not with
its area, and belongs to the embedding, not to the attention.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

import shardsci
from shardsci import gather_policy
from shardsci.models import Transolver
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    check_against_reference,
    count_traffic,
    get_mesh,
    run_on_ranks,
)

# name -> (mesh, (B, C, H, W) at the smaller size, layout); the larger field doubles H and W
# and every shard's size.
CASES = {
    "2r-H-7/5": ((2,), (1, 2, 12, 8), Layout((Shard(2),), {2: (7, 5)})),
    "2x2-block": ((2, 2), (1, 2, 12, 8), Layout((Shard(2), Shard(3)), {2: (8, 4), 3: (2, 6)})),
}
# Why the reference check's own gather test is off at this size: the slice tokens' sums weigh
# about as much as a tiny field's shards; the byte counts at two sizes are the check here.
TINY = "the slice tokens' sums (B, heads, slices, D / heads) weigh as much as a tiny field"


def _model() -> Transolver:
    return Transolver(in_channels=2, width=8, layers=1, heads=2, slices=3, coordinates="none")


def _doubled(shape: tuple[int, ...], layout: Layout) -> tuple[tuple[int, ...], Layout]:
    sizes = {dim: tuple(2 * s for s in split) for dim, split in layout.sizes.items()}
    return (*shape[:2], 2 * shape[2], 2 * shape[3]), Layout(layout.placements, sizes)


def _received_in_a_step(mesh, shape: tuple[int, ...], layout: Layout) -> dict[str, int]:
    """Bytes this rank receives, by kind, in one forward and backward of a float64 step."""
    torch.manual_seed(0)
    model = _model().double()
    by_axis = {axis: layout.sizes[p.dim] for axis, p in enumerate(layout.placements)}
    x = shardsci.distribute_tensor(
        torch.randn(shape, dtype=torch.float64), mesh, list(layout.placements), by_axis
    )
    with count_traffic() as traffic:
        out = model(x)
        (out * out).mean().full_tensor().backward()
    return dict(traffic.received_by_kind)


def _body(case: str) -> None:
    mesh_shape, shape, layout = CASES[case]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    with gather_policy("error"):
        check_against_reference(
            lambda m, a: m(a),
            [torch.randn(shape, dtype=torch.float64)],
            [layout],
            mesh,
            module=_model().double(),
            out_layouts=[layout],
            not_a_gather=TINY,
            what=f"transolver {case}",
        )
    small = _received_in_a_step(mesh, shape, layout)
    large = _received_in_a_step(mesh, *_doubled(shape, layout))
    assert_all_ranks(
        small == large,
        f"a Transolver step received {small} bytes by kind on a {shape[2:]} field and {large} "
        f"on one twice as large each way: traffic that grows with the field is a gather",
    )


@pytest.mark.parametrize(
    "case",
    # The 2x2 block is slow (about 20 s at load 16; the slab checks the same contraction).
    [pytest.param(c, marks=pytest.mark.slow) if c == "2x2-block" else c for c in CASES],
)
def test_physics_attention_traffic_does_not_grow_with_the_field(case: str) -> None:
    run_on_ranks(4 if case == "2x2-block" else 2, _body, case)
