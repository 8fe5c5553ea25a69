"""DTensor's sharding propagation of pointwise ops whose operands need not move, on a 3-axis
mesh: its full strategy expansion against the unmoved route (NOTE [An op whose operands need
not move skips DTensor's full strategy expansion]).

Each case is one pointwise call on float64 operands of a 2x2x2 mesh laid out so that no
operand must move (equal layouts, a replicated or broadcast partner), as a training step's
ops mostly are. Per round, both routes run interleaved (which first alternates) on a cold
cache: DTensor's propagation LRU and transform infos emptied before each call, so each call
pays what the first call of a new layout pays. The figures are the wall time of
``propagate_op_sharding_non_cached`` in this one process (on a real run every rank pays it at
once), in ms: per case the median and spread over the rounds, and the ratio of the medians.
The routes must agree on the output and on every operand's target.

Run ``OMP_NUM_THREADS=1 python -m benchmarks.unmoved_strategy [--rounds N] [--cases REGEX]
[--check]`` (5 rounds: about half a minute here); the JSON fields are listed in README.md.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard

from benchmarks._common import Goal, emit, emit_summary, parse_arguments, spread
from shardsci.tensor import _unmoved_strategy
from shardsci.tensor._torch_compat import (
    DTensorSpec,
    OpSchema,
    TensorMeta,
    dtensor_redistribute,
    dtensor_sharding_prop,
    sharding_propagator,
)
from shardsci.testing import run_local_tensor

GOAL_SPEEDUP = 5.0
"""The unmoved route's median over the cases at least this many times faster."""

aten = torch.ops.aten
SHAPE = (2, 4, 8, 8, 8)
VOLUME = (Shard(2), Shard(3), Shard(4))
BLOCK = (Replicate(), Shard(2), Shard(3))
# name -> (op, (shape, placements) per tensor operand, other arguments)
CASES = {
    "add, volume": (aten.add.Tensor, [(SHAPE, VOLUME), (SHAPE, VOLUME)], ()),
    "mul by a channel scale": (
        aten.mul.Tensor,
        [(SHAPE, VOLUME), ((4, 1, 1, 1), (Replicate(),) * 3)],
        (),
    ),
    "sub, block": (aten.sub.Tensor, [(SHAPE, BLOCK), (SHAPE, BLOCK)], ()),
    "div by a pending sum": (
        aten.div.Tensor,
        [(SHAPE, (Partial(), Shard(3), Shard(4))), ((1,) * 5, (Replicate(),) * 3)],
        (),
    ),
    "mul by a scalar": (aten.mul.Scalar, [(SHAPE, VOLUME)], (0.5,)),
    "sin": (aten.sin.default, [(SHAPE, VOLUME)], ()),
}


def _schema(mesh, op, operands, others) -> OpSchema:
    specs = []
    for shape, placements in operands:
        stride = torch.empty(shape, device="meta").stride()
        meta = TensorMeta(torch.Size(shape), stride, torch.float64)
        specs.append(DTensorSpec(mesh, placements, tensor_meta=meta))
    return OpSchema(op, (*specs, *others), {})


def _timed(schema: OpSchema, full: bool) -> tuple[float, object]:
    """One cold propagation: (ms, what it decided)."""
    sharding_propagator.propagate_op_sharding.cache_clear()
    dtensor_redistribute._gen_transform_infos.cache_clear()
    installed = dtensor_sharding_prop._expand_single_dim_strategy_to_mesh
    if full:
        dtensor_sharding_prop._expand_single_dim_strategy_to_mesh = (
            _unmoved_strategy.dtensor_expansion()
        )
    try:
        start = time.perf_counter()
        out = sharding_propagator.propagate_op_sharding_non_cached(schema)
        ms = (time.perf_counter() - start) * 1e3
    finally:
        dtensor_sharding_prop._expand_single_dim_strategy_to_mesh = installed
    targets = out.redistribute_schema.args_spec if out.redistribute_schema else ()
    return ms, (str(out.output_spec), [str(t) for t in targets])


def _measure(rounds: int, cases: str) -> dict[str, dict]:
    mesh = init_device_mesh("cpu", (2, 2, 2))
    results = {}
    for name, (op, operands, others) in CASES.items():
        if not re.search(cases, name):
            continue
        schema = _schema(mesh, op, operands, others)
        times: dict[str, list[float]] = {"full": [], "unmoved": []}
        decided = {}
        for r in range(rounds):
            for route in ("full", "unmoved") if r % 2 == 0 else ("unmoved", "full"):
                ms, decided[route] = _timed(schema, route == "full")
                times[route].append(ms)
        results[name] = {
            "full_ms": spread(times["full"], 2),
            "unmoved_ms": spread(times["unmoved"], 2),
            "agree": decided["full"] == decided["unmoved"],
        }
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed calls per route and case")
    parser.add_argument("--cases", default="", help="only the cases whose name matches REGEX")
    args = parse_arguments(parser, argv)
    results = run_local_tensor(8, _measure, args.rounds, args.cases)[0]
    speedups = []
    for name, fields in results.items():
        speedup = fields["full_ms"]["median"] / fields["unmoved_ms"]["median"]
        speedups.append(speedup)
        emit("case", case=name, speedup=round(speedup, 1), **fields)
    median = statistics.median(speedups)
    goals = [
        Goal(
            "both routes decide the same for every case", all(f["agree"] for f in results.values())
        ),
        Goal(
            f"the unmoved route at least {GOAL_SPEEDUP:g}x faster (median over the cases)",
            median >= GOAL_SPEEDUP,
        ),
    ]
    emit_summary(goals, args.check, cases=len(results), median_speedup=round(median, 1))


if __name__ == "__main__":
    main()
