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
function handlers' calls (``function_calls``). The machine does not price them yet:
``_machine.ops_host_s`` charges every ShardTensor op ``host_us_per_op`` (what pricing by path
needs: benchmarks/README.md).

Held against steps: each zoo model's 1-rank ShardTensor step at ``host_overhead``'s tile, its
calls counted and its CPU time against the plain step's; ``priced_over_added`` says what share
of that premium its calls at these figures make (benchmarks/README.md: the share is the same
across models, 0.31-0.48, where a flat rate per aten op gets 0.24-0.49 of each).

Run ``python -m benchmarks.calibrate_dispatch [--repeats 7] [--models ...] [--steps 10]``;
JSON lines on stdout: one ``dispatch_op`` record per op (µs added per call, spread), one
``dispatch_step`` per model, and the ``summary`` with each path's figure; fields in README.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks._common import emit, emit_summary, on_ranks, parse_arguments, rank_pools, spread
from benchmarks.compile import CASES
from benchmarks.host_overhead import training_step
from shardsci import Shard, ShardTensor
from shardsci.planning._work import WorkCounter
from shardsci.tensor._dispatch import tally_paths
from shardsci.tensor._registry import function_handler_for
from shardsci.testing import get_mesh

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
    """Rank body (1 rank): the zoo model ``name``'s ShardTensor step and plain step at
    ``host_overhead``'s tile (``training_step``): the first's ShardTensor calls (``WorkCounter``:
    ``path_ops``, ``function_calls``), both steps' aten ops and their CPU seconds, ``steps``
    of each, alternated."""
    torch.set_num_threads(1)
    runs = {v: training_step(name, v == "shardtensor", 16, 64) for v in ("torch", "shardtensor")}
    counted = {}
    for variant, step in runs.items():
        step()  # warm-up: caches, first-call planning
        with WorkCounter() as work:
            step()
        counted[variant] = work
    cpu: dict[str, list[float]] = {v: [] for v in runs}
    for i in range(steps):
        for variant in runs if i % 2 == 0 else reversed(list(runs)):
            start = time.process_time()
            runs[variant]()
            cpu[variant].append(time.process_time() - start)
    return {
        "path_ops": dict(counted["shardtensor"].path_ops),
        "function_calls": counted["shardtensor"].function_calls,
        "ops": {v: work.ops for v, work in counted.items()},
        "cpu_s": cpu,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--models", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    args = parse_arguments(parser, argv)
    with rank_pools():
        (added,) = on_ranks(1, measure_paths, args.repeats)
        figures = path_figures(added)
        for path, ops in added.items():
            for name, samples in ops.items():
                emit("dispatch_op", path=path, op=name, added_us=spread(samples, 1))
        for name in args.models:
            (step,) = on_ranks(1, measure_step, name, args.steps)
            plain, sharded = (statistics.median(step["cpu_s"][v]) for v in ("torch", "shardtensor"))
            priced = price_step(step, figures) * 1e-6
            emit(
                "dispatch_step",
                model=name,
                path_ops=step["path_ops"],
                function_calls=step["function_calls"],
                ops=step["ops"],
                cpu_ms={v: spread([t * 1e3 for t in step["cpu_s"][v]], 2) for v in step["cpu_s"]},
                added_ms=round((sharded - plain) * 1e3, 2),
                priced_ms=round(priced * 1e3, 2),
                priced_over_added=round(priced / (sharded - plain), 2),
                added_us_per_plain_op=round((sharded - plain) / step["ops"]["torch"] * 1e6, 1),
                priced_us_per_plain_op=round(priced / step["ops"]["torch"] * 1e6, 1),
                load_average=round(os.getloadavg()[0], 1),
            )
    emit_summary([], args.check, added_us_per_call={p: round(us, 1) for p, us in figures.items()})


if __name__ == "__main__":
    main()
