"""A ShardTensor written into a plain tensor (NOTE [A ShardTensor written into a plain tensor]),
against one process, float64, under ``"error"`` (nothing gathered unasked, forward or
backward): ``buffer[key] = x`` with basic keys on split and whole dims and an index tensor, and
``buffer.copy_(x)`` broadcasting, on 2 ranks uneven, 4 ranks with an empty shard and 2x2
blocks. The buffer stays plain and holds on every rank what one process holds; the gradient of
``x`` (through the buffer) is one process's, in ``x``'s layout. Then the pattern of
neuraloperator's ``SpectralConv`` (a value written into ``torch.zeros``, read by plain ops,
added back to ``x``): values, gradients and the output in ``x``'s layout
(``check_against_reference``).

Before, torch's ``copy_`` below autograd wrote the value whole and its backward built the
value's gradient whole, which ``from_local``'s backward reported (``tests/third_party``
``uno-empty`` and ``uno-2x2`` raised ``GatherWarning``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch.distributed.tensor import Shard

from shardsci import gather_policy
from shardsci.handlers import from_local_spec
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    assert_close_all_ranks,
    check_against_reference,
    get_mesh,
    run_on_ranks,
)

SHAPE = (2, 3, 6, 5)
LAYOUTS = {  # of a SHAPE input
    "2r-uneven": ((2,), Layout((Shard(2),), {2: (4, 2)})),
    "4r-empty": ((4,), Layout((Shard(2),), {2: (2, 0, 3, 1)})),
    "2x2-blocks": ((2, 2), Layout((Shard(2), Shard(3)), {2: (4, 2), 3: (2, 3)})),
}


def _slice_on_whole_dims(x: torch.Tensor) -> torch.Tensor:
    buffer = torch.zeros(2, 4, 6, 5, dtype=x.dtype)
    buffer[:, 1:] = 2 * x
    return buffer


def _slice_on_split_dims(x: torch.Tensor) -> torch.Tensor:
    buffer = torch.zeros(2, 3, 8, 7, dtype=x.dtype)
    buffer[..., 1:7, :5] = x
    return buffer


def _part_of_the_value(x: torch.Tensor) -> torch.Tensor:
    buffer = torch.ones(2, 3, 3, 5, dtype=x.dtype)
    buffer[:, :, 1:] = x[:, :, 2:4].sin()
    return buffer


def _index_tensor(x: torch.Tensor) -> torch.Tensor:
    buffer = torch.zeros(2, 5, 6, 5, dtype=x.dtype)
    buffer[:, torch.tensor([4, 0, 2])] = x * x
    return buffer


def _copy_broadcast(x: torch.Tensor) -> torch.Tensor:
    buffer = torch.empty(2, 2, 3, 6, 5, dtype=x.dtype)
    buffer.copy_(x.exp())
    return buffer


WRITES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "slice-on-whole-dims": _slice_on_whole_dims,
    "slice-on-split-dims": _slice_on_split_dims,
    "part-of-the-value": _part_of_the_value,
    "index-tensor": _index_tensor,
    "copy-broadcast": _copy_broadcast,
}


def _spectral_pattern(x: torch.Tensor) -> torch.Tensor:
    """neuraloperator's ``SpectralConv``: modes written into plain zeros, transformed back by
    plain ops, added to ``x``."""
    spectrum = torch.fft.rfft2(x)
    out = torch.zeros(2, 3, 6, 3, dtype=spectrum.dtype)
    out[:, :, :2, :2] = spectrum[:, :, :2, :2] * 1.5
    return x + torch.fft.irfft2(out, s=(6, 5))


def _body(name: str) -> None:
    mesh_shape, layout = LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(SHAPE, dtype=torch.float64)
    spec = layout.spec(mesh, x)
    with gather_policy("error"):
        for write_name, write in WRITES.items():
            what = f"{name}, {write_name}"
            reference = x.clone().requires_grad_(True)
            expected = write(reference)
            weight = torch.randn(expected.shape, dtype=torch.float64)
            (expected * weight).sum().backward()

            leaf = spec.narrow(x).clone().requires_grad_(True)
            buffer = write(from_local_spec(leaf, spec))
            assert_all_ranks(
                type(buffer) is torch.Tensor, f"{what}: a {type(buffer).__name__}, not plain"
            )
            assert_close_all_ranks(buffer, expected, atol=1e-12, rtol=1e-12, what=what)
            (buffer * weight).sum().backward()
            assert_close_all_ranks(
                leaf.grad, spec.narrow(reference.grad), atol=1e-12, rtol=1e-12,
                what=f"{what}: the gradient",
            )  # fmt: skip
        check_against_reference(
            _spectral_pattern, [x], [layout], mesh, out_layouts=[layout],
            not_a_gather="the spectrum is written whole into a plain buffer, as asked",
            what=f"{name}, spectral pattern",
        )  # fmt: skip


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_shardtensor_written_into_a_plain_tensor_is_written_whole(name: str) -> None:
    run_on_ranks(math.prod(LAYOUTS[name][0]), _body, name)
