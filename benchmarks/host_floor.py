"""The floor of a tensor subclass's host time: one training step of every zoo model on one
rank, at a tile so small that kernels cost almost nothing, on plain tensors and under three
tensor subclasses.

Issue 21 item 1 asks for ShardTensor eager at most 1.5x plain eager's host time per step.
This benchmark asks what any Python tensor subclass pays, so that the goal can be judged
against a floor rather than against plain torch alone. Per model, one rank runs four variants
side by side in one process, each from the same seed and data:

- ``torch``: the model on plain tensors (``host_overhead``'s ``torch`` step);
- ``wrapper``: the model with its parameters and inputs wrapped in :class:`Unwrapping`, the
  least a Python ``__torch_dispatch__`` wrapper subclass does (unwrap the operands, call the
  op, wrap the results; ``__torch_function__`` disabled, no layout, no cache);
- ``dtensor``: torch's own DTensor on a mesh of one rank: parameters replicated
  (``distribute_module``), inputs sharded on the dims ShardTensor splits (H of a field, the
  node and edge rows of a graph), plain tensors the model makes taken as replicated
  (``implicit_replication``); DTensor's dispatch has a C++ fast path with a sharding
  cache in C++ (``torch._C._get_DTensor_sharding_propagator_cache_stats``);
- ``shardtensor``: the model under ``domain_parallel`` on ShardTensors (``host_overhead``'s
  ``shardtensor`` step).

A variant a model does not run under is reported with the error its first step raised. One
step is forward, a mean-square loss, backward, no optimiser. Each variant makes one warm-up
step, then ``--rounds`` rounds of ``--steps`` steps, the order reversed every round
(``_common.interleaved_steps``). Figures: medians and spread of wall and process CPU time,
and each variant's ratio to ``torch``, per round (median and spread of the per-step ratios).
Ops per step: aten ops each variant's step dispatches at the subclass's level (a
``TorchDispatchMode``, one untimed step). DTensor's C++ sharding cache: hits and misses over
the timed steps. Each variant's first step is checked against the plain one's: the largest
difference of its output and gradients (``max_rel_diff_from_torch``, float32).

``--per-op`` first emits ``host_floor_op``: the thread CPU time of one pointwise op that
requires grad (forward), per variant, ``--rounds`` samples: what each subclass adds to one
aten op, apart from a step's kernels and backward.

``--variants torch shardtensor --tile T`` (``--nodes N`` for the graph) gives the crossover
run: the tile at which ShardTensor's step reaches 1.5x plain torch's. Run ``python -m
benchmarks.host_floor [--models ...] [--variants ...] [--rounds 21] [--steps 2] [--tile 16]
[--nodes 64] [--per-op]``; JSON lines on stdout, fields in README.md.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_module
from torch.distributed.tensor.experimental import implicit_replication

from benchmarks._common import (
    Goal,
    emit,
    emit_summary,
    interleaved_steps,
    on_ranks,
    parse_arguments,
    rank_pools,
    spread,
)
from benchmarks.compile import CASES, RANK_TIMEOUT_S
from benchmarks.host_overhead import (
    GOAL_RATIO,
    MIN_TILE,
    TrainingStep,
    _OpCounter,
    _timed,
    training_step,
)
from shardsci import ShardTensor
from shardsci.testing import get_mesh, run_on_ranks

VARIANTS = ("torch", "wrapper", "dtensor", "shardtensor")
OP_CALLS = 200  # pointwise pairs per sample of --per-op


class Unwrapping(torch.Tensor):
    """A wrapper subclass that only unwraps, calls the op and wraps: the least host work a
    Python ``__torch_dispatch__`` subclass does per aten op."""

    elem: torch.Tensor
    __slots__ = ("elem",)

    @staticmethod
    def __new__(cls, elem: torch.Tensor, requires_grad: bool = False) -> Unwrapping:
        result = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.shape,
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            device=elem.device,
            requires_grad=requires_grad,
        )
        result.elem = elem
        return result

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*_unwrapped(args), **{k: _unwrapped_one(v) for k, v in (kwargs or {}).items()})
        if func._schema.is_mutable:
            return args[0]  # in place: the wrapper already holds the written tensor
        if isinstance(out, torch.Tensor):
            return cls(out)
        if isinstance(out, (tuple, list)):
            return type(out)(cls(t) if isinstance(t, torch.Tensor) else t for t in out)
        return out


def _unwrapped_one(value):
    if type(value) is Unwrapping:
        return value.elem
    if isinstance(value, (tuple, list)):
        return _unwrapped(value)
    return value


def _unwrapped(values):
    return type(values)(_unwrapped_one(v) for v in values)


# --------------------------------------------------------------------------- variants
def _plain_args(name: str, tile: int, nodes: int) -> tuple:
    """The plain step's inputs (``host_overhead``'s, one rank)."""
    return training_step(name, False, tile, nodes).args


def wrap_parameters(model: nn.Module) -> nn.Module:
    """``model`` with every parameter an :class:`Unwrapping` of its value, in place."""
    for module in model.modules():
        for key, parameter in list(module._parameters.items()):
            if parameter is not None:
                module._parameters[key] = nn.Parameter(Unwrapping(parameter.detach()))
    return model


def _wrapper_step(name: str, tile: int, nodes: int) -> TrainingStep:
    torch.manual_seed(0)
    model = wrap_parameters(CASES[name].build())
    args = tuple(Unwrapping(a) for a in _plain_args(name, tile, nodes))
    return TrainingStep(model, model, args)


def _dtensor_step(name: str, tile: int, nodes: int) -> TrainingStep:
    torch.manual_seed(0)
    mesh = get_mesh((1,))
    model = distribute_module(CASES[name].build(), mesh)
    plain = _plain_args(name, tile, nodes)
    # ShardTensor's split dims: a field's H; a graph's node rows, edge rows, edge index columns
    dims = (0, 0, 1) if name == "meshgraphnet" else (2,)
    args = tuple(DTensor.from_local(a, mesh, [Shard(d)]) for a, d in zip(plain, dims))
    return TrainingStep(model, model, args)


def _step(variant: str, name: str, tile: int, nodes: int) -> TrainingStep:
    if variant == "wrapper":
        return _wrapper_step(name, tile, nodes)
    if variant == "dtensor":
        return _dtensor_step(name, tile, nodes)
    return training_step(name, variant == "shardtensor", tile, nodes)


def _dtensor_training_step(step: TrainingStep) -> torch.Tensor:
    """``TrainingStep.step`` under DTensor: the plain tensors a model makes in its forward
    (coordinates, masks) taken as replicated (``implicit_replication``), the loss made whole
    before backward."""
    step.model.zero_grad(set_to_none=True)
    with implicit_replication():
        out = step.run(*step.args)
        loss = (out * out).mean().full_tensor()
        loss.backward()
    return out.detach()


def _plain(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, Unwrapping):
        return t.elem
    return t.full_tensor() if isinstance(t, (DTensor, ShardTensor)) else t


def _difference(step: TrainingStep, out: torch.Tensor, reference: dict) -> float:
    """The largest difference of a step's output and gradients from the plain step's
    (``reference``: name -> tensor), relative to each reference value's largest magnitude:
    the variants do the same work only if they compute the same values."""
    found = {"out": _plain(out)} | {
        name: _plain(p.grad) for name, p in step.model.named_parameters() if p.grad is not None
    }
    if found.keys() != reference.keys():
        return float("inf")  # a gradient missing on one side
    return max(
        ((found[k] - reference[k]).abs().max() / reference[k].abs().max().clamp_min(1e-30)).item()
        for k in reference
    )


# --------------------------------------------------------------------------- rank body
def time_floor(names: list[str], rounds: int, steps: int, tile: int, nodes: int, model: str):
    """Rank body (one rank): per variant, its timed steps (wall, CPU) and one step's ops, or
    the error its first step raised."""
    torch.set_num_threads(1)
    runs: dict[str, Callable[[], torch.Tensor]] = {}
    ops: dict[str, int] = {}
    errors: dict[str, str] = {}
    difference: dict[str, float] = {}
    reference: dict[str, torch.Tensor] = {}
    for variant in names:
        try:
            step = _step(variant, model, tile, nodes)
            run = (lambda s=step: _dtensor_training_step(s)) if variant == "dtensor" else step.step
            out = run()  # warm-up: caches, first-call planning
            with _OpCounter() as counter:
                run()
        except Exception as error:  # a model that does not run under this subclass
            errors[variant] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            continue
        runs[variant] = run
        ops[variant] = sum(counter.ops.values())
        if variant == "torch":
            reference = {"out": out} | {
                n: p.grad for n, p in step.model.named_parameters() if p.grad is not None
            }
        elif reference:
            difference[variant] = float(f"{_difference(step, out, reference):.1e}")
    cache_before = torch._C._get_DTensor_sharding_propagator_cache_stats()
    cpu: dict[str, list[float]] = {v: [] for v in runs}
    wall = interleaved_steps(list(runs), rounds, lambda v: _timed(runs[v], steps, cpu[v]))
    hits, misses = (
        after - before
        for after, before in zip(
            torch._C._get_DTensor_sharding_propagator_cache_stats(), cache_before
        )
    )
    return {
        "wall": wall,
        "cpu": cpu,
        "ops": ops,
        "errors": errors,
        "difference": difference,
        "dtensor_cache": {"hits": hits, "misses": misses},
    }


def time_one_op(rounds: int, calls: int) -> dict[str, list[float]]:
    """Rank body (one rank): per variant, thread CPU µs of one pointwise aten op (``a * b``
    then ``+ a`` on ``(1, 8, 16, 16)`` operands that require grad, forward only), one sample
    per round of ``calls`` pairs, the variants' order reversed every round."""
    torch.set_num_threads(1)
    mesh = get_mesh((1,))
    make = {
        "torch": lambda t: t,
        "wrapper": Unwrapping,
        "dtensor": lambda t: DTensor.from_local(t, mesh, [Shard(2)]),
        "shardtensor": lambda t: ShardTensor.from_local(t, mesh, [Shard(2)]),
    }
    generator = torch.Generator().manual_seed(0)
    plain = [torch.randn(1, 8, 16, 16, generator=generator) for _ in range(2)]
    operands = {v: [make[v](t).detach().requires_grad_() for t in plain] for v in VARIANTS}

    def run(variant: str) -> list[float]:
        a, b = operands[variant]
        start = time.thread_time()
        for _ in range(calls):
            a * b + a
        return [(time.thread_time() - start) / (2 * calls) * 1e6]

    for variant in VARIANTS:
        run(variant)  # warm-up: DTensor's sharding cache, ShardTensor's routes
    return interleaved_steps(list(VARIANTS), rounds, run)


# --------------------------------------------------------------------------- reporting
def report_one_op(args: argparse.Namespace) -> dict[str, float]:
    """Emit the ``host_floor_op`` record; return each variant's median µs per op."""
    (samples,) = on_ranks(1, time_one_op, args.rounds, OP_CALLS)
    median = {v: round(spread(samples[v])["median"], 1) for v in VARIANTS}
    emit(
        "host_floor_op",
        op="a * b + a, (1, 8, 16, 16) float32, requires grad, forward",
        thread_cpu_us_per_op={v: spread(samples[v], 1) for v in VARIANTS},
        added_us_per_op={v: round(median[v] - median["torch"], 1) for v in VARIANTS[1:]},
    )
    return median


def report(name: str, args: argparse.Namespace) -> dict:
    """Emit one ``host_floor`` record; return each variant's ratio to ``torch``."""
    (result,) = run_on_ranks(
        1,
        time_floor,
        *(list(args.variants), args.rounds, args.steps, args.tile, args.nodes, name),
        timeout_s=RANK_TIMEOUT_S,  # a UNet's 4 x 2 x 21 steps at a load of 50
    )
    wall, cpu, ops = result["wall"], result["cpu"], result["ops"]
    ran = list(wall)
    median = {v: spread(wall[v])["median"] for v in ran}
    cpu_median = {v: spread(cpu[v])["median"] for v in ran}
    ratios = {}
    ratio_spread = {}
    for v in ran:
        if v == "torch" or "torch" not in ran:
            continue
        ratios[v] = round(median[v] / median["torch"], 2)
        ratio_spread[v] = spread(sorted(s / t for s, t in zip(wall[v], wall["torch"])), 2)
    emit(
        "host_floor",
        model=name,
        per_rank=f"{args.nodes} nodes"
        if name == "meshgraphnet"
        else f"{max(args.tile, MIN_TILE.get(name, 0))}²",
        ranks=1,
        wall_s={v: spread(wall[v], 5) for v in ran},
        cpu_s={v: spread(cpu[v], 5) for v in ran},
        ratio=ratios,
        ratio_spread=ratio_spread,
        cpu_ratio={
            v: round(cpu_median[v] / cpu_median["torch"], 2)
            for v in ran
            if v != "torch" and "torch" in ran
        },
        ops_per_step=ops,
        us_per_op={v: round(median[v] / ops[v] * 1e6, 1) for v in ran},
        added_us_per_op={
            v: round((median[v] - median["torch"]) / ops[v] * 1e6, 1)
            for v in ran
            if v != "torch" and "torch" in ran
        },
        dtensor_cache=result["dtensor_cache"] if "dtensor" in ran else None,
        max_rel_diff_from_torch=result["difference"],
        errors=result["errors"],
    )
    return ratios


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = list(CASES)
    parser.add_argument("--models", nargs="+", default=names, choices=names)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per variant per round")
    parser.add_argument("--tile", type=int, default=16, help="H = W of the field")
    parser.add_argument("--nodes", type=int, default=64, help="graph nodes")
    parser.add_argument(
        "--per-op", action="store_true", help="first, the host time of one pointwise op"
    )
    args = parse_arguments(parser, argv)
    summary, goals = {}, []
    with rank_pools():
        if args.per_op:
            summary["one_op_us"] = report_one_op(args)
        for name in args.models:
            ratios = summary[name] = report(name, args)
            for variant in ("wrapper", "shardtensor"):
                if variant in ratios:
                    goals.append(
                        Goal(
                            f"{name}, 1 rank: {variant} step at most {GOAL_RATIO}x plain torch's",
                            ratios[variant] <= GOAL_RATIO,
                        )
                    )
    emit_summary(goals, args.check, **summary)


if __name__ == "__main__":
    main()
