"""Speed-up of a sharded convolution at 2 ranks, and the effect of overlapping its halos.

One training step (forward and backward of an ``nn.Conv2d`` / ``nn.Conv3d``, input gradient
included) on one global problem, timed side by side (variants interleaved in every round,
their order alternating between rounds):

- ``one_rank_1_thread``: plain tensors on 1 rank, ``torch.set_num_threads(1)``, computed the
  way the sharded convolution computes: the padding materialised (``F.pad``), then the kernel
  with ``padding=0`` (``nn.Conv2d(padding_mode="circular")`` does this itself);
- ``one_rank_1_thread_native`` (where it differs): the module as written, e.g.
  ``nn.Conv3d(padding=1)``, whose kernel pads internally (context: oneDNN is slower there);
- ``one_rank_2_threads``: like ``one_rank_1_thread`` with 2 threads (context: what the
  machine's 2 cores give without sharding);
- ``two_ranks``: a ShardTensor with H split evenly over a 1-D mesh of 2, 1 thread per rank;
- ``two_ranks_overlap``: the same inside ``shardsci.overlap_halos()``.

Every variant computes with one thread per process, so ``speedup`` (``one_rank_1_thread`` /
``two_ranks``, medians) compares compute with compute on the same kernel path: ideal 2. A
step's time at 2 ranks is the slowest rank's, measured from a barrier. Before timing, the
2-rank step's output and gradients are compared with the 1-rank step's (``check``), and one
step with overlap on and one with it off are compared (identical outputs; gradients equal to
float32 rounding) and their bytes counted (``shardsci.testing.count_traffic``). No goal is
stated: the speed-ups are reported.

Run ``python -m benchmarks.halo_and_conv conv_scaling [--shrink N] [--rounds N]`` (``--shrink``
divides every spatial extent, for a quick run); the JSON fields are listed in README.md.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks._common import Goal, emit, interleaved_steps, on_ranks, spread
from shardsci import Shard, ShardTensor, overlap_halos
from shardsci.testing import count_traffic, get_mesh


@dataclass(frozen=True)
class Case:
    """A convolution and the global shape of its input; ``rounds`` sets how long it is timed;
    ``pads_internally``: its kernel pads (so the like-for-like baseline pads first)."""

    module: str
    shape: tuple[int, ...]
    build: Callable[[], nn.Module]
    rounds: int
    pads_internally: bool


CASES = {
    "conv2d": Case(
        'nn.Conv2d(16, 16, 3, padding=1, padding_mode="circular")',
        (4, 16, 256, 256),
        lambda: nn.Conv2d(16, 16, 3, padding=1, padding_mode="circular"),
        rounds=8,
        pads_internally=False,
    ),
    "conv3d": Case(
        "nn.Conv3d(8, 8, 3, padding=1)",
        (2, 8, 64, 64, 64),
        lambda: nn.Conv3d(8, 8, 3, padding=1),
        rounds=4,
        pads_internally=True,
    ),
}


@dataclass(frozen=True)
class Problem:
    """A case of ``CASES`` with its spatial extents divided by ``shrink`` (what the rank
    bodies receive)."""

    case_name: str
    shrink: int = 1

    @property
    def case(self) -> Case:
        return CASES[self.case_name]

    @property
    def shape(self) -> tuple[int, ...]:
        batch, channels, *spatial = self.case.shape
        return (batch, channels, *(extent // self.shrink for extent in spatial))


# Variant -> (ranks, threads per rank, overlap halos, the module's own padding path).
VARIANTS = {
    "one_rank_1_thread": (1, 1, False, False),
    "one_rank_1_thread_native": (1, 1, False, True),
    "one_rank_2_threads": (1, 2, False, False),
    "two_ranks": (2, 1, False, False),
    "two_ranks_overlap": (2, 1, True, False),
}
STEPS_PER_CALL = 3
SHARDED_DIM = 2
GRADIENT_RTOL = 1e-4  # float32 rounding of sums over ~10^5-10^6 terms (conv3d: 1.1e-5 measured)
CHECK_RTOL = 1e-4  # 2 ranks against 1: weight gradients summed over ~10^5-10^6 terms in halves


# --------------------------------------------------------------------------- rank bodies
def shard_rows(whole: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """This rank's even share of ``whole`` along H, and how to wrap a shard of that layout.

    On 1 rank the tensor itself comes back and the wrapper is the identity (plain tensors).
    """
    world = dist.get_world_size()
    if world == 1:
        return whole, lambda t: t
    mesh = get_mesh((world,))
    rows = whole.shape[SHARDED_DIM] // world
    local = whole.narrow(SHARDED_DIM, mesh.get_local_rank() * rows, rows).contiguous()
    sizes = {0: (rows,) * world}
    return local, lambda t: ShardTensor.from_local(t, mesh, [Shard(SHARDED_DIM)], sizes)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, ShardTensor) else t


def _prepadded(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``module``'s convolution on plain tensors the way a sharded one runs: ``F.pad``, then
    the kernel with ``padding=0``."""
    n = len(module.kernel_size)
    pad = tuple(p for p in reversed(module.padding) for _ in (0, 1))
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[n]
    return lambda x: conv(F.pad(x, pad), module.weight, module.bias, module.stride, 0)


def _training_step(
    problem: Problem, native: bool = False
) -> Callable[[], tuple[torch.Tensor, ...]]:
    """A step on this rank's share of the case's problem: forward, ``sum`` of the local output,
    backward. Returns the local output and the gradients (input, weight, bias). On 1 rank a
    case whose kernel pads internally pads first (like for like), unless ``native``."""
    torch.manual_seed(0)
    case = problem.case
    module = case.build()
    local, wrap = shard_rows(torch.randn(problem.shape))
    local.requires_grad_()
    plain = dist.get_world_size() == 1 and case.pads_internally and not native
    forward = _prepadded(module) if plain else module

    def step() -> tuple[torch.Tensor, ...]:
        module.zero_grad(set_to_none=True)
        local.grad = None
        out = _local(forward(wrap(local)))
        out.sum().backward()
        return out.detach(), local.grad, module.weight.grad, module.bias.grad

    return step


def time_steps(
    problem: Problem, threads: int, overlap: bool, native: bool, steps: int
) -> list[float]:
    """Rank body: seconds per step on this rank, each started from a barrier (one warm-up)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        step = _training_step(problem, native)
        times = []
        with overlap_halos() if overlap else nullcontext():
            step()
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return times


def compare_overlap(problem: Problem) -> dict:
    """Rank body: one step with halos overlapped and one without: equal? bytes moved?

    Outputs must be bitwise equal. Gradients may differ by float32 rounding: the overlapped
    step computes the weight gradient as a sum over pieces (interior, edges) and adds the
    input gradient's halo contributions in another order.
    """
    step = _training_step(problem)
    with count_traffic() as plain:
        reference = step()
    with count_traffic() as overlapped, overlap_halos():
        result = step()
    return {
        "output_equal": torch.equal(reference[0], result[0]),
        "gradients_bitwise_equal": all(map(torch.equal, reference[1:], result[1:])),
        "gradient_max_rel_diff": max(
            ((a - b).abs().max() / a.abs().max()).item() for a, b in zip(reference[1:], result[1:])
        ),
        "received": plain.as_dict()["received"],
        "overlap_received": overlapped.as_dict()["received"],
        "exchanges": plain.p2p_rounds,
        "overlap_exchanges": overlapped.p2p_rounds,
    }


def compare_to_one_rank(problem: Problem) -> float | None:
    """Rank body (2 ranks): the sharded step's output and gradients against the 1-rank step
    on the whole problem, on rank 0: the largest difference relative to each one's largest
    entry."""
    out, grad_input, grad_weight, grad_bias = _training_step(problem)()
    mesh = get_mesh((dist.get_world_size(),))
    rows = {0: (out.shape[SHARDED_DIM],) * dist.get_world_size()}
    gathered = [
        ShardTensor.from_local(t, mesh, [Shard(SHARDED_DIM)], rows).full_tensor()
        for t in (out, grad_input)
    ]
    if dist.get_rank() != 0:
        return None
    torch.manual_seed(0)
    module = problem.case.build()
    whole = torch.randn(problem.shape).requires_grad_()
    expected = module(whole)
    expected.sum().backward()
    pairs = zip(
        [*gathered, grad_weight, grad_bias],
        [expected.detach(), whole.grad, module.weight.grad, module.bias.grad],
    )
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in pairs)


# --------------------------------------------------------------------------- reporting
def _variants(case_name: str) -> list[str]:
    native = CASES[case_name].pads_internally
    return [name for name, v in VARIANTS.items() if native or not v[3]]


def _step_seconds(problem: Problem, rounds: int) -> dict[str, list[float]]:
    """Variant -> seconds of every timed step (slowest rank per step), variants interleaved."""

    def run(name: str) -> list[float]:
        ranks, threads, overlap, native = VARIANTS[name]
        per_rank = on_ranks(ranks, time_steps, problem, threads, overlap, native, STEPS_PER_CALL)
        return [max(step) for step in zip(*per_rank)]

    return interleaved_steps(_variants(problem.case_name), rounds, run)


def report(problem: Problem, rounds: int) -> dict[str, float]:
    """Emit the ``check``, ``speedup`` and ``overlap`` records of one case; return its key
    ratios. Medians are the figures; quartiles, fastest and slowest steps come beside them."""
    case_name = problem.case_name
    error = on_ranks(2, compare_to_one_rank, problem)[0]
    emit("check", case=case_name, max_rel_error=error, within_tolerance=error <= CHECK_RTOL)
    if error > CHECK_RTOL:
        raise AssertionError(f"{case_name}: 2 ranks differ from 1 rank by {error:.2e}")
    samples = _step_seconds(problem, rounds)
    t = {name: statistics.median(times) for name, times in samples.items()}
    best = {name: min(times) for name, times in samples.items()}
    speedup = t["one_rank_1_thread"] / t["two_ranks"]
    emit(
        "speedup",
        case=case_name,
        module=problem.case.module,
        global_shape=problem.shape,
        steps_timed=len(samples["two_ranks"]),
        **{f"{name}_s": spread(times) for name, times in samples.items()},
        speedup=round(speedup, 3),
        parallel_efficiency=round(speedup / 2, 3),
        speedup_of_min=round(best["one_rank_1_thread"] / best["two_ranks"], 3),
        speedup_vs_2_threads=round(t["one_rank_2_threads"] / t["two_ranks"], 3),
        **(
            {"speedup_vs_native": round(t["one_rank_1_thread_native"] / t["two_ranks"], 3)}
            if "one_rank_1_thread_native" in t
            else {}
        ),
    )
    overlap_gain = t["two_ranks"] / t["two_ranks_overlap"]
    _report_overlap(
        problem,
        {
            "two_ranks_s": round(t["two_ranks"], 4),
            "two_ranks_overlap_s": round(t["two_ranks_overlap"], 4),
            "overlap_speedup": round(overlap_gain, 3),
            "overlap_speedup_of_min": round(best["two_ranks"] / best["two_ranks_overlap"], 3),
        },
    )
    return {f"{case_name}_speedup": speedup, f"{case_name}_overlap_speedup": overlap_gain}


def _report_overlap(problem: Problem, timings: dict[str, float]) -> None:
    """Emit the ``overlap`` record: ``timings`` and the agreement and bytes of one step with
    and without overlapped halos. Raises if the results disagree beyond float32 rounding."""
    checks = on_ranks(2, compare_overlap, problem)
    emit(
        "overlap",
        case=problem.case_name,
        **timings,
        output_equal=all(c["output_equal"] for c in checks),
        gradients_bitwise_equal=all(c["gradients_bitwise_equal"] for c in checks),
        gradient_max_rel_diff=max(c["gradient_max_rel_diff"] for c in checks),
        received_bytes_per_step=[c["received"] for c in checks],
        overlap_received_bytes_per_step=[c["overlap_received"] for c in checks],
        exchanges_per_step=[c["exchanges"] for c in checks],
        overlap_exchanges_per_step=[c["overlap_exchanges"] for c in checks],
    )
    agree = all(c["output_equal"] for c in checks) and all(
        c["gradient_max_rel_diff"] <= GRADIENT_RTOL for c in checks
    )
    if not agree:
        raise AssertionError(f"{problem}: overlap_halos() changed the result: {checks}")


def run(shrink: int = 1, rounds: int | None = None) -> tuple[dict[str, object], list[Goal]]:
    """Emit every case (on the running rank pools), its spatial extents divided by
    ``shrink``, timed in ``rounds`` rounds (default: the case's); return the part's summary
    fields and goals (none).

    Timings depend on what else runs on the machine: the load average is reported with them.
    """
    load_before = os.getloadavg()[0]
    ratios = {
        key: value
        for name, case in CASES.items()
        for key, value in report(Problem(name, shrink), rounds or case.rounds).items()
    }
    fields = {
        **{key: round(value, 3) for key, value in ratios.items()},
        "load_average_before": round(load_before, 1),
        "load_average_after": round(os.getloadavg()[0], 1),
        "cores": os.cpu_count(),
    }
    return fields, []
