"""An in-place op on the output of a view op (a view on one process) is never lost on a
ShardTensor (NOTE [A write into a view that is a copy] in ``shardsci/tensor/_copies.py``):
each write either reaches the field, equal to one process in float64 (values, gradients,
layout), or raises one clear error on every rank naming the write and the op that copied.
Swept over the view ops that return a copy on a split dim (``diagonal``, ``unfold``,
``as_strided``, ``narrow``, ``t``/``permute``, ``view``/``reshape``/``flatten`` across a split
dim, ``unbind``, ``split``/``chunk``, ``squeeze`` of a one-cell split, ``conj``, ``.real``/
``.imag``, views of a select's copy) on 2 uneven ranks, 4 ranks with an empty shard and 2x2
blocks. Before, the writes through a view, reshape or flatten across a split dim, ``unfold``,
``as_strided``, a gathered ``unbind`` or ``squeeze``, ``conj`` and views of a select's copy
were silently lost."""

from __future__ import annotations

import math

import pytest
import torch

from shardsci.handlers import from_local_spec
from shardsci.testing import (
    assert_all_ranks,
    check_against_reference,
    count_traffic,
    get_mesh,
    run_on_ranks,
)
from tests.expected_layouts import parse
from tests.stated_gathers import allowed_if

SHAPE = (6, 7)
LAYOUTS = {
    "2r-uneven": ((2,), "S1; 1=2/5"),
    "2r-rows": ((2,), "S0; 0=4/2"),
    "4r-empty": ((4,), "S1; 1=0/3/2/2"),
    "2x2-blocks": ((2, 2), "S0,S1; 0=4/2; 1=5/2"),
}

#: name -> an in-place op on a view of ``v`` (real, (6, 7)) and a plain ``g`` of shape (6,)
REAL = {
    "u.diagonal().mul_(2)": lambda v, g: v.diagonal().mul_(2),
    "u.diagonal(1).add_(g)": lambda v, g: v.diagonal(1).add_(g),
    "u.unfold(1, 2, 2).zero_()": lambda v, g: v.unfold(1, 2, 2).zero_(),
    "u.unfold(0, 3, 3)[1].mul_(2)": lambda v, g: v.unfold(0, 3, 3)[1].mul_(2),
    "u.as_strided((3,), (8,)).zero_()": lambda v, g: v.as_strided((3,), (8,)).zero_(),
    "u.narrow(1, 1, 3).mul_(2)": lambda v, g: v.narrow(1, 1, 3).mul_(2),
    "u.t().mul_(2)": lambda v, g: v.t().mul_(2),
    "u.t()[0].add_(g)": lambda v, g: v.t()[0].add_(g),
    "u.permute(1, 0)[2:4].zero_()": lambda v, g: v.permute(1, 0)[2:4].zero_(),
    "u.view(42)[5:9].zero_()": lambda v, g: v.view(42)[5:9].zero_(),
    "u.reshape(2, 3, 7)[1].mul_(2)": lambda v, g: v.reshape(2, 3, 7)[1].mul_(2),
    "u.view(6, 7, 1).mul_(2)": lambda v, g: v.view(6, 7, 1).mul_(2),
    "u.flatten()[3:5].zero_()": lambda v, g: v.flatten()[3:5].zero_(),
    "u[:, 3:4].squeeze(1).add_(g)": lambda v, g: v[:, 3:4].squeeze(1).add_(g),
    "u[:, 2].view(2, 3)[1].zero_()": lambda v, g: v[:, 2].view(2, 3)[1].zero_(),
    "u[:, 1::2][:, 1].add_(g)": lambda v, g: v[:, 1::2][:, 1].add_(g),
}
#: ops returning several views, whose in-place use autograd refuses: values only, no grad
SEVERAL = {
    "u.unbind(1)[0].add_(g)": lambda v, g: v.unbind(1)[0].add_(g),
    "u.unbind(0)[2].mul_(2)": lambda v, g: v.unbind(0)[2].mul_(2),
    "u.split(2, 1)[1].zero_()": lambda v, g: v.split(2, 1)[1].zero_(),
    "u.chunk(3, 0)[1].mul_(2)": lambda v, g: v.chunk(3, 0)[1].mul_(2),
}
#: in-place ops on views of a complex ``v``, values only
COMPLEX = {
    "z.real.zero_()": lambda v: v.real.zero_(),
    "z.imag[:, 2].mul_(2)": lambda v: v.imag[:, 2].mul_(2),
    "view_as_real(z)[..., 0].zero_()": lambda v: torch.view_as_real(v)[..., 0].zero_(),
    "z.conj().mul_(2)": lambda v: v.conj().mul_(2),
}
#: write -> the layouts on which its view op gathers, by design: ``as_strided`` addresses the
#: whole storage (a gathered op). ``unbind`` along a split dim does not: its slices stay with
#: their holders, 2x2 blocks too (NOTE [An unbound slice stays with its holder]), so a write
#: into one is kept
GATHERED = {
    "u.as_strided((3,), (8,)).zero_()": tuple(LAYOUTS),
}
#: layout -> the writes that raise (a copy with no way back); every other one is kept
RAISES = {
    "2r-uneven": {
        "u.unfold(1, 2, 2).zero_()",
        "u.as_strided((3,), (8,)).zero_()",
        "u.view(42)[5:9].zero_()",
        "u.flatten()[3:5].zero_()",
        "z.conj().mul_(2)",
    },
    "2r-rows": {
        "u.unfold(0, 3, 3)[1].mul_(2)",
        "u.as_strided((3,), (8,)).zero_()",
        "u.reshape(2, 3, 7)[1].mul_(2)",
        "u[:, 2].view(2, 3)[1].zero_()",
        "z.conj().mul_(2)",
    },
    "4r-empty": {
        "u.unfold(1, 2, 2).zero_()",
        "u.as_strided((3,), (8,)).zero_()",
        "u.view(42)[5:9].zero_()",
        "u.flatten()[3:5].zero_()",
        "z.conj().mul_(2)",
    },
    "2x2-blocks": {
        "u.unfold(1, 2, 2).zero_()",
        "u.unfold(0, 3, 3)[1].mul_(2)",
        "u.as_strided((3,), (8,)).zero_()",
        "u.view(42)[5:9].zero_()",
        "u.reshape(2, 3, 7)[1].mul_(2)",
        "u.flatten()[3:5].zero_()",
        "u[:, 2].view(2, 3)[1].zero_()",
        "z.conj().mul_(2)",
    },
}


def _in_place(op):
    def write(u: torch.Tensor, *g: torch.Tensor) -> torch.Tensor:
        v = u * 1.0
        op(v, *g)
        return v

    return write


def _outcome(check) -> str:
    try:
        check()
    except NotImplementedError as error:
        message = str(error)
        assert "writes into a tensor that aten." in message and "would be lost" in message, message
        return "raises"
    return "kept"


def _body(name: str) -> dict[str, str]:
    mesh_shape, layout = LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    layout = parse(layout)
    torch.manual_seed(0)
    u = torch.randn(SHAPE, dtype=torch.float64)
    z = torch.randn(SHAPE, dtype=torch.complex128)
    g = torch.randn(6, dtype=torch.float64)
    outcomes = {}
    for what, op in REAL.items():
        with allowed_if(name in GATHERED.get(what, ())):
            outcomes[what] = _outcome(
                lambda op=op, what=what: check_against_reference(
                    _in_place(op), [u, g], [layout, None], mesh, what=f"{name}: {what}"
                )
            )
    for what, op in SEVERAL.items():
        with allowed_if(name in GATHERED.get(what, ())):
            outcomes[what] = _outcome(
                lambda op=op, what=what: check_against_reference(
                    _in_place(op), [u, g], [layout, None], mesh, grad=False, what=f"{name}: {what}"
                )
            )
    for what, op in COMPLEX.items():
        outcomes[what] = _outcome(
            lambda op=op, what=what: check_against_reference(
                _in_place(op), [z], [layout], mesh, grad=False, what=f"{name}: {what}"
            )
        )
    return outcomes


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_write_into_a_view_is_kept_or_refused_on_every_rank(name: str) -> None:
    outcomes = run_on_ranks(math.prod(LAYOUTS[name][0]), _body, name)
    assert all(o == outcomes[0] for o in outcomes), outcomes  # every rank alike
    raised = {what for what, outcome in outcomes[0].items() if outcome == "raises"}
    assert raised == RAISES[name], (sorted(raised - RAISES[name]), sorted(RAISES[name] - raised))


#: writes into views that are views on every rank, known without asking: no byte moves
NO_AGREEMENT = {
    "u[:, 1:4].mul_(2)": lambda v: v[:, 1:4].mul_(2),
    "u[2:4, ::2][:, 1:].add_(1)": lambda v: v[2:4, ::2][:, 1:].add_(1),
    "u.t()[1:3].zero_()": lambda v: v.t()[1:3].zero_(),
    "u.narrow(0, 1, 3)[:, 2:].mul_(2)": lambda v: v.narrow(0, 1, 3)[:, 2:].mul_(2),
}


def _no_agreement_body(name: str) -> None:
    mesh_shape, layout = LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    layout = parse(layout)
    torch.manual_seed(0)
    u = torch.randn(SHAPE, dtype=torch.float64)
    for what, op in NO_AGREEMENT.items():
        shard = layout.spec(mesh, u)
        v = from_local_spec(shard.narrow(u).clone(), shard)
        with count_traffic() as traffic:
            op(v)
        assert_all_ranks(traffic.received == 0, f"{name}: {what}: {traffic.received} B")
        expected = u.clone()
        op(expected)
        assert_all_ranks(torch.equal(v.full_tensor(), expected), f"{name}: {what}: lost")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_write_into_a_slice_or_local_view_asks_no_rank(name: str) -> None:
    """The agreement (one all-reduce) is made only where a handler may have copied: a write
    into slices (of a transpose, of slices) moves nothing."""
    run_on_ranks(math.prod(LAYOUTS[name][0]), _no_agreement_body, name)
