"""``masked_scatter`` and ``masked_select`` without a gather (NOTE [A masked cell's number in
row-major order] in ``shardsci/tensor/_ops/_masked_ops.py``), against one process in float64
under ``gather_policy("error")``: values, every gradient, the output's layout, and the bytes
each rank receives (``count_traffic``), on 2 ranks, 4 ranks with an empty shard, 2x2 and
2x2x2 meshes, with a whole mask and with a mask sharded like the field; a selection across
2-D blocks moves its cells (more cases in ``test_masked_select_blocks``)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

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
from tests.expected_layouts import parse

ROWS = Layout((Shard(0),), {0: (2, 3)})
ROWS_EMPTY = Layout((Shard(0),), {0: (0, 3, 2, 0)})
BLOCKS = Layout((Shard(0), Shard(1)), {0: (2, 3), 1: (3, 1)})
VOLUME = Layout((Shard(0), Shard(1), Shard(2)), {0: (1, 2), 1: (3, 1), 2: (0, 3)})
ROWS_NESTED = Layout((Shard(0), Shard(0)), {0: (1, 0, 2, 2)}, {0: (1, 0)})
ROWS_ONE_AXIS = Layout((Shard(0), Replicate()), {0: (2, 3)})


def _scatter(x, mask, source):
    return x.masked_scatter(mask, source)


def _scatter_own(x, source):  # the mask computed from the field: sharded like it
    return x.masked_scatter(x > 0, source)


def _select(x, mask):
    return x.masked_select(mask) * 2


def _select_own(x):
    return x.masked_select(x > 0).exp()


def _scatter_selection(x, y):  # the source split into each block's run: read where it is
    return x.masked_scatter(x > 0, y.masked_select(x > 0) * 2)


# name -> (mesh, fn, shapes ("mask": a random mask of the field's shape), layouts (None: a
# plain tensor))
CASES = {
    "2r-scatter-whole-mask": ((2,), _scatter, [(5, 4), "mask", (20,)], [ROWS, None, None]),
    "2r-scatter-own-mask": ((2,), _scatter_own, [(5, 4), (20,)], [ROWS, None]),
    "4r-empty-scatter-whole-mask": (
        (4,),
        _scatter,
        [(5, 4), "mask", (4, 5)],
        [ROWS_EMPTY, None, None],
    ),
    "2x2-scatter-whole-mask": ((2, 2), _scatter, [(5, 4), "mask", (20,)], [BLOCKS, None, None]),
    "2x2x2-scatter-whole-mask": (
        (2, 2, 2),
        _scatter,
        [(3, 4, 3), "mask", (40,)],
        [VOLUME, None, None],
    ),
    "2x2-scatter-nested-own-mask": ((2, 2), _scatter_own, [(5, 4), (20,)], [ROWS_NESTED, None]),
    "2r-scatter-broadcast-input": (
        (2,),
        _scatter,
        [(4,), "mask", (20,)],
        [Layout((Shard(0),), {0: (1, 3)}), None, None],
    ),
    "2r-scatter-selection": ((2,), _scatter_selection, [(5, 4), (5, 4)], [ROWS, ROWS]),
    "4r-empty-scatter-selection": (
        (4,),
        _scatter_selection,
        [(5, 4), (5, 4)],
        [ROWS_EMPTY, ROWS_EMPTY],
    ),
    "2r-select-whole-mask": ((2,), _select, [(5, 4), "mask"], [ROWS, None]),
    "2r-select-own-mask": ((2,), _select_own, [(5, 4)], [ROWS]),
    "4r-empty-select-own-mask": ((4,), _select_own, [(5, 4)], [ROWS_EMPTY]),
    "2x2-select-nested-own-mask": ((2, 2), _select_own, [(5, 4)], [ROWS_NESTED]),
    "2x2-select-rows-replicated": (
        (2, 2),
        _select,
        [(5, 4), "mask"],
        [ROWS_ONE_AXIS, None],
    ),
}
# All-gathers of one count per rank (a mask sharded like the field) in the forward and in the
# backward of the sharded inputs; none elsewhere.
COUNTS_GATHERED = {
    "2r-scatter-own-mask": (1, 0),
    "2x2-scatter-nested-own-mask": (1, 0),
    "2r-scatter-selection": (2, 2),  # backward: the source's run, the selection's scatter
    "4r-empty-scatter-selection": (2, 2),
    "2r-select-own-mask": (1, 1),  # backward: the selection's scatter into the field
    "4r-empty-select-own-mask": (1, 1),
    "2x2-select-nested-own-mask": (1, 1),
}


def _inputs(shapes, mask_shape):
    torch.manual_seed(0)
    out = []
    for shape in shapes:
        if shape == "mask":
            out.append(torch.rand(mask_shape) > 0.4)
        else:
            out.append(torch.randn(shape, dtype=torch.float64))
    return out


def _selected_layout(name, mesh_shape, x, mask, layout):
    """The stated layout of a selection: dim 0 split into each block's count, rank order."""
    spec = layout.spec(get_mesh(mesh_shape), x)
    (s,) = spec.shardings
    starts = [sum(s.sizes[:k]) for k in range(len(s.sizes))]
    counts = tuple(int(mask.narrow(s.dim, o, n).sum()) for o, n in zip(starts, s.sizes))
    placements = tuple(Shard(0) if a in s.axes else p for a, p in enumerate(spec.placements))
    return Layout(placements, {0: counts}, {0: s.axes})


def _body(name: str) -> None:
    mesh_shape, fn, shapes, layouts = CASES[name]
    mesh = get_mesh(mesh_shape)
    x_shape = shapes[0]
    mask_shape = (5, 4) if len(x_shape) == 1 else x_shape
    inputs = _inputs(shapes, mask_shape)
    x = inputs[0]
    if "-select-" in name:
        mask = inputs[1] if len(inputs) > 1 else x > 0
        expected = [_selected_layout(name, mesh_shape, x, mask, layouts[0])]
    elif "broadcast" in name:
        expected = [parse("S1; 1=1/3")]
    else:
        expected = None
    with gather_policy("error"):
        check_against_reference(fn, inputs, layouts, mesh, out_layouts=expected, what=name)
    args = []
    for t, layout in zip(inputs, layouts):
        if layout is None:
            args.append(t)
            continue
        spec = layout.spec(mesh, t)
        args.append(from_local_spec(spec.narrow(t).contiguous(), spec).requires_grad_())
    with gather_policy("error"), count_traffic() as forward:
        out = fn(*args)
    sharded = [t for t, layout in zip(args, layouts) if layout is not None]
    with gather_policy("error"), count_traffic() as backward:
        torch.autograd.grad(out.to_local().sum(), sharded)
    rounds_forward, rounds_backward = COUNTS_GATHERED.get(name, (0, 0))
    one_round = 8 * (math.prod(mesh_shape) - 1)  # one int64 from each other rank
    allowed, allowed_back = rounds_forward * one_round, rounds_backward * one_round
    assert_all_ranks(
        forward.received <= allowed and backward.received <= allowed_back,
        f"{name}: received {forward.received} B forward (at most {allowed}), "
        f"{backward.received} B backward (at most {allowed_back})",
    )


@pytest.mark.parametrize("name", list(CASES))
def test_masked_ops_keep_the_layout(name: str) -> None:
    run_on_ranks(math.prod(CASES[name][0]), _body, name)


def _interleaved_body() -> None:
    mesh = get_mesh((2, 2))
    torch.manual_seed(0)
    x = torch.randn(5, 4, dtype=torch.float64)
    spec = BLOCKS.spec(mesh, x)
    counts = [int(spec.narrow(x > 0, [i, j]).sum()) for i in range(2) for j in range(2)]
    check_against_reference(
        _select_own,
        [x],
        [BLOCKS],
        mesh,
        out_layouts=[parse("S0,S0; 0=" + "/".join(map(str, counts)))],
        # at 5 x 4 the row counts and the cells' numbers outweigh the field: bytes against the
        # fallback at 64 x 64 in test_masked_select_blocks
        not_a_gather="the row counts and numbers of a tiny field",
    )


def test_a_selection_interleaving_blocks_moves_cells_not_the_field() -> None:
    """On 2-D blocks the ranks' selections interleave in the output: each selected cell moves
    to its place in an output split over both axes, each rank's part as long as its selection
    (NOTE [A selection across blocks moves each cell to its place]); nothing gathered."""
    run_on_ranks(4, _interleaved_body)


def _short_source_body() -> str:
    mesh = get_mesh((2,))
    x = torch.randn(5, 4, dtype=torch.float64)
    spec = ROWS.spec(mesh, x)
    shard = from_local_spec(spec.narrow(x).contiguous(), spec)
    try:
        shard.masked_scatter(torch.ones(5, 4, dtype=torch.bool), torch.zeros(19, dtype=x.dtype))
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_a_short_source_is_torchs_error_on_every_rank() -> None:
    """The count is known to every rank before anything moves: each raises torch's error."""
    messages = run_on_ranks(2, _short_source_body)
    assert messages == ["Number of elements of source < number of ones in mask"] * 2
