"""Other libraries see a ShardTensor as a torch tensor (NOTE [Libraries that pick functions by
a tensor's module] in ``shardsci/_array_functions.py``)."""

from __future__ import annotations

import opt_einsum
import pytest
import torch
from torch.distributed.tensor import Shard

from shardsci.testing import Layout, check_against_reference, get_mesh, run_on_ranks
from tests.expected_layouts import parse
from tests.stated_gathers import allowed_if, pending

# (equation, operand shapes, layout of the first operand, layout of the result): a
# batch-sharded linear map, a spectral convolution's mode-wise channel mix sharded along a mode
# dim (complex weights, as in neural-operator code; the result viewed as real), a three-operand
# chain that opt_einsum splits into pairwise contractions, and a contraction over the sharded
# dim (a partial sum, no communication).
CONTRACTIONS = {
    "batch_linear": (
        "bij,jk->bik",
        [(7, 3, 4), (4, 5)],
        Layout((Shard(0),), {0: (5, 2)}),
        parse("S0; 0=5/2"),
    ),
    "spectral_mix": (
        "bixy,ioxy->boxy",
        [(2, 3, 9, 4), (3, 5, 9, 4)],
        Layout((Shard(2),), {2: (2, 7)}),
        parse("S2; 2=2/7"),
    ),
    "chain": (
        "ab,bc,cd->ad",
        [(9, 4), (4, 6), (6, 3)],
        Layout((Shard(0),), {0: (6, 3)}),
        parse("S0; 0=6/3"),
    ),
    "contract_sharded": (
        "ij,jk->ik",
        [(9, 4), (4, 6)],
        Layout((Shard(1),), {1: (1, 3)}),
        parse("P"),
    ),
}


def _operands(shapes: list[tuple[int, ...]], complex_weights: bool) -> list[torch.Tensor]:
    tensors = [torch.randn(s, dtype=torch.float64) for s in shapes]
    if complex_weights:
        tensors = [torch.complex(t, torch.randn_like(t)) for t in tensors]
    return tensors


def _contraction_body(name: str, library: str) -> None:
    equation, shapes, layout, result = CONTRACTIONS[name]
    mesh = get_mesh((2,))
    operands = _operands(shapes, complex_weights=name == "spectral_mix")
    contract = opt_einsum.contract if library == "opt_einsum" else torch.einsum

    def fn(*xs):
        out = contract(equation, *xs)
        return torch.view_as_real(out) if out.is_complex() else out

    layouts = [layout] + [None] * (len(operands) - 1)
    with allowed_if(pending(result)):  # a partial sum, each rank's held whole
        check_against_reference(
            fn, operands, layouts, mesh, out_layouts=[result], what=f"{library} {equation}"
        )


@pytest.mark.parametrize("library", ["opt_einsum", "torch"])
@pytest.mark.parametrize("name", CONTRACTIONS)
def test_contraction_matches_reference(name: str, library: str) -> None:
    run_on_ranks(2, _contraction_body, name, library)


def _idioms_body() -> dict[str, object]:
    from shardsci import ShardTensor

    mesh = get_mesh((2,))
    x = ShardTensor.from_local(torch.randn(3, 4), mesh, [Shard(0)])
    return {
        "isinstance": isinstance(x, torch.Tensor),
        "is_tensor": torch.is_tensor(x),
        "opt_einsum backend": opt_einsum.contract.__globals__["parse_backend"]([x], "auto"),
    }


def test_backend_detection_idioms_see_torch() -> None:
    for seen in run_on_ranks(2, _idioms_body):
        assert seen == {"isinstance": True, "is_tensor": True, "opt_einsum backend": "shardsci"}
