"""A reduction over a dim one rank holds whole stays with that rank, and what meets it again
(a normalisation, a centring, softmax, var, logsumexp, their backward) runs on that rank too
(NOTE [A sum over a dim one rank holds stays with that rank] in
``shardsci/tensor/_ops/_common.py``, NOTE [A pointwise op on held operands runs on their holder]
in ``shardsci/tensor/_propagation.py``), against one process in float64 under
``gather_policy("error")``: values, every gradient, the output's layout, and no byte received
in the forward or the backward (``count_traffic``), on 2 ranks (6/0), 4 ranks with the holder
between empty shards (``median``/``nanmedian``/``masked.median`` too, by torch's kernel on the
holder), a 2x2 and a 2x2x2 mesh (Transolver's slice weights: the slices held by
one rank of the third axis).

Before: the sum was a pending sum over the held dim's axes; the op meeting it all-reduced it
(the output's bytes), a statistic of extent 1 met by its input was replicated, and the sum's
backward (``expand``) replicated the gradient."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import Shard

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

ROWS_HELD = Layout((Shard(0),), {0: (6, 0)})
EMPTY_AROUND = Layout((Shard(0),), {0: (0, 6, 0, 0)})
COLUMNS_AMONG_EMPTIES = Layout((Shard(1),), {1: (0, 6, 0, 0)})
COLUMNS_HELD_2X2 = Layout((Shard(0), Shard(1)), {0: (2, 2), 1: (6, 0)})
EMPTY_ROW_2X2 = Layout((Shard(0), Shard(1)), {0: (4, 0), 1: (3, 3)})


def _normalised(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t / t.sum(dim, keepdim=True)


def _softmax_by_hand(t: torch.Tensor, dim: int) -> torch.Tensor:
    e = (t - t.amax(dim, keepdim=True)).exp()
    return e / e.sum(dim, keepdim=True)


def _slice_tokens(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Transolver's slice tokens: slice weights (points, slices) normalised over the slices,
    the field (points, channels) averaged into each slice."""
    w = torch.softmax(w, -1)
    return torch.einsum("nm,nc->mc", w, x) / (w.sum(0)[:, None] + 1e-5)


# name -> (mesh, fn, input shapes, input layouts, output layout)
CASES = {
    "2r-sum": ((2,), lambda t: t.sum(0), [(6, 4)], [ROWS_HELD], parse("S0; 0=4/0")),
    "2r-sum-keepdim": (
        (2,),
        lambda t: t.sum(0, keepdim=True) * 2,
        [(6, 4)],
        [ROWS_HELD],
        parse("S0; 0=1/0"),
    ),
    "2r-normalised": ((2,), lambda t: _normalised(t, 0), [(6, 4)], [ROWS_HELD], None),
    "2r-centred": ((2,), lambda t: t - t.mean(0, keepdim=True), [(6, 4)], [ROWS_HELD], None),
    "2r-softmax-by-hand": ((2,), lambda t: _softmax_by_hand(t, 0), [(6, 4)], [ROWS_HELD], None),
    "2r-softmax": ((2,), lambda t: torch.softmax(t, 0), [(6, 4)], [ROWS_HELD], None),
    "2r-var": ((2,), lambda t: t.var(0), [(6, 4)], [ROWS_HELD], parse("S0; 0=4/0")),
    "2r-logsumexp": ((2,), lambda t: t.logsumexp(0), [(6, 4)], [ROWS_HELD], parse("S0; 0=4/0")),
    "4r-empty-normalised": (
        (4,),
        lambda t: _normalised(t, 0),
        [(6, 4)],
        [Layout((Shard(0),), {0: (0, 6, 0, 0)})],
        None,
    ),
    "2x2-normalised": (  # axis 0 splits the rows, axis 1 holds the columns
        (2, 2),
        lambda t: _normalised(t, 1),
        [(4, 6)],
        [Layout((Shard(0), Shard(1)), {0: (2, 2), 1: (6, 0)})],
        None,
    ),
    "2x2-sum": (  # the held axis nested outermost over the rows' split
        (2, 2),
        lambda t: t.sum(1),
        [(4, 6)],
        [Layout((Shard(0), Shard(1)), {0: (2, 2), 1: (6, 0)})],
        parse("S0,S0; 0[1,0]=2/2/0/0"),
    ),
    "2x2x2-softmax-by-hand": (
        (2, 2, 2),
        lambda t: _softmax_by_hand(t, 2),
        [(2, 3, 6)],
        [Layout((Shard(0), Shard(1), Shard(2)), {0: (1, 1), 1: (1, 2), 2: (0, 6)})],
        None,
    ),
    "2r-max-dim": (
        (2,),
        lambda t: tuple(t.max(0)),
        [(6, 4)],
        [ROWS_HELD],
        [parse("S0; 0=4/0")] * 2,
    ),
    "2r-min-dim-keepdim": (
        (2,),
        lambda t: tuple(t.min(0, keepdim=True)),
        [(6, 4)],
        [ROWS_HELD],
        [parse("S0; 0=1/0")] * 2,
    ),
    "4r-empty-max-dim": (
        (4,),
        lambda t: tuple(t.max(0)),
        [(6, 4)],
        [Layout((Shard(0),), {0: (0, 6, 0, 0)})],
        [parse("S0; 0=0/4/0/0")] * 2,
    ),
    "2x2-max-dim": (
        (2, 2),
        lambda t: tuple(t.max(1)),
        [(4, 6)],
        [Layout((Shard(0), Shard(1)), {0: (2, 2), 1: (6, 0)})],
        [parse("S0,S0; 0[1,0]=2/2/0/0")] * 2,
    ),
    "2r-median-dim": (
        (2,),
        lambda t: tuple(t.median(0)),
        [(6, 4)],
        [ROWS_HELD],
        [parse("S0; 0=4/0")] * 2,
    ),
    "4r-empty-nanmedian-1d-keepdim": (
        (4,),
        lambda t: tuple(t.nanmedian(0, keepdim=True)),
        [(6,)],
        [EMPTY_AROUND],
        [parse("S0; 0=0/1/0/0")] * 2,
    ),
    "2x2-median-dim": (
        (2, 2),
        lambda t: tuple(t.median(1)),
        [(4, 6)],
        [COLUMNS_HELD_2X2],
        [parse("S0,S0; 0[1,0]=2/2/0/0")] * 2,
    ),
    "4r-empty-masked-median": (
        (4,),
        lambda t: torch.masked.median(t, 0, mask=t > -1),
        [(6, 4)],
        [EMPTY_AROUND],
        parse("S0; 0=0/4/0/0"),
    ),
    "2r-argmax": ((2,), lambda t: t.argmax(0), [(6, 4)], [ROWS_HELD], parse("S0; 0=4/0")),
    "4r-empty-argmin-keepdim": (
        (4,),
        lambda t: t.argmin(0, keepdim=True),
        [(6, 4)],
        [EMPTY_AROUND],
        parse("S0; 0=0/1/0/0"),
    ),
    "2x2-argmax": (
        (2, 2),
        lambda t: t.argmax(1),
        [(4, 6)],
        [COLUMNS_HELD_2X2],
        parse("S0,S0; 0[1,0]=2/2/0/0"),
    ),
    "2x2-empty-row-argmin": (  # axis 0 holds the rows, its second row of blocks empty
        (2, 2),
        lambda t: t.argmin(0),
        [(4, 6)],
        [EMPTY_ROW_2X2],
        parse("S0,S0; 0[0,1]=3/3/0/0"),
    ),
    "4r-empty-masked-argmax-keepdim": (
        (4,),
        lambda t: torch.masked.argmax(t, 0, keepdim=True, mask=t > -1),
        [(6, 4)],
        [EMPTY_AROUND],
        parse("S0; 0=0/1/0/0"),
    ),
    "2r-norm": (
        (2,),
        lambda t: torch.linalg.vector_norm(t, 2, 0),
        [(6, 4)],
        [ROWS_HELD],
        parse("S0; 0=4/0"),
    ),
    "4r-empty-norm-p3-keepdim": (
        (4,),
        lambda t: t.norm(p=3, dim=0, keepdim=True),
        [(6, 4)],
        [EMPTY_AROUND],
        parse("S0; 0=0/1/0/0"),
    ),
    "4r-empty-norm-inf": (
        (4,),
        lambda t: torch.linalg.vector_norm(t, math.inf, 0),
        [(6, 4)],
        [EMPTY_AROUND],
        parse("S0; 0=0/4/0/0"),
    ),
    "4r-empty-norm-neg": (
        (4,),
        lambda t: torch.linalg.vector_norm(t, -1.5, 0),
        [(6, 4)],
        [EMPTY_AROUND],
        parse("S0; 0=0/4/0/0"),
    ),
    "2x2-norm": (
        (2, 2),
        lambda t: torch.linalg.vector_norm(t, 1, 1),
        [(4, 6)],
        [COLUMNS_HELD_2X2],
        parse("S0,S0; 0[1,0]=2/2/0/0"),
    ),
    "2x2-empty-row-masked-norm": (
        (2, 2),
        lambda t: torch.masked.norm(t, 2.0, 0, mask=t > -1),
        [(4, 6)],
        [EMPTY_ROW_2X2],
        parse("S0,S0; 0[0,1]=3/3/0/0"),
    ),
    "4r-empty-pairwise-distance": (
        (4,),
        lambda a, b: torch.nn.functional.pairwise_distance(a, b, keepdim=True),
        [(4, 6), (4, 6)],
        [COLUMNS_AMONG_EMPTIES] * 2,
        parse("S1; 1=0/1/0/0"),
    ),
    "2r-prod": ((2,), lambda t: t.prod(0), [(6, 4)], [ROWS_HELD], parse("S0; 0=4/0")),
    "4r-empty-masked-prod-keepdim": (
        (4,),
        lambda t: torch.masked.prod(t, 0, keepdim=True, mask=t > -1),
        [(6, 4)],
        [EMPTY_AROUND],
        parse("S0; 0=0/1/0/0"),
    ),
    "2x2-empty-row-prod": (
        (2, 2),
        lambda t: t.prod(0),
        [(4, 6)],
        [EMPTY_ROW_2X2],
        parse("S0,S0; 0[0,1]=3/3/0/0"),
    ),
    "2r-slice-tokens": (
        (2,),
        _slice_tokens,
        [(6, 3), (6, 4)],
        [ROWS_HELD, ROWS_HELD],
        parse("S0; 0=3/0"),
    ),
}


def _body(name: str) -> None:
    mesh_shape, fn, shapes, layouts, expected = CASES[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    inputs = [torch.randn(shape, dtype=torch.float64) for shape in shapes]
    out_layouts = (
        None if expected is None else expected if isinstance(expected, list) else [expected]
    )
    with gather_policy("error"):
        check_against_reference(fn, inputs, layouts, mesh, out_layouts=out_layouts, what=name)
    shards = []
    for t, layout in zip(inputs, layouts):
        spec = layout.spec(mesh, t)
        shards.append(from_local_spec(spec.narrow(t).contiguous(), spec).requires_grad_())
    with gather_policy("allow"), count_traffic() as forward:
        out = fn(*shards)
    with gather_policy("allow"), count_traffic() as backward:
        values = out[0] if isinstance(out, tuple) else out
        if values.requires_grad:
            torch.autograd.grad(values.to_local().sum(), shards)
    assert_all_ranks(
        forward.received == 0 and backward.received == 0,
        f"{name}: received {forward.received} B forward, {backward.received} B backward",
    )


@pytest.mark.parametrize("name", list(CASES))
def test_a_reduction_over_a_held_dim_stays_on_its_holder(name: str) -> None:
    run_on_ranks(math.prod(CASES[name][0]), _body, name)
