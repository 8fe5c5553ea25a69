"""The host time a ShardTensor call adds, by what the call is: its dispatch path.

# NOTE [Host time by dispatch path]
A ShardTensor step costs the host more than the plain step, and not by a constant per aten op:
at 1 rank and a 16² tile, the UNet's ShardTensor ops added 15.8 µs a plain op and the FNO's
70.4 (``host_overhead``, 2026-11-29 09:24 UTC). What a call costs depends on the way it takes
through ShardTensor: an aten op on ShardTensors takes one of three dispatch paths (NOTE
[Dispatch paths] in ``shardsci.tensor._dispatch``: ``fast``, ``propagation``, ``handler``),
and a torch function with a registered function handler (a convolution, a normalisation, a
linear, ``einsum``) runs that handler's Python above autograd (``function``). So each is
measured here on one rank: the CPU time (``time.process_time``) of ``CALLS`` calls of each op
of ``OPS`` on a ``SHARD`` ShardTensor, less that of the same calls on its local shard as a
plain tensor, per call, taken side by side ``repeats`` times (the order alternated), the median
over them; a path's figure is the median over its ops. Forward only, inputs requiring grad
(as a training step's forward records its graph); the ops' kernels are a few hundred elements.
Every op's path is checked (``tally_paths``; a function handler by ``function_handler_for``)
before it is timed. ``WorkCounter`` counts a step's ops by path (``path_ops``) and its
function handlers' calls (``function_calls``): ``dispatch_calls``, which the ``Machine``
prices by path (NOTE [Host time by dispatch path] in ``shardsci.planning._machine``).

Held against steps: each zoo model's ShardTensor step at ``host_overhead``'s tile on each of
``--worlds`` (rank counts), its calls counted and its CPU time against the plain step's of
one rank's tile; ``priced_over_added`` says what share of that premium its calls at these
figures make (benchmarks/README.md: the same across models, 0.25-0.55). ``in_step_factor``
(1-rank UNet: its CPU time less its aten ops at the plain step's rate, over its calls at this
run's figures) is the ``Machine``'s ``host_calls_in_step_factor``. Each timed pair of steps
(ShardTensor, plain; slowest rank) is held against the host term of ``gloo_cpu(world)``:
measured host = the ShardTensor step's CPU less the plain step's kernels (its CPU less its
aten ops at ``plain_host_us_per_op``); predicted = ``ops_host_s`` of the step's aten ops and
calls plus issuing its collectives (``collective_host_s``, ``count_traffic``), by path
(``host_ratio_by_path``) and at the flat ``host_us_per_op`` (``host_ratio_flat``, as before
the calls were priced by path): medians of the pairs' predicted over measured.

Run ``python -m benchmarks.calibrate_dispatch [--repeats 7] [--models ...] [--steps 10]
[--worlds 1 2]``; JSON lines on stdout: one ``dispatch_op`` record per op (µs added per call,
spread), one ``dispatch_step`` per model and world, and the ``summary`` with each path's
figure and ``in_step_factor``; fields in README.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks._common import emit, emit_summary, on_ranks, parse_arguments, rank_pools, spread
from benchmarks.compile import CASES
from benchmarks.host_overhead import training_step
from shardsci import Shard, ShardTensor
from shardsci.planning._machine import (
    HALO_KINDS,
    Machine,
    collective_host_s,
    gloo_cpu,
    ops_host_s,
)
from shardsci.planning._work import WorkCounter
from shardsci.tensor._dispatch import tally_paths
from shardsci.tensor._registry import function_handler_for
from shardsci.testing import Traffic, count_traffic, get_mesh

SHARD = (1, 4, 8, 8)
"""The local shard every op is timed on: ``(B, C, H, W)``, H split (one rank holds it all)."""
CALLS = 50
"""Calls per timing: enough that ``time.process_time``'s tick is under 1 %."""

Op = Callable[[torch.Tensor, torch.Tensor], object]
OPS: dict[str, tuple[Op, Callable | None]] = {
    "add": (lambda x, w: x + x, None),
    "mul_scalar": (lambda x, w: x * 2.0, None),
    "gelu": (lambda x, w: F.gelu(x), None),
    "mean_hw": (lambda x, w: x.mean(dim=(-2, -1)), None),
    "sum_c": (lambda x, w: x.sum(1), None),
    "narrow_w": (lambda x, w: x.narrow(-1, 1, 4), None),
    "flip_w": (lambda x, w: x.flip(-1), None),
    "pad_w": (lambda x, w: torch.constant_pad_nd(x, (1, 1)), None),
    "flip_h": (lambda x, w: x.flip(2), None),
    "roll_h": (lambda x, w: x.roll(1, 2), None),
    "conv2d": (lambda x, w: F.conv2d(x, w, padding=1), torch.conv2d),
    "group_norm": (lambda x, w: F.group_norm(x, 2), F.group_norm),
    "linear": (lambda x, w: F.linear(x, w.flatten(1)[:, : SHARD[-1]]), F.linear),
    "layer_norm": (lambda x, w: F.layer_norm(x, (SHARD[-1],)), F.layer_norm),
    "rfft_w": (lambda x, w: torch.fft.rfft(x, dim=-1), torch.fft.rfft),
}
"""Op name -> (the op of a field ``x`` and a ``(C, C, 3, 3)`` weight ``w``; the torch function
whose function handler it calls, or None for one aten op on ShardTensors)."""


def _operands() -> tuple[ShardTensor, torch.Tensor, torch.Tensor]:
    mesh = get_mesh((1,))
    local = torch.randn(SHARD, generator=torch.Generator().manual_seed(0))
    x = ShardTensor.from_local(local, mesh, [Shard(2)], {0: (SHARD[2],)}).requires_grad_()
    weight = torch.randn(SHARD[1], SHARD[1], 3, 3).requires_grad_()
    return x, local.clone().requires_grad_(), weight


def _path(name: str, op: Op, handled: Callable | None, x, weight) -> str:
    """The path ``op`` takes: ``function`` for a call of a function handler, else that of
    its one aten op on ShardTensors (raise unless it is one)."""
    if handled is not None:
        if function_handler_for(handled) is None:
            raise RuntimeError(f"{name}: {handled} has no function handler")
        return "function"
    with tally_paths() as tally:
        op(x, weight)
    if sum(tally.outermost.values()) != 1:
        raise RuntimeError(f"{name}: took {dict(tally.outermost)}, expected one aten op")
    return next(iter(tally.outermost))


def _cpu_per_call(op: Op, x: torch.Tensor, weight: torch.Tensor) -> float:
    start = time.process_time()
    for _ in range(CALLS):
        op(x, weight)
    return (time.process_time() - start) / CALLS


def measure_paths(repeats: int) -> dict[str, dict[str, list[float]]]:
    """Rank body (1 rank): path -> op -> µs of CPU each of ``repeats`` timings adds per call."""
    torch.set_num_threads(1)
    x, plain, weight = _operands()
    added: dict[str, dict[str, list[float]]] = {}
    for name, (op, handled) in OPS.items():
        path = _path(name, op, handled, x, weight)
        op(x, weight), op(plain, weight)  # warm-up: plans, caches
        samples = []
        for repeat in range(repeats):
            order = (x, plain) if repeat % 2 == 0 else (plain, x)
            seconds = {id(t): _cpu_per_call(op, t, weight) for t in order}
            samples.append((seconds[id(x)] - seconds[id(plain)]) * 1e6)
        added.setdefault(path, {})[name] = samples
    return added


def path_figures(added: dict[str, dict[str, list[float]]]) -> dict[str, float]:
    """Path -> µs added per call: the median over its ops of each op's median."""
    return {
        path: statistics.median(statistics.median(s) for s in ops.values())
        for path, ops in added.items()
    }


def price_step(counts: dict, figures: dict[str, float]) -> float:
    """µs a step's ShardTensor calls add at ``figures`` (path -> µs per call): its aten ops on
    ShardTensors by path and its function handlers' calls (``function``)."""
    calls = {**counts["path_ops"], "function": counts["function_calls"]}
    return sum(n * figures.get(path, 0.0) for path, n in calls.items())


def measure_step(name: str, steps: int) -> dict:
    """Rank body: the zoo model ``name``'s ShardTensor step and plain step at
    ``host_overhead``'s tile (``training_step``): the first's aten ops, those of its
    communication modules, its ShardTensor calls (``WorkCounter``: ``path_ops``,
    ``function_calls``) and the CPU its collectives cost to issue on ``gloo_cpu`` of this world
    (``issued_s``), the plain step's aten ops, and both steps' CPU seconds, ``steps`` of each,
    alternated."""
    torch.set_num_threads(1)
    runs = {v: training_step(name, v == "shardtensor", 16, 64) for v in ("torch", "shardtensor")}
    counted = {}
    for variant, step in runs.items():
        step()  # warm-up: caches, first-call planning
        with WorkCounter() as work:
            step()
        counted[variant] = work
    with count_traffic() as traffic:
        runs["shardtensor"]()
    cpu: dict[str, list[float]] = {v: [] for v in runs}
    for i in range(steps):
        for variant in runs if i % 2 == 0 else reversed(list(runs)):
            start = time.process_time()
            runs[variant]()
            cpu[variant].append(time.process_time() - start)
    sharded = counted["shardtensor"]
    return {
        "path_ops": dict(sharded.path_ops),
        "function_calls": sharded.function_calls,
        "communication_ops": sharded.communication_ops,
        "issued_s": issued_s(gloo_cpu(dist.get_world_size()), traffic),
        "ops": {v: work.ops for v, work in counted.items()},
        "cpu_s": cpu,
    }


def issued_s(machine: Machine, traffic: Traffic) -> float:
    """Host seconds of issuing ``traffic``'s collectives and rounds of messages on
    ``machine``, each over its own ranks (an all-to-all over its group), as the dry run's
    projection prices them (``_choose._project_class``)."""
    seconds, peers, received = 0.0, set(), 0.0
    for span, calls in traffic.calls_by_span.items():
        if span.kind in HALO_KINDS:
            peers |= set(span.ranks)
            received += traffic.received_by_span[span]
            continue
        posted = span.group if span.kind == "all_to_all" else len(span.ranks)
        seconds += collective_host_s(
            machine, span.kind, posted, calls, traffic.received_by_span[span]
        )
    if peers:
        seconds += collective_host_s(machine, "p2p", len(peers), traffic.p2p_rounds, received)
    return seconds


def in_step_factor(step: dict, figures: dict[str, float]) -> float:
    """A step's (``measure_step``'s) CPU time less its aten ops at the plain step's CPU per op,
    over its calls at ``figures`` (NOTE [Host time by dispatch path]): what its calls cost in
    the step over what they cost in a loop."""
    plain, sharded = (statistics.median(step["cpu_s"][v]) for v in ("torch", "shardtensor"))
    own = sharded - step["ops"]["shardtensor"] * plain / step["ops"]["torch"]
    return own / (price_step(step, figures) * 1e-6)


def host_ratios(step: dict, machine: Machine) -> dict[str, float]:
    """The step's predicted over measured host seconds, each pair of timed steps (NOTE [Host
    time by dispatch path]): ``by_path`` and ``flat`` (every aten op at ``host_us_per_op``);
    medians."""
    calls = {**step["path_ops"], "function": step["function_calls"]}
    ops, communication = step["ops"]["shardtensor"], step["communication_ops"]
    predicted = {
        "by_path": ops_host_s(machine, ops, communication, True, calls),
        "flat": ops_host_s(machine, ops, communication, True),
    }
    plain_host = step["ops"]["torch"] * machine.plain_host_us_per_op * 1e-6
    measured = [
        sharded - (plain - plain_host)
        for sharded, plain in zip(step["cpu_s"]["shardtensor"], step["cpu_s"]["torch"])
    ]
    return {
        way: round(statistics.median((p + step["issued_s"]) / m for m in measured), 2)
        for way, p in predicted.items()
    }


def slowest(per_rank: list[dict]) -> dict:
    """One world's ``measure_step`` results as one: each timed step's CPU seconds at its
    slowest rank, every count of the rank with the most aten ops."""
    busiest = max(per_rank, key=lambda r: r["ops"]["shardtensor"])
    cpu = {v: [max(s) for s in zip(*(r["cpu_s"][v] for r in per_rank))] for v in busiest["cpu_s"]}
    return {**busiest, "cpu_s": cpu}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--models", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    parser.add_argument("--worlds", nargs="+", type=int, default=[1], help="ranks of the steps")
    args = parse_arguments(parser, argv)
    with rank_pools():
        (added,) = on_ranks(1, measure_paths, args.repeats)
        figures = path_figures(added)
        for path, ops in added.items():
            for name, samples in ops.items():
                emit("dispatch_op", path=path, op=name, added_us=spread(samples, 1))
        factor = None
        for name in args.models:
            for world in args.worlds:
                step = slowest(on_ranks(world, measure_step, name, args.steps))
                if name == "unet" and world == 1:
                    factor = in_step_factor(step, figures)
                emit_step(name, world, step, figures)
    emit_summary(
        [],
        args.check,
        added_us_per_call={p: round(us, 1) for p, us in figures.items()},
        in_step_factor=None if factor is None else round(factor, 3),
    )


def emit_step(name: str, world: int, step: dict, figures: dict[str, float]) -> None:
    """One ``dispatch_step`` record: ``name``'s step on ``world`` ranks (``slowest``)."""
    plain, sharded = (statistics.median(step["cpu_s"][v]) for v in ("torch", "shardtensor"))
    priced = price_step(step, figures) * 1e-6
    ratios = host_ratios(step, gloo_cpu(world))
    emit(
        "dispatch_step",
        model=name,
        ranks=world,
        path_ops=step["path_ops"],
        function_calls=step["function_calls"],
        communication_ops=step["communication_ops"],
        ops=step["ops"],
        cpu_ms={v: spread([t * 1e3 for t in step["cpu_s"][v]], 2) for v in step["cpu_s"]},
        added_ms=round((sharded - plain) * 1e3, 2),
        priced_ms=round(priced * 1e3, 2),
        priced_over_added=round(priced / (sharded - plain), 2),
        added_us_per_plain_op=round((sharded - plain) / step["ops"]["torch"] * 1e6, 1),
        priced_us_per_plain_op=round(priced / step["ops"]["torch"] * 1e6, 1),
        issued_ms=round(step["issued_s"] * 1e3, 2),
        host_ratio_by_path=ratios["by_path"],
        host_ratio_flat=ratios["flat"],
        load_average=round(os.getloadavg()[0], 1),
    )


if __name__ == "__main__":
    main()
