"""Collectives over several axes of a 3-axis mesh: the groups are created consistently by every
rank of the world, including ranks of other data-parallel replicas (NOTE [Groups over several
mesh axes are created by every rank of the world])."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard

from shardsci.tensor import ShardTensor
from shardsci.tensor._collectives import axis_group
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    check_against_reference,
    get_mesh,
    run_on_ranks,
)

F64 = torch.float64


def _group_norm_on_block_of_sub_mesh() -> None:
    mesh = get_mesh((2, 2, 2), ("dp", "h", "w"))
    x = torch.randn(2, 4, 6, 5, dtype=F64)
    layout = Layout((Shard(2), Shard(3)), {2: (4, 2), 3: (2, 3)})
    norm = nn.GroupNorm(2, 4, dtype=F64)
    check_against_reference(lambda m, x: m(x), [x], [layout], mesh["h", "w"], module=norm)


def _groups_over_every_axis_combination() -> None:
    for shape, names in (((2, 2, 2), ("dp", "h", "w")), ((2, 2, 2), None)):
        mesh = get_mesh(shape, names)
        for axes in ((0, 2), (2, 0), (1, 2), (0, 1, 2)):
            group = axis_group(mesh, axes)
            total = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(total, group=group.group)
            assert_all_ranks(
                float(total) == sum(group.global_ranks),
                f"all-reduce over axes {axes} summed {float(total)}, expected the ranks "
                f"{group.global_ranks}",
            )


def _softmax_over_non_adjacent_sub_mesh() -> None:
    mesh = get_mesh((2, 2, 2), ("dp", "h", "w"))
    y = torch.randn(6, 5, dtype=F64)
    layout = Layout((Shard(0), Shard(0)), {0: (1, 2, 0, 3)})
    check_against_reference(
        lambda y: torch.softmax(y, 0) * _whole(y.mean()), [y], [layout], mesh["dp", "w"]
    )


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, ShardTensor) else t


def _sharded_times_partial_scalar() -> None:
    mesh = get_mesh((2, 2, 2), ("dp", "h", "w"))
    y = torch.randn(6, 5, dtype=F64)
    layout = Layout((Shard(0), Shard(0)), {0: (1, 2, 0, 3)})
    check_against_reference(lambda y: y.sin() * y.mean(), [y], [layout], mesh["dp", "w"])


def test_group_norm_on_a_block_of_a_dp_by_h_by_w_mesh() -> None:
    run_on_ranks(8, _group_norm_on_block_of_sub_mesh, timeout_s=120)


def test_groups_over_several_axes_of_named_and_unnamed_meshes() -> None:
    run_on_ranks(8, _groups_over_every_axis_combination, timeout_s=120)


def test_nested_sharding_over_non_adjacent_axes() -> None:
    run_on_ranks(8, _softmax_over_non_adjacent_sub_mesh, timeout_s=120)


@pytest.mark.xfail(
    reason="a sharded tensor times a Partial scalar (y * y.mean()) gathers the sharded "
    "operand and returns a Partial result instead of reducing the scalar",
    strict=True,
)
def test_sharded_times_partial_scalar_keeps_the_sharding() -> None:
    run_on_ranks(8, _sharded_times_partial_scalar, timeout_s=120)
