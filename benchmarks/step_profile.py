"""Where a zoo model's sharded training step spends its CPU time, op family by op family, on 1,
2 and 4 ranks: what halves with the shard and what does not.

# NOTE [CPU time per op family]
The step is ``cost_model``'s own (``sharded_step``: a ``(1, 1, N, N)`` field, H split over
``P`` ranks, or a graph of ``--nodes`` nodes in ``P`` METIS parts). Each call builds it, makes
two warm-up steps, times ``--steps`` steps unwatched (each from a barrier; the rank's CPU time,
``time.process_time``) and then ``--steps`` steps watched by ``_CpuPerOp``: a dispatch mode
that charges every aten op the CPU time of the calling thread (``time.thread_time``: not wall
time, so neither waiting in a collective nor being descheduled on a loaded machine counts),
less the ops dispatched inside it (a ShardTensor op's own time is its handler's Python and
whatever kernels it runs without dispatching them, e.g. the elementwise fast path). The mode
sees the ShardTensor ops and the aten ops their handlers run on local shards alike. Besides
the ops: ``outside_ops`` (the thread's CPU time outside every op: module code, autograd, the
mode's own cost) and ``other_threads`` (the process's CPU time less the thread's: gloo's
worker threads running the collectives). Rank counts are interleaved in each of ``--rounds``
rounds, the order reversed every round. Figures are medians over ranks, rounds and steps.

The watched step costs more than the unwatched one (about 50-75 µs per op under load); the
``kernels`` of ``FAMILIES`` are timed inside the op and are not inflated by it. Run ``python -m
benchmarks.step_profile [--models fno] [--ranks 1 2 4] [--size 128] [--rounds 2] [--steps
3]``; JSON lines on stdout, fields in README.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from benchmarks._common import emit, emit_summary, on_ranks, parse_arguments, rank_pools
from benchmarks.calibrate_steps import layout
from benchmarks.cost_model import GEOMETRY, sharded_step
from shardsci import ShardTensor

# Family -> substrings of the aten op names it holds; the first family that matches wins.
FAMILIES: dict[str, tuple[str, ...]] = {
    "fft": ("_fft_",),
    "matmul": ("bmm", "aten.mm", "addmm", "linear"),
    "convolution": ("conv",),
    "collective": ("c10d", "wait_tensor", "all_to_all", "all_reduce", "all_gather"),
    "copy": ("copy_", "clone", "cat", "pad", "_to_copy", "zeros", "fill_", "empty", "stack"),
    "view": (
        "view",
        "slice",
        "permute",
        "transpose",
        "detach",
        "expand",
        "alias",
        "squeeze",
        "as_strided",
        "select",
        "split",
        "unbind",
        "aten.t.",
        "_conj",
        "real",
    ),
}


def family(op: str, on_shardtensors: bool) -> str:
    """The op family of the aten op named ``op`` (``shardtensor``: an op on ShardTensors,
    whose own time is its handler's)."""
    if on_shardtensors:
        return "shardtensor"
    return next((name for name, keys in FAMILIES.items() if any(k in op for k in keys)), "other")


class _CpuPerOp(TorchDispatchMode):
    """While active: per op family, the calling thread's CPU seconds inside its ops, less the
    ops nested in them (``seconds``), and its calls (``calls``)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._nested: list[float] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:  # type: ignore[override]
        name = family(str(func), any(isinstance(t, ShardTensor) for t in tree_leaves(args)))
        self._nested.append(0.0)
        start = time.thread_time()
        try:
            return func(*args, **(kwargs or {}))
        finally:
            inside = time.thread_time() - start
            self.seconds[name] += inside - self._nested.pop()
            self.calls[name] += 1
            if self._nested:
                self._nested[-1] += inside


def profile_step(name: str, mesh_shape: tuple[int, ...], shape: tuple, steps: int) -> dict:
    """Rank body: the unwatched step's CPU seconds, and the watched steps' per family."""
    _, step = sharded_step(name, mesh_shape, shape)
    step()
    step()
    unwatched = []
    for _ in range(steps):
        dist.barrier()
        start = time.process_time()
        step()
        unwatched.append(time.process_time() - start)
    dist.barrier()
    watch = _CpuPerOp()
    process, thread = time.process_time(), time.thread_time()
    with watch:
        for _ in range(steps):
            step()
    process, thread = time.process_time() - process, time.thread_time() - thread
    per_step = {k: v / steps for k, v in watch.seconds.items()}
    return {
        "cpu_s": statistics.median(unwatched),
        "families_s": per_step,
        "calls": {k: v / steps for k, v in watch.calls.items()},
        "outside_ops_s": (thread - sum(watch.seconds.values())) / steps,
        "other_threads_s": (process - thread) / steps,
    }


def profile(name: str, args: argparse.Namespace) -> dict[int, list[dict]]:
    """Rank count -> every rank's ``profile_step`` of every round, interleaved."""
    results: dict[int, list[dict]] = {p: [] for p in args.ranks}
    order = list(args.ranks)
    for _ in range(args.rounds):
        for ranks in order:
            mesh_shape, shape = layout(name, ranks, args.size, args.nodes)
            results[ranks] += on_ranks(ranks, profile_step, name, mesh_shape, shape, args.steps)
        order.reverse()
    return results


def _ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["fno"], choices=list(GEOMETRY))
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--size", type=int, default=128, help="N of the (1, 1, N, N) field")
    parser.add_argument("--nodes", type=int, default=4096, help="the graph's nodes")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="steps per call, each way")
    args = parse_arguments(parser, argv)
    torch.set_num_threads(1)
    with rank_pools():
        for name in args.models:
            for ranks, runs in profile(name, args).items():
                families = sorted({f for run in runs for f in run["families_s"]})
                emit(
                    "profile",
                    model=name,
                    ranks=ranks,
                    cpu_ms=_ms([run["cpu_s"] for run in runs]),
                    families_ms={
                        f: _ms([r["families_s"].get(f, 0.0) for r in runs]) for f in families
                    },
                    calls={
                        f: statistics.median(r["calls"].get(f, 0) for r in runs) for f in families
                    },
                    outside_ops_ms=_ms([run["outside_ops_s"] for run in runs]),
                    other_threads_ms=_ms([run["other_threads_s"] for run in runs]),
                    load_average=round(os.getloadavg()[0], 1),
                )
    emit_summary([], args.check)


if __name__ == "__main__":
    main()
