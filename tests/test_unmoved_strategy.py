"""An op whose operands need not move skips DTensor's full strategy expansion and gets the
same choice (NOTE [An op whose operands need not move skips DTensor's full strategy
expansion]): compared with the full expansion on random layouts of 2- and 3-axis meshes, and
the route itself (no full expansion where nothing moves; the full one where something must)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard

from shardsci.tensor import _propagation, _unmoved_strategy
from shardsci.tensor._torch_compat import (
    DTensorSpec,
    OpSchema,
    TensorMeta,
    dtensor_sharding_prop,
    torch_release,
)
from shardsci.testing import run_local_tensor

pytestmark = pytest.mark.skipif(torch_release() < (2, 13), reason="torch 2.13's expansion only")

aten = torch.ops.aten
F64 = torch.float64
SHAPE = (2, 4, 6, 6, 4)
BINARY = (aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor, aten.div.Tensor, aten.maximum.default)


def _spec(mesh, shape: tuple[int, ...], placements: tuple, dtype=F64) -> DTensorSpec:
    stride = torch.empty(shape, device="meta").stride()
    return DTensorSpec(mesh, placements, tensor_meta=TensorMeta(torch.Size(shape), stride, dtype))


def _placements(rng: random.Random, ndim: int, axes: int) -> tuple:
    return tuple(
        rng.choice([Replicate(), Partial()] + [Shard(d) for d in range(ndim)]) for _ in range(axes)
    )


def _cases(mesh, count: int, seed: int) -> list[OpSchema]:
    """Random pointwise calls, most of them on operands that need not move: equal layouts,
    a replicated or broadcast partner, a partner differing on one axis."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        a = _placements(rng, len(SHAPE), mesh.ndim)
        kind = rng.random()
        if kind < 0.4:
            b = a
        elif kind < 0.6:
            b = (Replicate(),) * mesh.ndim
        elif kind < 0.85:
            b = tuple(p if rng.random() < 0.7 else rng.choice([Replicate(), Partial()]) for p in a)
        else:
            b = _placements(rng, len(SHAPE), mesh.ndim)
        other = (
            SHAPE if rng.random() < 0.6 else tuple(s if rng.random() < 0.5 else 1 for s in SHAPE)
        )
        x, y = _spec(mesh, SHAPE, a), _spec(mesh, other, b)
        which = rng.random()
        if which < 0.15:
            cases.append(OpSchema(aten.sin.default, (x,), {}))
        elif which < 0.25:
            cases.append(OpSchema(aten.mul.Scalar, (x, 2.0), {}))
        elif which < 0.35:
            condition = _spec(mesh, other, b, torch.bool)
            cases.append(OpSchema(aten.where.self, (condition, x, _spec(mesh, SHAPE, a)), {}))
        else:
            cases.append(OpSchema(rng.choice(BINARY), (x, y), {}))
    return cases


def _choice(schema: OpSchema) -> object:
    """What DTensor decides for ``schema``: output spec and the inputs' targets (or its error)."""
    _propagation._PROPAGATOR.propagate_op_sharding.cache_clear()
    try:
        out = _propagation._PROPAGATOR.propagate_op_sharding_non_cached(schema)
    except Exception as error:  # the full expansion's own errors must be the same
        return type(error).__name__, str(error)
    targets = None if out.redistribute_schema is None else out.redistribute_schema.args_spec
    return str(out.output_spec), [str(t) for t in targets or ()], out.needs_redistribute


def _compare(mesh_shape: tuple[int, ...], count: int, seed: int) -> tuple[int, list[str]]:
    """(how many cases took the unmoved route, the cases whose choice differs)."""
    mesh = init_device_mesh("cpu", mesh_shape)
    taken = 0
    differ = []
    for schema in _cases(mesh, count, seed):
        before = _COUNTS["unmoved"]
        fast = _choice(schema)
        taken += _COUNTS["unmoved"] > before
        installed = dtensor_sharding_prop._expand_single_dim_strategy_to_mesh
        dtensor_sharding_prop._expand_single_dim_strategy_to_mesh = (
            _unmoved_strategy.dtensor_expansion()
        )
        try:
            full = _choice(schema)
        finally:
            dtensor_sharding_prop._expand_single_dim_strategy_to_mesh = installed
        if fast != full:
            differ.append(f"{schema}: unmoved route {fast}, full expansion {full}")
    return taken, differ


_COUNTS = {"unmoved": 0}


@pytest.fixture
def counted(monkeypatch):
    """Count the calls in which the unmoved route found DTensor's choice."""
    real = _unmoved_strategy.unmoved_strategy

    def counting(*args):
        found = real(*args)
        _COUNTS["unmoved"] += found is not None
        return found

    monkeypatch.setattr(_unmoved_strategy, "unmoved_strategy", counting)


@pytest.mark.parametrize(
    ("mesh_shape", "count"),
    [((2, 2), 40), pytest.param((2, 2, 2), 12, marks=pytest.mark.slow)],
    ids=["2x2", "2x2x2"],
)
def test_the_unmoved_route_makes_dtensors_choice(counted, mesh_shape, count) -> None:
    taken, differ = run_local_tensor(math.prod(mesh_shape), _compare, mesh_shape, count, 0)[0]
    assert not differ, "\n".join(differ)
    assert taken >= count // 3, f"the unmoved route was taken in {taken} of {count} cases only"


def _full_expansions(monkeypatch) -> list[str]:
    """The ops DTensor's full expansion is asked for from now on."""
    asked: list[str] = []
    full = _unmoved_strategy.dtensor_expansion()

    def counting(mesh, op_schema, *args):
        asked.append(str(op_schema.op))
        return full(mesh, op_schema, *args)

    monkeypatch.setattr(_unmoved_strategy, "_FULL", counting)
    return asked


def _route() -> tuple[list[str], list[str]]:
    mesh = init_device_mesh("cpu", (2, 2, 2))
    volume = (Shard(2), Shard(3), Shard(4))
    unmoved = [
        OpSchema(aten.add.Tensor, (_spec(mesh, SHAPE, volume), _spec(mesh, SHAPE, volume)), {}),
        OpSchema(
            aten.mul.Tensor,
            (_spec(mesh, SHAPE, volume), _spec(mesh, (4, 1, 1, 1), (Replicate(),) * 3)),
            {},
        ),
    ]
    moved = OpSchema(
        aten.sub.Tensor,
        (
            _spec(mesh, SHAPE, (Shard(2), Shard(3), Replicate())),
            _spec(mesh, (2, 4, 6, 1, 1), (Shard(2), Partial(), Replicate())),
        ),
        {},
    )
    found = [_choice(s) for s in unmoved]
    return found, [_choice(moved)]


def test_ops_whose_operands_need_not_move_skip_the_full_expansion(monkeypatch) -> None:
    asked = _full_expansions(monkeypatch)
    unmoved, moved = run_local_tensor(8, _route)[0]
    assert [u[2] for u in unmoved] == [False, False], unmoved
    assert moved[0][2] is True, moved
    # The full expansion was asked for the op whose pending operand must move, only.
    assert asked == ["aten.sub.Tensor"], asked
