"""``masked_select`` of a tensor split on dims other than the leading one (2-D blocks), against
one process, float64 (NOTE [A selection across blocks moves each cell to its place]).

The output is the selected cells in row-major order: a 1-D tensor split on dim 0 over the
axes that split the input (in increasing order), each rank's part as long as its own
selection. Values, that layout, and the input's gradient (``masked_scatter`` of the split
gradient, the selection's backward) as one process, under ``"error"``: on 2x2 uneven blocks,
2x2 with empty shards, two ranks split on the last dim only, and 2x2x2; and bytes per rank by
``count_traffic`` below the gathered fallback's.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.distributed.tensor import Shard

from shardsci import gather_policy
from shardsci.handlers import from_local_spec
from shardsci.tensor._ops._gathered_ops import gathered
from shardsci.testing import Layout, assert_all_ranks, count_traffic, get_mesh, run_on_ranks

aten = torch.ops.aten

# name: (mesh, shape, layout)
CASES = {
    "2x2-uneven": ((2, 2), (6, 5), Layout((Shard(0), Shard(1)), {0: (2, 4), 1: (3, 2)})),
    "2x2-empty": ((2, 2), (6, 5), Layout((Shard(0), Shard(1)), {0: (0, 6), 1: (5, 0)})),
    "2r-last-dim": ((2,), (3, 7), Layout((Shard(1),), {1: (4, 3)})),
    "2x2x2-uneven": (
        (2, 2, 2),
        (4, 6, 5),
        Layout((Shard(0), Shard(1), Shard(2)), {0: (1, 3), 1: (4, 2), 2: (2, 3)}),
    ),
}


def _sharded(mesh, values: torch.Tensor, layout: Layout, *, grad: bool = False):
    spec = layout.spec(mesh, values)
    local = spec.narrow(values).clone()
    if grad:
        local.requires_grad_()
    return from_local_spec(local, spec), local, spec


def _expected_counts(spec, mask: torch.Tensor) -> tuple[int, ...]:
    """Each block's selected count, in the flat order of the mesh axes (all of them split)."""
    coordinates = itertools.product(*map(range, spec.mesh_shape))
    return tuple(int(spec.narrow(mask, list(c)).sum()) for c in coordinates)


def _matches_one_process(name: str) -> None:
    mesh_shape, shape, layout = CASES[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64)
    mask = torch.rand(shape) > 0.4
    reference = x.clone().requires_grad_()
    expected = torch.masked_select(reference, mask)
    weight = torch.randn(expected.shape, dtype=torch.float64)
    (expected * weight).sum().backward()
    t, leaf, spec = _sharded(mesh, x, layout, grad=True)
    m, _, _ = _sharded(mesh, mask, layout)
    with gather_policy("error"):
        out = torch.masked_select(t, m)
        counts = _expected_counts(spec, mask)
        placements = (Shard(0),) * len(mesh_shape)
        stated = Layout(placements, {0: counts}).spec(mesh, expected)
        weighted, _, _ = _sharded(mesh, weight, Layout(placements, {0: counts}))
        (out * weighted).sum().backward()
    assert_all_ranks(out._spec.same_layout(stated), f"layout {out._spec}, stated {stated}")
    assert_all_ranks(torch.equal(out.full_tensor(), expected.detach()), "values")
    assert_all_ranks(torch.allclose(leaf.grad, spec.narrow(reference.grad)), "gradient")


@pytest.mark.parametrize("name", list(CASES))
def test_masked_select_of_blocks_matches_one_process(name: str) -> None:
    run_on_ranks(math.prod(CASES[name][0]), _matches_one_process, name)


def _fewer_bytes_than_the_fallback() -> None:
    """(64, 64) in 2x2 blocks split 40/24 and 24/40, a quarter of the cells selected."""
    mesh = get_mesh((2, 2))
    torch.manual_seed(0)
    x = torch.randn(64, 64, dtype=torch.float64)
    mask = torch.rand(64, 64) < 0.25
    layout = Layout((Shard(0), Shard(1)), {0: (40, 24), 1: (24, 40)})
    t, _, _ = _sharded(mesh, x, layout)
    m, _, _ = _sharded(mesh, mask, layout)
    with gather_policy("allow"):
        with count_traffic() as ours:
            out = torch.masked_select(t, m)
        with count_traffic() as fallback:
            gathered(aten.masked_select.default, (t, m), {})
    assert_all_ranks(torch.equal(out.full_tensor(), x[mask]), "values")
    assert_all_ranks(
        ours.received < fallback.received,
        f"received {ours.received} B; the fallback {fallback.received} B",
    )


def test_masked_select_of_blocks_receives_less_than_the_fallback() -> None:
    run_on_ranks(4, _fewer_bytes_than_the_fallback)
