"""Inputs at the edge of what a handler takes: torch's result in the input's layout, or
torch's error on every rank, never an error of the handler's own. Against one process in
float64, values, gradients and the output's layout where there is a result.
"""

from __future__ import annotations

import re

import torch
from torch.distributed.tensor import Replicate

from shardsci.tensor._api import from_local_spec
from shardsci.testing import (
    Layout,
    assert_raises_all_ranks,
    get_mesh,
    run_on_ranks,
)


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
