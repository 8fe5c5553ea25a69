"""Layout memory (NOTE [Shard-size hints] in ``shardsci/tensor/_spec.py``) survives the ops
between a layout change and its inverse, whichever operand carries it, against one process in
float64, forward and gradients, with the output's placements and shard sizes stated.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from shardsci.tensor._api import ShardTensor, from_local_spec
from shardsci.tensor._spec import ShardTensorSpec
from shardsci.testing import Layout, check_against_reference, get_mesh, run_on_ranks
from tests.layouts import Sharded

# (B, C, H, W) fields whose spectral round trip moves the sharded dim and back.
FIELDS = [
    Sharded("2r-W-6/2", (2,), (2, 3, 8, 8), Layout((Shard(3),), {3: (6, 2)})),
    Sharded("2r-H-1/7", (2,), (2, 3, 8, 8), Layout((Shard(2),), {2: (1, 7)})),
    Sharded("4r-W-0/5/1/2", (4,), (2, 3, 8, 8), Layout((Shard(3),), {3: (0, 5, 1, 2)})),
]


def _without_memory(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` laid out as ``like`` but remembering nothing (a weight sharded by the user), or
    ``t`` itself next to a plain ``like``."""
    if not isinstance(like, ShardTensor):
        return t
    s = like._spec
    spec = ShardTensorSpec.build(
        s.mesh, s.placements, s.shape, t.dtype, {d.dim: d.sizes for d in s.shardings}
    )
    return from_local_spec(spec.narrow(t), spec)


def _filter(first: bool):
    def fn(x: torch.Tensor) -> torch.Tensor:
        spectrum = torch.fft.rfftn(x, dim=(-2, -1))
        mask = torch.linspace(0.5, 1.5, spectrum.numel(), dtype=torch.float64)
        mask = _without_memory(mask.reshape(spectrum.shape).to(spectrum.dtype), spectrum)
        product = mask * spectrum if first else spectrum * mask
        return torch.fft.irfftn(product, s=x.shape[-2:], dim=(-2, -1))

    return fn


def _filter_body(case: Sharded) -> None:
    mesh = get_mesh(case.mesh)
    x = torch.randn(case.shape, dtype=torch.float64)
    for first in (True, False):
        check_against_reference(
            _filter(first), [x], [case.layout], mesh, what=f"mask first: {first}"
        )


@pytest.mark.parametrize("case", FIELDS, ids=str)
def test_spectral_filter_returns_to_the_input_layout(case: Sharded) -> None:
    """``irfftn(m * rfftn(x))`` returns ``x``'s layout whichever operand of the product
    remembers it (with the mask first it came back with torch.chunk's sizes)."""
    run_on_ranks(case.world, _filter_body, case)


# ---------------------------------------------------------------------------- unbind, stack
def _moved(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` sharded along ``dim`` over the mesh's one axis (sizes chosen by the library), or
    ``t`` itself when plain."""
    return t.redistribute(t.device_mesh, [Shard(dim)]) if isinstance(t, ShardTensor) else t


def _unbind_then_back(x: torch.Tensor) -> list[torch.Tensor]:
    return [_moved(piece, 0) for piece in _moved(x, 2).unbind(0)]


def _stack_then_back(x: torch.Tensor) -> torch.Tensor:
    return _moved(torch.stack(_moved(x, 2).unbind(0), dim=1), 0)


def _unbind_stack_body() -> None:
    mesh = get_mesh((2,))
    x = torch.randn(3, 8, 6, dtype=torch.float64)
    layout = Layout((Shard(1),), {1: (6, 2)})
    back = Layout((Shard(0),), {0: (6, 2)})
    check_against_reference(
        _unbind_then_back, [x], [layout], mesh, out_layouts=[back] * 3, what="unbind"
    )
    check_against_reference(_stack_then_back, [x], [layout], mesh, out_layouts=[back], what="stack")


def test_unbind_and_stack_renumber_the_layout_memory() -> None:
    """A dim sharded 6/2, moved away, then unbound from (or stacked into) a tensor that loses
    (gains) a dim before it, returns to 6/2 when sharded again (the memory kept the old dim's
    number: torch.chunk's 4/4)."""
    run_on_ranks(2, _unbind_stack_body)
