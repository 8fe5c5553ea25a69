"""First-call planning time of every op: the op-database sweep's samples and the suite's tables.

An op without a cached plan pays for planning on its first call (DTensor's sharding
propagation, a handler's plan, a decomposition run op by op, the meta-tensor check of every
rank's kernel call); later calls of the same op on the same layout reuse the plan. This
measures that first-call cost for

- ``opdb``: the samples of PyTorch's OpInfo database (``tests/op_db_sweep.py``), the first
  ``--samples`` of each op that the sweep's ``2r-uneven`` layout can shard, that layout (2
  ranks, the first dim of extent >= 2 split unevenly, not ``torch.chunk``'s sizes), the other
  tensor arguments plain, float64;
- ``suite``: the op tables of the test suite, on their 2-rank uneven layouts: the unary,
  per-dim and argmax/argmin tables of ``tests/test_ops_core.py`` on ``2r-5/2``, the ops of
  ``tests/test_op_communication.py`` (rows 7/5), the pooling spellings of
  ``tests/test_pool_ops.py``, the transforms of ``tests/test_fft_ops.py``, every resize and
  mode of ``tests/test_interpolate_ops.py`` and the convolution padding modes of
  ``tests/test_conv_ops.py`` on ``2r-H-7/4``, and the attention variants of
  ``tests/test_attention_ops.py`` whose mask is not sharded (queries, keys and values on
  ``2r-7/4``), plus normalisation modules.

Each case runs in the rank pool of 2 gloo ranks. On every rank: the op once on plain tensors
(so that torch's own first-call costs of the kernels are paid before; a case whose plain call
raises is skipped), then ``--rounds`` rounds of: every cache emptied by
``shardsci.clear_caches()``, a timed first call on ShardTensors built from the sample (forward
and, when the sharded inputs require grad, backward of the differentiable outputs, with
gradients of ones laid out as the outputs, built outside the timing), then the same on fresh
inputs of the same layout ``--warm`` times (the warm calls). Every timed call starts at a
barrier, with the garbage collector off. Per round, the figures are the slowest rank's:
``first_ms`` and ``warm_ms`` (the fastest warm call) are forward + backward wall time,
``planning_ms = first_ms - warm_ms`` is what planning costs on the first call, ``forward_*`` the
same for the forward alone and ``*_cpu_ms`` the same in CPU time of the rank process. A case
reports its round of least ``planning_ms`` (other processes on the machine only ever add time;
on this shared 2-core machine one round's wall time can be several times its CPU time), the
first round's ``first_round_planning_ms`` and the least CPU planning time of any round. A case
that raises the same error on every rank is reported with ``status: "error"`` and the time
until it raised.

What is cleared: ``clear_caches`` empties shardsci's plans, specs and handler plans and, of
DTensor's, the propagation LRU, the redistribution planners and the transform infos. Fake
tensors' dispatch cache, which DTensor's propagation of output metadata fills and
``clear_caches`` leaves (it is torch's, shared by every ``FakeTensorMode``), is switched off in
the rank processes (``torch._dynamo.config.fake_tensor_cache_enabled``): with it, a later
round's first call plans 10-25 % faster than a first call in a fresh process. DTensor's other
caches are not on a ShardTensor op's path and stay: its tensor-metadata LRU (shardsci calls
``propagate_op_sharding_non_cached``, which computes metadata uncached), the C++ cache of
DTensor's own dispatch, and the mesh topology (one entry per mesh, filled by a warm-up op that
every rank process runs before its first case, with DTensor's lazy imports). So is everything
torch itself does once per process (a kernel's first meta call, a decomposition's first
import): the first round of the first case that needs it pays for it, as the first op of a
real run would, and ``first_round_planning_ms`` shows it.

Run ``OMP_NUM_THREADS=1 python -m benchmarks.first_call`` (every case: about 2 minutes here),
``--ops REGEX`` (on ``group:op``, e.g. ``--ops 'suite:attention|opdb:nn.functional'``),
``--limit N`` (the first N cases), ``--check`` (exit 1 when the goal is missed); the JSON
fields are listed in README.md.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import re
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

from benchmarks._common import Goal, emit, emit_summary, on_ranks, parse_arguments, rank_pools
from shardsci import ShardTensor, clear_caches
from shardsci.tensor._api import from_local_spec, grad_spec
from shardsci.testing import Layout, RankFailure, get_mesh
from tests import op_db_sweep
from tests.layouts import CASES, SPATIAL_2D

GOAL_MS = 50.0
SLOWEST = 10
WORLD = 2


# ---------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class SuiteOp:
    """A call of the test suite: ``fn`` on random global inputs of ``shapes`` and ``dtype``,
    each laid out as ``layouts`` says (None: a plain tensor); ``grad``: whether the sharded
    inputs require grad."""

    fn: Callable[..., object]
    shapes: tuple[tuple[int, ...], ...]
    layouts: tuple[Layout | None, ...]
    grad: bool = True
    dtype: torch.dtype = torch.float64

    def inputs(self) -> list[torch.Tensor]:
        return [torch.randn(shape, dtype=self.dtype) for shape in self.shapes]


def _suite() -> dict[str, SuiteOp]:
    """``suite:<table>.<entry>`` -> its call (the tables are the tests' own). Built from a
    fixed seed: each rank process imports this module and builds its own, and masks and
    module weights must agree."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        ops = {**_core_ops(), **_field_ops(), **_attention_ops()}
    return {f"suite:{name}": op for name, op in ops.items()}


def _core_ops() -> dict[str, SuiteOp]:
    """``tests/test_ops_core.py`` on ``2r-5/2`` and ``tests/test_op_communication.py``."""
    from tests import test_op_communication, test_ops_core

    core = next(c for c in CASES if c.name == "2r-5/2")
    rows = ((core.shape,), (core.layout,))
    ops = {}
    for name, make in test_ops_core.UNARY.items():
        ops[f"ops_core.{name}"] = SuiteOp(make(core), *rows)
    for name, make in test_ops_core.NO_GRAD.items():
        ops[f"ops_core.{name}"] = SuiteOp(make(core), *rows, grad=False)
    for table, grad in ((test_ops_core.PER_DIM, True), (test_ops_core.NO_GRAD_PER_DIM, False)):
        for name, make in table.items():
            for dim in range(len(core.shape)):
                ops[f"ops_core.{name}[{dim}]"] = SuiteOp(make(dim), *rows, grad=grad)
    communication = ((test_op_communication.SHAPE,), (Layout((Shard(0),), {0: (7, 5)}),))
    for name, (fn, _) in test_op_communication.OPS.items():
        ops[f"op_communication.{name}"] = SuiteOp(fn, *communication)
    return ops


def _field_ops() -> dict[str, SuiteOp]:
    """Pooling, FFTs, interpolation, convolutions and normalisation on ``2r-H-7/4``."""
    from tests import test_conv_ops, test_fft_ops, test_interpolate_ops, test_pool_ops

    field = SPATIAL_2D[0]  # (2, 3, 11, 6), H split 7/4
    fields = ((field.shape,), (field.layout,))
    ops = {}
    for name, (fn, _, _) in test_pool_ops.FUNCTIONS.items():
        ops[f"pool.{name}"] = SuiteOp(fn, *fields)
    for name, calls in test_fft_ops.TRANSFORMS.items():
        for i, (real, fn) in enumerate(calls):
            dtype = torch.float64 if real else torch.complex128
            ops[f"fft.{name}[{i}]"] = SuiteOp(fn, *fields, dtype=dtype)
    for mode, variants in test_interpolate_ops.MODES_2D.items():
        for resize, kwargs in test_interpolate_ops.RESIZES.items():
            call = _interpolate(mode, {**variants[0], **kwargs})
            ops[f"interpolate.{mode}.{resize}"] = SuiteOp(call, *fields)
    modules = {
        f"conv.conv2d-{mode}": nn.Conv2d(3, 4, 3, padding=1, padding_mode=mode)
        for mode in test_conv_ops.MODES
    }
    modules["norm.group_norm"] = nn.GroupNorm(1, 3)
    modules["norm.batch_norm"] = nn.BatchNorm2d(3)
    modules["norm.instance_norm"] = nn.InstanceNorm2d(3, affine=True)
    for name, module in modules.items():
        ops[name] = SuiteOp(_module(module), *fields)
    return ops


def _attention_ops() -> dict[str, SuiteOp]:
    """The variants of ``tests/test_attention_ops.py`` with a plain mask (or none), queries,
    keys and values on ``2r-7/4``."""
    from tests import test_attention_ops

    sequence = test_attention_ops.CASE_BY_NAME["2r-7/4"]
    ops = {}
    for name, (kwargs, mask) in test_attention_ops.VARIANTS.items():
        if mask != "float-grad" and not kwargs.get("enable_gqa"):
            ops[f"attention.{name}"] = SuiteOp(
                _attention(kwargs, test_attention_ops._mask(mask, sequence.shape)[0]),
                (sequence.shape,) * 3,
                (sequence.layout,) * 3,
            )
    return ops


def _module(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    module.to(torch.float64)
    return lambda x: module(x)


def _interpolate(mode: str, kwargs: dict) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: F.interpolate(x, mode=mode, **kwargs)


def _attention(kwargs: dict, mask: torch.Tensor | None) -> Callable[..., torch.Tensor]:
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)


#: ``suite:<table>.<entry>`` -> its call.
SUITE: dict[str, SuiteOp] = _suite()
_SWEEP_LAYOUT = op_db_sweep.LAYOUTS["2r-uneven"]


def _cases(pattern: str | None, samples: int) -> Iterator[str]:
    """Every case whose ``group:op`` matches ``pattern``: the suite's, then
    ``opdb:<op>#<sample index>`` for the first ``samples`` shardable samples of each op."""
    yield from (c for c in SUITE if pattern is None or re.search(pattern, c))
    for key in sorted(op_db_sweep.database()):
        if pattern is None or re.search(pattern, f"opdb:{key}"):
            for index, _, _ in op_db_sweep.selected_samples(key, _SWEEP_LAYOUT, samples):
                yield f"opdb:{key}#{index}"


@dataclass
class _Instance:
    """One call of a case on fresh inputs: ``call()`` runs it, ``outputs(out)`` picks the
    results to differentiate (none when ``grad`` is false)."""

    call: Callable[[], object]
    grad: bool
    outputs: Callable[[object], list]


def _instance(case: str, samples: int, sharded: bool) -> _Instance:
    """Fresh inputs of ``case`` (sharded on the 2-rank mesh, or plain on this rank)."""
    mesh = get_mesh((WORLD,))
    if case.startswith("suite:"):
        op = SUITE[case]
        torch.manual_seed(sum(case.encode()))
        args = []
        for x, layout in zip(op.inputs(), op.layouts):
            grad = op.grad and layout is not None
            if layout is None or not sharded:
                args.append(x.requires_grad_(grad))
            else:
                spec = layout.spec(mesh, x)
                args.append(from_local_spec(spec.narrow(x).clone().requires_grad_(grad), spec))
        return _Instance(lambda: op.fn(*args), op.grad, _flat_differentiable)
    key, index = case.removeprefix("opdb:").rsplit("#", 1)
    info = op_db_sweep.database()[key]
    chosen = op_db_sweep.selected_samples(key, _SWEEP_LAYOUT, samples)
    _, sample, layout = next(c for c in chosen if c[0] == int(index))
    first, rebuild = op_db_sweep._first_tensor(sample)
    grad = info.supports_autograd and op_db_sweep._differentiable(first)
    leaf = first.detach().clone().requires_grad_(grad)
    if sharded:
        spec = layout.spec(mesh, first)
        leaf = from_local_spec(spec.narrow(first.detach()).clone().requires_grad_(grad), spec)
    process = sample.output_process_fn_grad
    return _Instance(
        lambda: op_db_sweep._call(info, sample, rebuild, leaf),
        grad,
        lambda out: _flat_differentiable(process(out)),
    )


def _flat_differentiable(out: object) -> list[torch.Tensor]:
    return [
        o for o in op_db_sweep._flat_outputs(out) if isinstance(o, torch.Tensor) and o.requires_grad
    ]


# ---------------------------------------------------------------------------- on the ranks
def _ones_like(out: torch.Tensor) -> torch.Tensor:
    """A gradient of ones for ``out``, laid out as its gradient must be."""
    ones = torch.ones(out.shape, dtype=out.dtype)
    if not isinstance(out, ShardTensor):
        return ones
    spec = grad_spec(out._spec).with_dtype(ones.dtype)
    return from_local_spec(spec.narrow(ones), spec)


def _timed(instance: _Instance) -> tuple[float, float, float, float]:
    """Seconds of the forward call and of the backward (0 without one), each from a barrier:
    ``(forward wall, backward wall, forward CPU, backward CPU)`` (CPU: this process's)."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    out = instance.call()
    forward = (time.perf_counter() - wall, time.process_time() - cpu)
    terms = instance.outputs(out) if instance.grad else []
    if not terms:
        return forward[0], 0.0, forward[1], 0.0
    grads = [_ones_like(t) for t in terms]
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    torch.autograd.backward(terms, grads)
    return forward[0], time.perf_counter() - wall, forward[1], time.process_time() - cpu


_prepared: set[str] = set()


def _prepare_process(case: str) -> None:
    """Once per rank process, outside every case: pay the costs of any first ShardTensor op
    (DTensor's lazy import of ``torch._dynamo``, the mesh's topology) and import the op
    database if ``case`` needs it; then freeze what is alive, so that the garbage collection
    before each case sweeps only what cases left (not the database's 400,000 objects)."""
    before = len(_prepared)
    if "process" not in _prepared:
        torch._dynamo.config.fake_tensor_cache_enabled = False
        x = ShardTensor.from_local(torch.ones(3, 2), get_mesh((WORLD,)), [Shard(0)])
        (x.sum(0) * 2).full_tensor()
        _prepared.add("process")
    if case.startswith("opdb:") and "database" not in _prepared:
        op_db_sweep.database()
        _prepared.add("database")
    if len(_prepared) > before:
        gc.collect()
        gc.freeze()


def measure(case: str, samples: int, rounds: int, warm_calls: int) -> dict[str, Any]:
    """Rank body: this rank's timings of ``case`` in seconds, per round: the first call after
    the caches were cleared and the fastest of ``warm_calls`` warm calls."""
    _prepare_process(case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            _run_plain(_instance(case, samples, sharded=False))
        except Exception as exc:
            return {"status": "skipped", "why": f"the plain call raised {type(exc).__name__}"}
        gc.collect()
        gc.disable()
        try:
            return _rounds(case, samples, rounds, warm_calls)
        finally:
            gc.enable()


def _rounds(case: str, samples: int, rounds: int, warm_calls: int) -> dict[str, Any]:
    firsts, warms = [], []
    for _ in range(rounds):
        clear_caches()
        begun = time.perf_counter()
        try:
            firsts.append(_timed(_instance(case, samples, sharded=True)))
        except Exception as exc:
            seconds = time.perf_counter() - begun
            message = " ".join(str(exc).split())[:200]
            return {"status": "error", "error": f"{type(exc).__name__}: {message}", "s": seconds}
        warm = [_timed(_instance(case, samples, sharded=True)) for _ in range(warm_calls)]
        warms.append(min(warm, key=lambda t: t[0] + t[1]))
    return {"status": "ran", "first": firsts, "warm": warms}


def _run_plain(instance: _Instance) -> None:
    """The plain call, forward and backward, untimed."""
    out = instance.call()
    terms = instance.outputs(out) if instance.grad else []
    if terms:
        torch.autograd.backward(terms, [torch.ones_like(t) for t in terms])


# ---------------------------------------------------------------------------- in the parent
def _record(case: str, per_rank: list[dict]) -> dict[str, Any]:
    """The case's record, in ms: per round and phase the slowest rank, then the round whose
    planning took least (the machine's other load only ever adds time)."""
    group, name = case.split(":", 1)
    op, _, sample = name.partition("#")
    statuses = {r["status"] for r in per_rank}
    base = {"case": case, "group": group, "op": op, "sample": int(sample) if sample else None}
    if statuses == {"skipped"}:
        return {**base, "status": "skipped", "why": per_rank[0]["why"]}
    if statuses != {"ran"}:
        first_ms = max(1e3 * r["s"] for r in per_rank if "s" in r)
        errors = sorted({r.get("error", r["status"]) for r in per_rank})
        return {**base, "status": "error", "first_ms": round(first_ms, 2), "error": errors}
    rounds = [
        _round_record(
            [max(1e3 * r["first"][i][phase] for r in per_rank) for phase in range(4)],
            [max(1e3 * r["warm"][i][phase] for r in per_rank) for phase in range(4)],
        )
        for i in range(len(per_rank[0]["first"]))
    ]
    best = min(rounds, key=lambda r: r["planning_ms"])
    return {
        **base,
        "status": "ran",
        **best,
        "rounds": len(rounds),
        "first_round_planning_ms": rounds[0]["planning_ms"],
        "min_planning_cpu_ms": min(r["planning_cpu_ms"] for r in rounds),
    }


def _round_record(first: list[float], warm: list[float]) -> dict[str, float]:
    """Figures of one round from its (forward wall, backward wall, forward CPU, backward CPU)
    of the first call and of the warm call, in ms."""
    figures = {
        "first_ms": first[0] + first[1],
        "warm_ms": warm[0] + warm[1],
        "planning_ms": first[0] + first[1] - warm[0] - warm[1],
        "forward_first_ms": first[0],
        "forward_warm_ms": warm[0],
        "forward_planning_ms": first[0] - warm[0],
        "first_cpu_ms": first[2] + first[3],
        "warm_cpu_ms": warm[2] + warm[3],
        "planning_cpu_ms": first[2] + first[3] - warm[2] - warm[3],
    }
    return {name: round(value, 2) for name, value in figures.items()}


def _run(case: str, samples: int, rounds: int, warm_calls: int) -> dict[str, Any]:
    """The case's record; ``status: "failed"`` when a rank raised outside the op, died or
    hung (the pool is then replaced)."""
    try:
        per_rank = on_ranks(WORLD, measure, case, samples, rounds, warm_calls)
    except RankFailure as failure:
        why = next((line for line in str(failure).splitlines() if line.strip()), "")
        return {"case": case, "status": "failed", "why": why[:300]}
    return _record(case, per_rank)


def _summary(records: list[dict], check: bool) -> None:
    ran = [r for r in records if r["status"] == "ran"]
    timed = ran + [r for r in records if r["status"] == "error"]
    cost = lambda r: r.get("planning_ms", r.get("first_ms", 0.0))  # noqa: E731
    slowest = sorted(timed, key=cost, reverse=True)[:SLOWEST]
    goal = Goal(
        f"no op plans for more than {GOAL_MS:g} ms on its first call",
        all(cost(r) <= GOAL_MS for r in timed),
    )
    emit_summary(
        [goal],
        check,
        cases=len(records),
        ran=len(ran),
        errors=sum(r["status"] == "error" for r in records),
        skipped=sum(r["status"] == "skipped" for r in records),
        failed=[r["case"] for r in records if r["status"] == "failed"],
        above_goal=sum(cost(r) > GOAL_MS for r in timed),
        above_goal_forward=sum(r["forward_planning_ms"] > GOAL_MS for r in ran),
        above_goal_cpu=sum(r["min_planning_cpu_ms"] > GOAL_MS for r in ran),
        above_goal_first_round=sum(r["first_round_planning_ms"] > GOAL_MS for r in ran),
        slowest=[
            {
                "case": r["case"],
                "planning_ms": cost(r),
                "first_ms": r["first_ms"],
                "first_round_planning_ms": r.get("first_round_planning_ms"),
                "planning_cpu_ms": r.get("min_planning_cpu_ms"),
                "status": r["status"],
            }
            for r in slowest
        ],
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=None, help="regex on 'group:op' (default every case)")
    parser.add_argument("--limit", type=int, default=None, help="run the first N cases only")
    parser.add_argument("--samples", type=int, default=1, help="op-database samples per op")
    parser.add_argument("--rounds", type=int, default=3, help="first calls per case")
    parser.add_argument("--warm", type=int, default=3, help="warm calls per round")
    args = parse_arguments(parser, argv)
    records = []
    with rank_pools():
        for case in itertools.islice(_cases(args.ops, args.samples), args.limit):
            records.append(_run(case, args.samples, args.rounds, args.warm))
            emit("first_call", **records[-1])
    _summary(records, args.check)


if __name__ == "__main__":
    main()
