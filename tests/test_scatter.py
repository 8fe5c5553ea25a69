"""``scatter_tensor`` (the whole tensor on one rank) and ``distribute_tensor`` (on every rank).

Checked on every rank: the shard is exactly this rank's box of the global tensor (uneven and
empty sizes from ``sharding_shapes``, 1-D and 2-D meshes, a source that is not rank 0); every
rank receives exactly its own piece and the source sends the sum of the other ranks' pieces;
the metadata is broadcast only when some rank lacks it; ``requires_grad=True`` gives a leaf
whose gradient is right. Expected boxes come from ``tests/boxes.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Placement, Replicate, Shard

from shardsci.tensor import ShardTensor, distribute_tensor, scatter_tensor
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    assert_close_all_ranks,
    counted_comm,
    get_mesh,
    run_on_ranks,
)
from tests.boxes import box, coordinates, narrow, volume

S0, S1, R = Shard(0), Shard(1), Replicate()


@dataclass(frozen=True)
class Case:
    """A global tensor scattered from rank ``src``.

    Attributes
    ----------
    sharding_shapes : dict
        Passed to the library: mesh axis -> sizes (or local shapes) along it; empty: default.
    sizes : dict
        The same sizes as the test reads them: tensor dim -> extents.
    """

    name: str
    mesh: tuple[int, ...]
    shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    src: int
    sharding_shapes: Mapping[int, Sequence] = field(default_factory=dict)
    sizes: Mapping[int, Sequence[int]] = field(default_factory=dict)
    dtype: torch.dtype = torch.float64

    @property
    def layout(self) -> Layout:
        return Layout(self.placements, self.sizes)

    def __str__(self) -> str:
        return self.name


CASES = [
    Case("2r-5/2-src1", (2,), (7, 3), (S0,), 1, {0: [5, 2]}, {0: (5, 2)}),
    Case(
        "4r-40/33/30/28-src2",
        (4,),
        (131, 3),
        (S0,),
        2,
        {0: [40, 33, 30, 28]},
        {0: (40, 33, 30, 28)},
    ),
    Case(
        "4r-dim1-0/3/4/2-local-shapes-src3",
        (4,),
        (5, 9),
        (S1,),
        3,
        {0: [(5, 0), (5, 3), (5, 4), (5, 2)]},
        {1: (0, 3, 4, 2)},
    ),
    Case("4r-chunk-src1", (4,), (6, 2), (S0,), 1),
    Case("2r-replicate-src1", (2,), (4, 3), (R,), 1),
    Case(
        "2x2-block-src3",
        (2, 2),
        (6, 5),
        (S0, S1),
        3,
        {0: [5, 1], 1: [(6, 0), (6, 5)]},
        {0: (5, 1), 1: (0, 5)},
    ),
    Case("2x2-replicate-shard-src1", (2, 2), (3, 5, 4), (R, S1), 1, {1: [4, 1]}, {1: (4, 1)}),
    Case(
        "2x2-complex-src2",
        (2, 2),
        (3, 4),
        (S1, S0),
        2,
        {0: [1, 3], 1: [2, 1]},
        {1: (1, 3), 0: (2, 1)},
        torch.complex128,
    ),
    Case("4x2-chunk-src5", (4, 2), (9, 10), (S0, S1), 5),
]


def _global(case: Case) -> torch.Tensor:
    return torch.randn(case.shape, dtype=case.dtype)


def _scatter_problems(case: Case, mesh, value: torch.Tensor, metadata: bool) -> list[str]:
    """Scatter ``value`` from ``case.src``; what differs from the expected shard and bytes.

    ``metadata``: every rank passes ``global_shape`` and ``dtype`` (no broadcast)."""
    rank, me = dist.get_rank(), tuple(mesh.get_coordinate())
    is_src = rank == case.src
    known = {"global_shape": case.shape, "dtype": case.dtype} if metadata else {}
    with counted_comm() as stats:
        x = scatter_tensor(
            value if is_src else None,
            case.src,
            mesh,
            case.placements,
            dict(case.sharding_shapes) or None,
            **known,
        )
    problems = []
    expected = narrow(value, box(case.layout, case.shape, case.mesh, me))
    try:
        torch.testing.assert_close(x.to_local(), expected, atol=0, rtol=0)
    except AssertionError as exc:
        problems.append(f"shard: {exc}")
    if x.shape != torch.Size(case.shape) or x.dtype != case.dtype:
        problems.append(f"global shape {tuple(x.shape)} {x.dtype}, expected {case.shape}")
    itemsize = expected.element_size()
    everyone = coordinates(case.mesh)
    others = sum(volume(box(case.layout, case.shape, case.mesh, c)) for c in everyone) * itemsize
    others -= volume(box(case.layout, case.shape, case.mesh, everyone[case.src])) * itemsize
    expected_sent = others if is_src else 0
    expected_received = 0 if is_src else expected.numel() * itemsize
    if (stats.sent["scatter"], stats.received["scatter"]) != (expected_sent, expected_received):
        problems.append(
            f"scatter sent/received {stats.sent['scatter']}/{stats.received['scatter']} bytes, "
            f"expected {expected_sent}/{expected_received}"
        )
    if stats.calls["scatter"] != (1 if others else 0):
        problems.append(f"{stats.calls['scatter']} scatter calls")
    broadcast = stats.sent["broadcast"] + stats.received["broadcast"]
    if metadata and (stats.calls["broadcast"] or broadcast):
        problems.append(f"metadata was known to every rank but {broadcast} bytes were broadcast")
    if not metadata and not (stats.calls["broadcast"] == 1 and 0 < broadcast <= 4096):
        problems.append(f"metadata broadcast: {stats.calls['broadcast']} calls, {broadcast} B")
    extra = set(k for k, v in stats.calls.items() if v) - {"scatter", "broadcast"}
    if extra:
        problems.append(f"unexpected collectives {sorted(extra)}")
    return problems


def _scatter_body(case: Case) -> None:
    mesh = get_mesh(case.mesh)
    value = _global(case)
    for metadata in (False, True):
        problems = _scatter_problems(case, mesh, value, metadata)
        label = "global_shape and dtype on every rank" if metadata else "metadata from the source"
        assert_all_ranks(not problems, f"{case} ({label}): " + "; ".join(problems))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_scatter_tensor(case: Case) -> None:
    run_on_ranks(math.prod(case.mesh), _scatter_body, case)


def _scatter_grad_body(case: Case) -> None:
    mesh = get_mesh(case.mesh)
    me = tuple(mesh.get_coordinate())
    value = _global(case)
    is_src = dist.get_rank() == case.src
    x = scatter_tensor(
        value if is_src else None,
        case.src,
        mesh,
        case.placements,
        dict(case.sharding_shapes) or None,
        requires_grad=True,
    )
    assert_all_ranks(
        x.is_leaf and x.requires_grad and x.grad_fn is None,
        f"not a leaf that requires grad: is_leaf={x.is_leaf}, requires_grad={x.requires_grad}",
    )
    projection = torch.randn(case.shape, dtype=case.dtype)
    region = box(case.layout, case.shape, case.mesh, me)
    (x.to_local() * narrow(projection, region)).sum().backward()
    grad = x.grad
    assert_all_ranks(
        isinstance(grad, ShardTensor) and grad.placements == x.placements,
        f"grad is {type(grad).__name__} with placements {getattr(grad, 'placements', None)}",
    )
    assert_close_all_ranks(
        grad.to_local(), narrow(projection, region), atol=0, rtol=0, what="grad shard"
    )
    assert_close_all_ranks(grad.full_tensor(), projection, atol=0, rtol=0, what="full grad")


@pytest.mark.parametrize("case", [CASES[1], CASES[5], CASES[6]], ids=str)
def test_scatter_requires_grad(case: Case) -> None:
    run_on_ranks(math.prod(case.mesh), _scatter_grad_body, case)


def _distribute_body(case: Case) -> None:
    """Every rank holds the tensor: each keeps its box, nothing moves forward; the gradient
    of the whole tensor is the result's gradient, gathered (every rank gets all of it)."""
    mesh = get_mesh(case.mesh)
    me = tuple(mesh.get_coordinate())
    value = _global(case).requires_grad_(True)
    with counted_comm() as stats:
        x = distribute_tensor(value, mesh, case.placements, dict(case.sharding_shapes) or None)
    region = box(case.layout, case.shape, case.mesh, me)
    assert_all_ranks(
        stats.total_sent == stats.total_received == 0, f"communication {stats.as_dict()}"
    )
    assert_close_all_ranks(
        x.to_local().detach(), narrow(value.detach(), region), atol=0, rtol=0, what="shard"
    )
    projection = torch.randn(case.shape, dtype=case.dtype)
    (x.to_local() * narrow(projection, region)).sum().backward()
    assert_close_all_ranks(value.grad, projection, atol=0, rtol=0, what="grad of the tensor")


@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[5], CASES[8]], ids=str)
def test_distribute_tensor(case: Case) -> None:
    run_on_ranks(math.prod(case.mesh), _distribute_body, case)
