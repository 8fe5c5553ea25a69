"""Gathered ops (``_gathered_ops``) on sharded inputs against one process, float64: values, the
gradients and the documented replicated output, on uneven rows, columns with an empty shard and
2x2 blocks. Two of them see how the gathered field lies in memory: ``as_strided`` (and its copy
and scatter, with a storage offset) and ``pdist`` (which requires a contiguous input). The rank
holding an empty shard of the columns received the field with transposed strides, so it read
other cells than one process (``as_strided``) or raised alone and left the others waiting
(``pdist``)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from shardsci import gather_policy
from shardsci.testing import Layout, check_against_reference, get_mesh, run_on_ranks

LAYOUTS = {  # of a (3, 3) input
    "2r-rows-uneven": ((2,), Layout((Shard(0),), {0: (2, 1)})),
    "4r-columns-empty": ((4,), Layout((Shard(1),), {1: (1, 0, 1, 1)})),
    "2x2-blocks": ((2, 2), Layout((Shard(0), Shard(1)), {0: (1, 2), 1: (2, 1)})),
}
CALLS = {
    "as_strided": lambda x, s: x.as_strided((2, 2), (1, 2), 1),
    "as_strided_copy": lambda x, s: torch.as_strided_copy(x, (2, 2), (1, 2), 2),
    "as_strided_scatter": lambda x, s: torch.as_strided_scatter(x, s, (2, 2), (1, 2), 1),
    "pdist": lambda x, s: torch.nn.functional.pdist(x),
}


def _body(name: str) -> None:
    mesh_shape, layout = LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x, source = torch.randn(3, 3, dtype=torch.float64), torch.randn(2, 2, dtype=torch.float64)
    replicated = Layout((Replicate(),) * len(mesh_shape))
    for what, fn in CALLS.items():
        with gather_policy("allow"):  # each a gathered op (``_gathered_ops``), by design
            check_against_reference(
                fn, [x, source], [layout, None], mesh, out_layouts=[replicated],
                not_a_gather="addresses the whole tensor's storage: a gathered op",
                what=f"{name}: {what}",
            )  # fmt: skip


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gathered_ops_equal_one_process(name: str) -> None:
    run_on_ranks(math.prod(LAYOUTS[name][0]), _body, name)
