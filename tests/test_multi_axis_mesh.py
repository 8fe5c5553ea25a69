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
from tests.expected_layouts import parse

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


def test_sharded_times_partial_scalar_keeps_the_sharding() -> None:
    run_on_ranks(8, _sharded_times_partial_scalar, timeout_s=120)


# ---------------------------------------------------------------------------- ops on 3-axis meshes
# A (dp, h, w) mesh runs each op on the (h, w) block of its data-parallel replica; an (h, w, d)
# mesh runs it on a 3-D field split over all three axes. Shards are uneven, one is empty.
BLOCK = Layout((Shard(2), Shard(3)), {2: (5, 2), 3: (0, 6)})  # (N, C, 7, 6) on (h, w)
VOLUME = Layout(
    (Shard(2), Shard(3), Shard(4)), {2: (3, 2), 3: (1, 4), 4: (4, 0)}
)  # (N, C, 5, 5, 4)
BLOCK_SHAPE, VOLUME_SHAPE = (3, 4, 7, 6), (2, 4, 5, 5, 4)


def _norms(x: torch.Tensor) -> dict[str, nn.Module]:
    n = x.ndim - 2
    batch = (nn.BatchNorm2d, nn.BatchNorm3d)[n - 2]
    instance = (nn.InstanceNorm2d, nn.InstanceNorm3d)[n - 2]
    return {
        "GroupNorm": nn.GroupNorm(2, 4, dtype=F64),
        "BatchNorm": batch(4, dtype=F64),
        "InstanceNorm": instance(4, affine=True, track_running_stats=True, dtype=F64),
        "LayerNorm": nn.LayerNorm(x.shape[1:], dtype=F64),
    }


# name -> (fn, stated output layout on the block, on the volume; None: the input's)
REDUCTIONS = {
    # A sum over W, held whole by one rank of its axis, stays with that rank on the first
    # free dim (NOTE [A sum over a dim one rank holds stays with that rank]): no pending sum.
    "mean": (lambda a: a.mean(dim=(2, 3)), "P,S0; 0=0/3", "P,P,S2; 2=4/0"),
    "var": (lambda a: a.var(dim=(-2, -1)), "P,S0; 0=0/3", "S2,P,S0; 0=2/0; 2=3/2"),
    # The flattened block: the inner dims' axes nest under H's, each H piece chunked; but W,
    # held whole by one rank of its axis (0/6, 4/0), stays with it, its axis nested outermost
    # (NOTE [A dim one rank holds is whole on that rank]): no byte moves along it.
    "softmax over the block": (
        lambda a: torch.softmax(a.flatten(2), -1),
        "S2,S2; 2[1,0]=0/0/30/12",
        "S2,S2,S2; 2[2,0,1]=40/20/20/20/0/0/0/0",
    ),
    "softmax over one axis": (lambda a: torch.softmax(a, 2), None, None),
}


def _ops_body(mesh_names: tuple[str, ...]) -> None:
    mesh = get_mesh((2, 2, 2), mesh_names)
    volume = mesh_names == ("h", "w", "d")
    sub = mesh if volume else mesh["h", "w"]
    x = torch.randn(VOLUME_SHAPE if volume else BLOCK_SHAPE, dtype=F64)
    layout = VOLUME if volume else BLOCK
    for name, module in _norms(x).items():
        check_against_reference(lambda m, a: m(a), [x], [layout], sub, module=module, what=name)
    for name, (fn, on_block, on_volume) in REDUCTIONS.items():
        stated = on_volume if volume else on_block
        expected = [parse(stated)] if stated else None
        check_against_reference(fn, [x], [layout], sub, out_layouts=expected, what=name)
    spatial = tuple(range(2, x.ndim))
    check_against_reference(
        lambda a: torch.fft.irfftn(
            torch.fft.rfftn(a, dim=spatial) * 0.5, s=x.shape[2:], dim=spatial
        ),
        [x],
        [layout],
        sub,
        what="rfftn round trip",
    )


@pytest.mark.parametrize("mesh_names", [("dp", "h", "w"), ("h", "w", "d")], ids=["dp-h-w", "h-w-d"])
def test_multi_axis_reductions_on_a_3_axis_mesh(mesh_names: tuple[str, ...]) -> None:
    run_on_ranks(8, _ops_body, mesh_names, timeout_s=300)
