"""Inputs at the edge of what a handler takes: torch's result in the input's layout, or
torch's error on every rank, never an error of the handler's own. Against one process in
float64, values, gradients and the output's layout where there is a result.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from shardsci import gather_policy
from shardsci.tensor._api import from_local_spec
from shardsci.testing import (
    Layout,
    assert_raises_all_ranks,
    check_against_reference,
    get_mesh,
    run_on_ranks,
)


def _sharded_bias_body() -> None:
    mesh = get_mesh((2,))
    x = torch.randn(2, 3, 7, 5, dtype=torch.float64)
    bias = torch.randn(4, dtype=torch.float64)
    weight = torch.randn(4, 3, 3, 3, dtype=torch.float64)
    field, channels = Layout((Shard(2),), {2: (5, 2)}), Layout((Shard(0),), {0: (1, 3)})
    for name, fn in {
        "conv": lambda a, b: F.conv2d(a, weight, b, padding=1),
        "conv-transpose": lambda a, b: F.conv_transpose2d(a, weight.transpose(0, 1), b, padding=1),
    }.items():
        with gather_policy("allow"):  # the bias made whole, as the test states
            check_against_reference(
                fn, [x, bias], [field, channels], mesh, out_layouts=[field], what=name
            )


def test_sharded_conv_bias_keeps_the_layout() -> None:
    """A bias sharded over its channels is made whole (a few numbers) and the output keeps
    the input's layout (it raised from the handler; declined, the output was Replicate)."""
    run_on_ranks(2, _sharded_bias_body)


def _zero_dim_body() -> None:
    mesh = get_mesh((2,))
    x = torch.tensor(3.0, dtype=torch.float64)
    spec = Layout((Replicate(),)).spec(mesh, x)
    sharded = from_local_spec(x.clone(), spec)
    for op in (lambda t: torch.select(t, 0, 0), lambda t: torch.narrow(t, 0, 0, 1)):
        try:
            op(x)
        except (IndexError, RuntimeError) as error:
            expected = error
        assert_raises_all_ranks(type(expected), re.escape(str(expected)), op, sharded)


def test_zero_dim_slice_and_select_raise_torchs_error() -> None:
    """Slicing or selecting a 0-d tensor raises torch's error on every rank (it raised
    ZeroDivisionError)."""
    run_on_ranks(2, _zero_dim_body)


def _empty_batch_einsum_body() -> None:
    mesh = get_mesh((2,))
    on_w = Layout((Shard(3),), {3: (3, 1)})
    empty = torch.randn(0, 3, 6, 4, dtype=torch.float64)
    weight = torch.randn(3, 2, 6, 4, dtype=torch.float64)
    one = torch.randn(1, 3, 6, 4, dtype=torch.float64)
    check_against_reference(
        lambda a, w: torch.einsum("bixy,ioxy->boxy", a, w),
        [empty, weight],
        [on_w, None],
        mesh,
        out_layouts=[on_w],
        what="an FNO's mode mixing of an empty batch",
    )
    check_against_reference(
        lambda a, b: torch.einsum("bixy,bixy->bxy", a, b),
        [one, empty],
        [on_w, on_w],
        mesh,
        out_layouts=[Layout((Shard(2),), {2: (3, 1)})],
        what="a batch of 1 broadcast against an empty one",
    )


def test_an_empty_batch_stays_empty_through_einsum() -> None:
    """A letter of extent 0 in one operand, absent or of extent 1 in the others, is 0 in the
    output (a data-parallel replica with no held-out sample: the output said 1)."""
    run_on_ranks(2, _empty_batch_einsum_body)
