"""A weight used by a handler on shards enters as one autograd node, and its gradient is the
single-device one.

``promoted_local`` (``shardsci/tensor/_promotion.py``) is ``promote_replicated`` followed by
``to_local`` in one node: every use of a weight by a convolution, a norm or a product takes it.
Checked on 2 ranks and 1 rank against one process in float64, with the gradient summed
eagerly (no model wrapper) and through ``domain_parallel``'s gradient sink. On a mesh of one
rank without a sink the weight is its own local operand (NOTE [A mesh of one rank sums
nothing]).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from shardsci import ShardTensor
from shardsci.parallel import domain_parallel
from shardsci.tensor._promotion import promoted_local
from shardsci.testing import assert_all_ranks, get_mesh, run_on_ranks


def _one_node_body() -> bool:
    mesh = get_mesh((torch.distributed.get_world_size(),))
    weight = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    local = promoted_local(weight, mesh, [Partial()])
    (node, _), *_ = local.grad_fn.next_functions
    return node is not None and node.variable is weight


def test_a_promoted_weight_is_one_autograd_node() -> None:
    assert all(run_on_ranks(2, _one_node_body))


class _Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(2, 3, 3, padding=1, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.conv(x))


def _gradient_body(wrapped: bool) -> None:
    world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    x = torch.randn(1, 2, 7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    reference = _Conv()
    (reference(x) ** 2).sum().backward()

    model = _Conv()
    sizes = (4, 3) if world == 2 else (7,)  # uneven rows over 2 ranks
    start = sum(sizes[:rank])
    local = x[:, :, start : start + sizes[rank]].contiguous()
    if wrapped:
        mesh = get_mesh((1, world), ("dp", "domain"))
        model = domain_parallel(model, mesh, dp_axis="dp", domain_axes=["domain"])
        mesh = mesh["domain"]
    else:
        mesh = get_mesh((world,))
    sharded = ShardTensor.from_local(local, mesh, [Shard(2)], {0: sizes})
    out = model(sharded)
    (out * out).sum().full_tensor().backward()
    for name in ("weight", "bias"):
        got, want = getattr(model.conv, name).grad, getattr(reference.conv, name).grad
        assert_all_ranks(
            got is not None and torch.allclose(got, want, rtol=1e-12, atol=1e-12),
            f"{name}'s gradient differs from one process (wrapped={wrapped})",
        )


@pytest.mark.parametrize("world", [2, 1], ids=["2r", "1r"])
@pytest.mark.parametrize("wrapped", [False, True], ids=["eager-sums", "domain-parallel"])
def test_a_promoted_weight_gets_the_single_device_gradient(wrapped: bool, world: int) -> None:
    run_on_ranks(world, _gradient_body, wrapped)


def _one_rank_body() -> tuple[bool, bool]:
    weight = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    one = promoted_local(weight, get_mesh((1,)), [Partial()])
    two = promoted_local(weight, get_mesh((1, 1), ("dp", "domain")), [Replicate(), Partial()])
    return one is weight, two is weight


def test_a_weight_on_a_mesh_of_one_rank_is_its_own_local_operand() -> None:
    """NOTE [A mesh of one rank sums nothing]: no autograd node, no sum, the weight itself
    (1-D and 2-D meshes of one rank)."""
    assert run_on_ranks(1, _one_rank_body) == [(True, True)]
