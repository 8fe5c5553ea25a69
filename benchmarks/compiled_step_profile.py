"""Where a compiled training step's host time goes: inside the compiled graphs (their traced
collectives included) or around them.

Per model, every rank builds ``host_overhead``'s step of the model ``torch.compile``'d and
traced through ShardTensors (``--backend``, ``aot_eager`` by default) on ``--ranks`` ranks,
and of the same model on plain tensors, makes ``--warmup`` steps (compilation), times
``--steps`` steps (the rank's CPU time, ``time.process_time``) and profiles ``--steps`` more
with cProfile. From the profile, per step (``PIECES``): the compiled forward and backward, the
collectives the graphs run (``_c10d_functional`` calls: count, issue time, waiting time), the
tangent checks at the backward's entry, the parameter gradients' ``summed_gradient`` ops
(one per use of a weight) or ``summed_gradients`` (one per backward graph), the gradient reducer's hooks and its end of backward,
ShardTensor ops run eagerly outside the graphs (the loss), ``zero_grad``. Times are cProfile's
cumulative wall time under the profiler (waiting for the other rank included); counts are
exact. The summary holds each model's CPU ratio (slowest rank's CPU time per step, unprofiled)
against issue 21's goal (``host_overhead.COMPILED_GOAL_RATIO``). Run ``python -m
benchmarks.compiled_step_profile [--models vit] [--ranks 2] [--steps 10] [--check]``; JSON
lines on stdout, one record per model, variant and rank, then the summary.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
import torch._dynamo.testing
import torch.distributed as dist

from benchmarks._common import Goal, emit, emit_summary, parse_arguments, rank_pools
from benchmarks.compile import CASES, RANK_TIMEOUT_S
from benchmarks.host_overhead import COMPILED_GOAL_RATIO, VARIANTS, training_step
from shardsci.testing import run_on_ranks

PIECES: dict[str, tuple[str, str, str]] = {
    "step": ("benchmarks/host_overhead.py", "step", "cumulative"),
    "compiled_forward": ("_aot_autograd/runtime_wrappers.py", "runtime_wrapper", "cumulative"),
    "compiled_backward": ("_aot_autograd/runtime_wrappers.py", "backward", "cumulative"),
    "tangent_checks": (
        "_aot_autograd/runtime_wrappers.py",
        "process_runtime_tangent",
        "cumulative",
    ),
    "graph_all_reduce": ("~", "<built-in method torch._ops._c10d_functional.all_reduce>", "own"),
    "graph_all_to_all": (
        "~",
        "<built-in method torch._ops._c10d_functional.all_to_all_single>",
        "own",
    ),
    "graph_all_gather": (
        "~",
        "<built-in method torch._ops._c10d_functional.all_gather_into_tensor>",
        "own",
    ),
    "graph_wait": ("~", "<built-in method torch._ops._c10d_functional.wait_tensor>", "own"),
    "summed_gradient": ("shardsci/tensor/_promotion.py", "_summed_gradient", "cumulative"),
    "summed_gradients": ("shardsci/tensor/_promotion.py", "_summed_gradients", "cumulative"),
    "reducer_hooks": ("shardsci/parallel/_reducer.py", "on_accumulate", "cumulative"),
    "reducer_end_of_backward": ("shardsci/parallel/_reducer.py", "_end_backward", "cumulative"),
    "eager_shardtensor_ops": ("shardsci/tensor/_dispatch.py", "dispatch", "cumulative"),
    "zero_grad": ("torch/nn/modules/module.py", "zero_grad", "cumulative"),
}
"""Piece -> (file the function is in, ``~`` for a built-in; its name; cumulative time or its
own)."""


def _pieces(stats: pstats.Stats, steps: int) -> dict[str, dict[str, float]]:
    """Per piece, calls and milliseconds per step."""
    found = {}
    for piece, (where, name, kind) in PIECES.items():
        calls, seconds = 0, 0.0
        for (path, _, function), (_, ncalls, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
            if function == name and (where == "~" or path.endswith(where)):
                calls += ncalls
                seconds += cumulative if kind == "cumulative" else own
        found[piece] = {"calls": calls / steps, "ms": round(seconds / steps * 1e3, 2)}
    return found


def profile_ranks(name: str, backend: str, warmup: int, steps: int) -> dict:
    """Rank body: per variant, CPU ms per step unprofiled, frames compiled, the pieces."""
    torch.set_num_threads(1)
    found = {}
    for variant in VARIANTS:
        counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
        step = training_step(name, variant == "shardtensor", 16, 64, compiled=counter)
        for _ in range(warmup):
            step()
        start = time.process_time()
        for _ in range(steps):
            step()
        cpu_ms = (time.process_time() - start) / steps * 1e3
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(steps):
            step()
        profile.disable()
        found[variant] = {
            "cpu_ms": round(cpu_ms, 2),
            "frames": counter.frame_count,
            "pieces": _pieces(pstats.Stats(profile), steps),
        }
    return {"rank": dist.get_rank(), **found}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["vit"], choices=list(CASES))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--backend", choices=["aot_eager", "inductor"], default="aot_eager")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parse_arguments(parser, argv)
    goals, summary = [], {}
    with rank_pools():
        for name in args.models:
            per_rank = run_on_ranks(
                args.ranks,
                profile_ranks,
                *(name, args.backend, args.warmup, args.steps),
                timeout_s=RANK_TIMEOUT_S,  # compiling takes minutes on a busy machine
            )
            for found in per_rank:
                for variant in VARIANTS:
                    emit(
                        "compiled_step_profile",
                        model=name,
                        ranks=args.ranks,
                        backend=args.backend,
                        rank=found["rank"],
                        variant=variant,
                        **found[variant],
                    )
            cpu_ms = {v: max(found[v]["cpu_ms"] for found in per_rank) for v in VARIANTS}
            ratio = cpu_ms["shardtensor"] / cpu_ms["torch"]
            summary[name] = {"cpu_ms": cpu_ms, "cpu_ratio": round(ratio, 2)}
            goals.append(
                Goal(
                    f"{name} on {args.ranks} rank(s), {args.backend}: compiled ShardTensor step "
                    f"at most {COMPILED_GOAL_RATIO}x compiled torch's CPU time",
                    ratio <= COMPILED_GOAL_RATIO,
                )
            )
    emit_summary(goals, args.check, **summary)


if __name__ == "__main__":
    main()
