"""The backward of aten-level gathers through a replicated index allocates no whole field.

torch's backward of ``x[idx]`` (aten ``index``: list keys, an ellipsis before the index, a
decomposed call), of ``gather`` and ``take_along_dim`` makes ``grad.new_zeros(x.shape)`` and
scatters the gradient into it. On a tensor sharded along a dim the index keeps, every rank
used to allocate that whole zero field (DTensor replicates a new tensor of another shape).
Per rank, against one process in float64: the largest allocation the profiler records during
the backward (not a count the library keeps) is below the whole tensor's bytes, the input's
gradient equals one process's and has the input's layout (placements and shard sizes).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import Shard
from torch.profiler import ProfilerActivity, profile

from shardsci.handlers import from_local_spec
from shardsci.testing import Layout, assert_all_ranks, get_mesh, run_on_ranks

aten = torch.ops.aten

SHAPE = (12, 40, 6)
LAYOUTS = {
    "2r-uneven": ((2,), Layout((Shard(1),), {1: (15, 25)})),
    "4r-empty": ((4,), Layout((Shard(1),), {1: (10, 0, 18, 12)})),
    "2x2-uneven": ((2, 2), Layout((Shard(1), Shard(2)), {1: (25, 15), 2: (2, 4)})),
}


def _cases() -> dict[str, object]:
    generator = torch.Generator().manual_seed(7)
    near = torch.arange(SHAPE[1]).reshape(1, -1, 1) + torch.randint(
        -1, 2, SHAPE, generator=generator
    )
    near = near.clamp(0, SHAPE[1] - 1)  # each cell reads its own row or a neighbour
    rows0 = torch.tensor([1, 3, 3])
    swapped = torch.arange(SHAPE[1]).reshape(-1, 2).flip(1).reshape(-1)  # 1, 0, 3, 2, ...
    return {
        "x[[1, 3]], a list key": lambda x: x[[1, 3]],
        "x[..., i, :, :], an ellipsis first": lambda x: x[..., rows0, :, :],
        "aten index along dim 0": lambda x: aten.index.Tensor(x, [rows0]),
        "x[..., swapped, :], along the split dim": lambda x: x[..., swapped, :],
        "aten index_select, along the split dim": lambda x: aten.index_select.default(
            x, 1, swapped
        ),
        "aten gather, a near index": lambda x: aten.gather.default(x, 1, near),
        "take_along_dim, a near index": lambda x: torch.take_along_dim(x, near, 1),
    }


def _largest_allocation(out: torch.Tensor, grad: torch.Tensor) -> int:
    """The largest single allocation ``torch.profiler`` records while ``out.backward(grad)``
    runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out.backward(grad)
    events = prof.profiler.kineto_results.events()
    return max((e.nbytes() for e in events if e.name() == "[memory]"), default=0)


def _body(name: str) -> None:
    mesh_shape, layout = LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(*SHAPE, dtype=torch.float64)
    whole = x.numel() * x.element_size()
    spec = layout.spec(mesh, x)
    for what, fn in _cases().items():
        reference = x.detach().requires_grad_()
        out = fn(reference)
        weights = torch.randn(
            out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
        )
        out.backward(weights)
        leaf = from_local_spec(spec.narrow(x).contiguous(), spec).requires_grad_()
        out = fn(leaf)
        grad_out = from_local_spec(out._spec.narrow(weights).contiguous(), out._spec)
        largest = _largest_allocation(out, grad_out)
        label = f"{name}: {what}"
        assert_all_ranks(
            largest < whole,
            f"{label}: the backward allocated {largest} bytes at once, the whole input is {whole}",
        )
        grad = leaf.grad
        assert_all_ranks(
            grad._spec.same_layout(spec),
            f"{label}: the gradient is laid out {grad._spec}, the input {spec}",
        )
        assert_all_ranks(
            torch.allclose(grad.to_local(), spec.narrow(reference.grad), atol=1e-12, rtol=1e-12),
            f"{label}: the gradient differs from one process's",
        )


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_backward_of_an_aten_gather_allocates_no_whole_field(name: str) -> None:
    run_on_ranks(math.prod(LAYOUTS[name][0]), _body, name)
