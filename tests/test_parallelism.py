"""A run's plan becomes its DeviceMesh and the answers a rank needs (``Parallelism``), here for
a 3-D field ``(N, C, D, H, W)`` on 8 gloo ranks: slab, pencil, 2x2x2 block and data parallel
times pencil, with uneven and empty slabs; the sub-meshes are made once and shared."""

from __future__ import annotations

import pytest
import torch

import shardsci
from shardsci.testing import run_on_ranks
from shardsci.training import ParallelConfig, Parallelism, ParallelPlan

FIELD = (2, 1, 4, 6, 8)
DIMS = ("N", "C", "D", "H", "W")
SLAB = ParallelConfig(["domain"], None, {})
BLOCK = ParallelConfig(None, None, {})
AUTO = ParallelConfig()


def _rank_view(mesh_shape: str, parallel: ParallelConfig) -> dict:
    plan = ParallelPlan.of(mesh_shape, parallel, ("D", "H", "W"), world_size=8)
    parallelism = Parallelism.build(plan, "cpu")
    domain = parallelism.domain_mesh
    assert domain is parallelism.domain_mesh and parallelism.dp_mesh is parallelism.dp_mesh
    field = torch.arange(torch.Size(FIELD).numel(), dtype=torch.float64).reshape(FIELD)
    sharded = shardsci.distribute_tensor(field, domain, parallelism.field_placements(DIMS))
    return {
        "coordinate": parallelism.mesh.get_coordinate(),
        "domain_axes": domain.mesh_dim_names,
        "dp": (parallelism.dp_rank, parallelism.dp_size),
        "local": tuple(sharded.to_local().shape),
        "whole": torch.equal(sharded.full_tensor(), field),
    }


def _chunk(size: int, parts: int, index: int) -> int:
    """Cells of part ``index`` of ``size`` cells in ``torch.chunk``'s split."""
    step = -(-size // parts)
    return max(0, min(size, (index + 1) * step) - index * step)


@pytest.mark.parametrize(
    ("mesh_shape", "parallel", "axes", "split"),
    [
        ("8", SLAB, ("domain",), {2: (0,)}),
        ("2x4", BLOCK, ("domain_d", "domain_h"), {2: (0,), 3: (1,)}),
        ("2x2x2", BLOCK, ("domain_d", "domain_h", "domain_w"), {2: (0,), 3: (1,), 4: (2,)}),
        ("2x2x2", AUTO, ("domain_d", "domain_h"), {2: (1,), 3: (2,)}),
    ],
    ids=["slab-8", "pencil-2x4", "block-2x2x2", "dp2-x-pencil-2x2"],
)
def test_a_3d_field_is_split_as_planned(mesh_shape, parallel, axes, split) -> None:
    """``split``: tensor dim -> the mesh axes (by position) that split it."""
    for view in run_on_ranks(8, _rank_view, mesh_shape, parallel):
        coordinate = view["coordinate"]
        shape = [int(s) for s in mesh_shape.split("x")]
        expected = list(FIELD)
        for dim, (axis,) in split.items():
            expected[dim] = _chunk(FIELD[dim], shape[axis], coordinate[axis])
        assert view["domain_axes"] == axes
        assert view["local"] == tuple(expected), view
        assert view["whole"]
        dp = (coordinate[0], 2) if parallel is AUTO else (0, 1)
        assert view["dp"] == dp


def _mismatch() -> str:
    plan = ParallelPlan.of("2x2", BLOCK, ("D", "H", "W"))
    try:
        Parallelism.build(plan, "cpu")
    except ValueError as error:
        return str(error)
    return "built"


def test_a_plan_for_other_ranks_is_refused_on_every_rank_before_any_collective() -> None:
    messages = run_on_ranks(8, _mismatch)
    assert set(messages) == {
        "the run was planned for 4 ranks (domain_d=2 (splits D), domain_h=2 (splits H)), but "
        "the process group has 8"
    }
