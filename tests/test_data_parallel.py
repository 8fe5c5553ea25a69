"""ShardTensor composes with data parallelism (``shardsci.training.parallelize``: DDP or
FSDP2) on the data-parallel mesh axis.

A (dp=2, domain=2) mesh: each dp rank takes half of the global batch, each domain rank an
uneven slab of the points of every sample. One optimiser step must give the parameters of
the single-process step on the whole batch: the domain sum of weight gradients comes from
shardsci, the data-parallel average from the wrapper.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

import shardsci
from shardsci.testing import assert_close_all_ranks, get_mesh, run_on_ranks
from shardsci.training import (
    DataParallelMode,
    ParallelConfig,
    Parallelism,
    ParallelPlan,
    parallelize,
)

BATCH, POINTS, CHANNELS = 4, 10, 3
POINT_SIZES = (7, 3)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(CHANNELS, 8, dtype=torch.float64),
        nn.GELU(),
        nn.Linear(8, 2, dtype=torch.float64),
    )


def _step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    optimiser = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = F.mse_loss(model(inputs), targets)
    if isinstance(loss, shardsci.ShardTensor):
        loss = loss.full_tensor()
    loss.backward()
    optimiser.step()


def _body(wrapper: str) -> None:
    mesh = get_mesh((2, 2), ("dp", "domain"))
    inputs = torch.randn(BATCH, POINTS, CHANNELS, dtype=torch.float64)
    targets = torch.randn(BATCH, POINTS, 2, dtype=torch.float64)
    reference = _model()
    _step(reference, inputs, targets)

    dp = mesh.get_coordinate()[0]
    half = slice(dp * BATCH // 2, (dp + 1) * BATCH // 2)
    domain_mesh = mesh["domain"]

    def sharded(t: torch.Tensor) -> shardsci.ShardTensor:
        return shardsci.distribute_tensor(t[half], domain_mesh, [Shard(1)], {0: POINT_SIZES})

    model = _model()
    plan = ParallelPlan.of("2x2", ParallelConfig(["dp", "domain"], "dp"), ("points",))
    wrapped = parallelize(model, Parallelism(plan, mesh), DataParallelMode[wrapper])
    _step(wrapped, sharded(inputs), sharded(targets))
    for (name, p), expected in zip(model.named_parameters(), reference.parameters()):
        value = p.full_tensor() if isinstance(p, DTensor) else p
        assert_close_all_ranks(value.detach(), expected.detach(), atol=1e-12, rtol=1e-12, what=name)


@pytest.mark.parametrize("wrapper", [m.name for m in DataParallelMode])
def test_one_step_matches_single_process(wrapper: str) -> None:
    run_on_ranks(4, _body, wrapper)
