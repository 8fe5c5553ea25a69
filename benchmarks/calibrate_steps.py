"""The cost model held against measurement: every zoo model's training step on 1, 2 and 4
ranks here, predicted on the calibrated machine and timed.

# NOTE [The model held against measurement]
The prediction is ``benchmarks.cost_model.step_s`` (NOTE [The cost model]) of each model's
fitted step (``cost_model``'s measurement of traffic, FLOPs, memory traffic and ops, or its
``--save`` file), on the ``Machine`` fitted by ``benchmarks.calibrate`` (NOTE [Calibrating the
machine]); nothing of the timed steps enters it. The timed step is ``cost_model``'s own
(``sharded_step``) on one global problem: a ``(1, 1, N, N)`` field (``--size``), H split over
``P`` ranks (the UNet's 4 ranks: 2x2 blocks, as the cost model measures it), or a graph of
``--nodes`` nodes in ``P`` METIS parts. Each call builds the model, makes one warm-up step and
times ``--steps`` steps, each from a barrier; rank counts are interleaved in each of
``--rounds`` rounds, the order reversed every round; a step counts as its slowest rank's.
Interleaved with them, ``plain``: the plain model on one process on the whole problem
(``benchmarks.host_overhead.training_step``), whose CPU time less its aten ops at
``plain_host_us_per_op`` is the step's measured kernel time, held against the model's compute
term (``plain`` records) and put in its place (``cpu_ratio_with_measured_compute``): where that
brings a prediction within ``TOLERANCE``, the compute term is what missed.

Two figures are compared, because gloo's waits do not use the CPU (a rank blocked in a
collective accrues no ``time.process_time``) and this machine is shared:

- ``cpu``: the slowest rank's CPU time against the model's ``host + compute`` (the work of a
  rank with a core to itself: its ops, and issuing its collectives and halo rounds, which on
  gloo copies and sends on the rank's own core; waiting for them costs none). The check's
  figure: the other engineers' load moves it little.
- ``wall``: wall time against ``host + compute + communication`` with ``P`` ranks sharing the
  ``cores`` (compute and host rates times ``min(1, cores / P)``: 4 ranks on 2 cores run at
  half speed each). Other processes' load slows it further, a term the model does not have:
  each record states the load and ``wall_over_cpu_1_rank`` (the 1-rank step's wall over CPU
  time: the share of a core one process got).

# NOTE [Compute rates paired with the steps]
This machine's speed moves with the other engineers' load: two calibrations 17 minutes apart
(2026-11-29, load 0.5 and 11-22) fitted 70.3 and 47.0 GFLOP/s, moving the UNet's 1-rank
``cpu`` ratio from 0.85 to 1.36 with nothing else changed. So every timed call (each rank
count's, and ``plain``'s) measures the compute rates on its ranks (``measure_compute``,
``PROBE_REPEATS`` calls per kernel, after the warm-up step, right before the timed steps) and
each timed step is predicted on the calibrated machine with its own call's rates (``at_rates``;
the slowest rank's, as a step counts as its slowest rank's): ``paired_ratios``, whose median is
the ``cpu`` ratio judged. The ratio on the calibration's rates is kept
(``cpu_ratio_at_calibration``).

# NOTE [Host terms paired with the steps]
A collective's CPU moves with the load as the compute rates do, and more: gloo's threads wake
per call, and a call's CPU inside a 4-rank UNet step (550-640 µs for a small one, 2026-11-29)
was not what the calibration's calls on their own ranks, minutes earlier, gave. So every timed
call of 2 or more ranks also probes, on its own ranks right after the compute probe, the CPU
one small call (``SIZES[0]`` bytes a rank) of each of ``SMALL_CALLS`` costs between two
computations (``measure_small_calls``, as the calibration takes it), and its steps are
predicted with the calibration's collective CPU terms (per call, per ring step, per byte)
scaled by what those calls cost now over what the terms price them at (``at_small_calls``,
the slowest rank's: the most CPU). The µs per aten op (``host_us_per_op``,
``host_us_per_communication_op``) stay the calibration's (a ShardTensor step of its own would be
needed).

# NOTE [The step's own kernels]
The calibration's compute probes (``COMPUTE``: convolutions and matmuls; ``rfft2`` and
``irfft2`` of a ``(1, 32, 128, 128)`` field) are not the kernels every step runs: the FNO's 1x1
convolutions take the unblocked ``_slow_conv2d`` path, its spectral contraction (a complex
``bmm`` copying per mode) runs its FLOPs about 100x slower than a matmul, and its FFTs along
one dim of a slab at other rates than a 2-D transform. So each timed call also records one
step's own kernels and replays each call with FLOPs alone on copies of its arguments
(``measure_step_kernels``, slowest rank): the FLOP rate of the FFTs and of every other call
at the step's own shapes, and the prediction with those rates for ``sustained_flops`` and
``fft_flops_per_s`` (``at_step_kernels``; host terms paired as above) is
``cpu_ratio_with_step_kernels``: where it is within ``TOLERANCE`` and the paired ratio is
not, the compute rates, not the FLOPs or the host terms, are what missed.

# NOTE [One flop-free rate or one a family]
The same timed steps are scored three ways, which differ only in the price of the kernels
without FLOPs (NOTE [Kernels without FLOPs by family] in ``shardsci.planning._work``): the
judged ``cpu`` ratio prices each family at the rate its call's probe measured
(``measure_flop_free_families``, kernels in a loop, paired with the step as the other compute
rates); ``cpu_ratio_one_flop_free_rate`` every flop-free byte at the probe's one memory rate
(``one_flop_free_rate``: the cost model until 2026-11-30); ``cpu_ratio_in_step_family_rates``
each family at ``IN_STEP_FAMILY_RATES`` (the rates of the Transolver's flop-free kernels inside
its step, not paired with the load). The model's flop-free bytes by family are counted on the
plain step (``cost_model.work_at``, recounted where a saved measurement lacks them).

``--check`` fails when a ``cpu`` prediction misses by more than ``TOLERANCE`` without an
explanation listed in ``EXPLAINED`` that holds, and names each: a quantified explanation (a
term the record adds, ``cpu_ratio_with_*``) holds only while adding it brings the prediction
within ``TOLERANCE``; a named one (no ratio) is taken as written.

Run ``python -m benchmarks.calibrate_steps [--machine machine.json] [--measured
measured.json] [--models ...] [--size 128] [--nodes 4096] [--rounds 3] [--steps 2]
[--check]``; without the files it calibrates and measures first (several minutes). JSON lines
on stdout, fields in README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from benchmarks._common import (
    Goal,
    emit,
    emit_summary,
    interleaved_steps,
    on_ranks,
    parse_arguments,
    rank_pools,
    spread,
    timed_steps,
)
from benchmarks.calibrate import (
    at_rates,
    at_small_calls,
    at_step_kernels,
    calibrate,
    emit_calibration,
    measure_compute,
    measure_small_calls,
    measure_step_kernels,
    one_flop_free_rate,
    scaled_collective_host,
    small_call_scale,
)
from benchmarks.cost_model import (
    GEOMETRY,
    best_step,
    choose_exchange,
    fitted_models,
    measurements,
    sharded_step,
)
from benchmarks.host_overhead import _OpCounter, training_step
from shardsci.planning._machine import Machine, dispatch_prices, gloo_cpu
from shardsci.planning._work import FLOP_FREE_FAMILIES

IN_STEP_FAMILY_RATES = {
    "pointwise_contiguous": 9.5e9,
    "pointwise_broadcast": 7.25e9,
    "pointwise_strided": 3.88e9,
    "reduction": 4.7e9,
    "copy": 7.9e9,
}
"""The flop-free families' rates inside the Transolver's plain step at 128² (planner21,
2026-11-30 01:34-01:35 UTC, load 6.4-9.4, each op's own thread CPU time, median of 14 rounds;
``benchmarks/records/2026-11-30-flop-free-families``), bytes per second: NOTE [One flop-free
rate or one a family]."""


def in_step_family_rates(machine: Machine) -> Machine:
    """``machine`` with the flop-free families at ``IN_STEP_FAMILY_RATES``."""
    return dataclasses.replace(
        machine, **{f"{family}_bytes_per_s": r for family, r in IN_STEP_FAMILY_RATES.items()}
    )


FLOP_FREE_SCORINGS: dict[str, Callable[[Machine], Machine]] = {
    "one_flop_free_rate": one_flop_free_rate,
    "in_step_family_rates": in_step_family_rates,
}
"""The other prices of the kernels without FLOPs a step is scored with (NOTE [One flop-free
rate or one a family]); the judged ratio: the family rates its call measured."""

RANKS = (1, 2, 4)
TOLERANCE = 0.25
PROBE_REPEATS = 3
"""Timed calls per kernel of the compute probe each timed call makes (NOTE [Compute rates
paired with the steps])."""


@dataclass(frozen=True)
class Explanation:
    """Why a ``cpu`` prediction misses: the term the cost model lacks, and the ``step``
    record's ratio that adds it (``None``: named, not quantified). A quantified explanation
    holds only while that ratio is within ``TOLERANCE``."""

    term: str
    ratio: str | None = None


_GROWS_WITH_SHARD = (
    "the ShardTensor step's work beyond the plain model's kernels grows with the shard, where "
    "the host term is ops x µs per op at a 16² tile: its 1-rank step is {} ms over the plain "
    "step at 128² (plain and step records, 2026-11-27, load 4-10), the host term {} ms"
)
_FNO_BY_PART = (
    "compute and host, by part (the plain step at 128² on one core, each aten op's CPU time, "
    "2026-11-29 09:12 UTC, load 5.5, benchmarks/records/2026-11-29-cost-model/"
    "fno_parts_128.json): its 1x1 convolutions take 31 ms against 12.5 priced (the "
    "projection's 128->1 backward 11 ms of them, 1.4 GFLOP/s), its kernels without FLOPs 25 "
    "ms against 13 (GELU's erf at 5-7 GB/s against a copy's 21); and the ShardTensor step "
    "costs 43 ms of CPU more than the plain step (128 against 85 ms at 1 rank, 09:21 UTC, "
    "load 9), where the host term prices 8.6 ms: every model's ops at the UNet's 15.8 µs, "
    "while the FNO's ShardTensor ops add 70 µs a plain op at a 24² tile (host_overhead, "
    "09:24 UTC, load 8)"
)
# (model, ranks) -> why a ``cpu`` prediction misses by more than ``TOLERANCE`` (2026-11-27,
# the ViT 2026-11-28, the FNO 2026-11-29; 128² and 4,096 nodes; how each was found:
# benchmarks/README.md).
EXPLAINED: dict[tuple[str, int], Explanation] = {
    ("unet", 1): Explanation(
        "compute: with the ops a 1-rank step dispatches (1,352, none of them communication "
        "ops, where the laws of 4-16 ranks put 3,035 and 1,579: host 25 ms, not 63; NOTE [Ops "
        "per peer] in benchmarks/cost_model.py) the UNet's 1-rank step is predicted at 1.42 "
        "of measured (2026-11-30 calib3, re-scored from calib2's 06:29-06:38 UTC steps, load 25-51: "
        "benchmarks/records/2026-11-30-predicted-vs-measured/rescore_one_rank.py); its plain "
        "step's compute term is 1.46 of its kernel time (about 147 ms at the paired rates, "
        "4.65 GFLOP at 57 GFLOP/s and 746 MB without FLOPs, against 93.5 ms), and the step's "
        "own kernels' FLOP rates do not close it (1.42); the plain step's kernel time in its "
        "place gives 0.98",
        "cpu_ratio_with_measured_compute",
    ),
    **{("fno", p): Explanation(_FNO_BY_PART) for p in RANKS},
    ("vit", 1): Explanation(
        "compute: the fused CPU attention kernel runs its FLOPs about 1.6x faster than the "
        "median rate of the convolutions and linears; the plain step's kernel time replaces "
        "the compute term",
        "cpu_ratio_with_measured_compute",
    ),
    **{
        ("transolver", p): Explanation(
            "compute: its kernels without FLOPs run at 0.4x the memory rate they are priced "
            "at. In the plain step at 128² (each aten op's thread CPU time, 2026-11-29 22:10 "
            "UTC, load 45, benchmarks/records/2026-11-29-host-per-op/"
            "transolver_parts_128.json), its adds and divides (most of them broadcasting), "
            "sums, layer norms, softmaxes and GELUs, forward and backward, move 1.95 GB in "
            "355 ms: 5.5 GB/s, the layer norms 2.0-3.7, against the 13-14 GB/s of calibrate's "
            "contiguous add. That is 144 ms priced, 211 more measured: the plain step's "
            "kernels took 593 ms against 383 predicted (19:14 UTC). The plain step's kernel "
            "time replaces the compute term",
            "cpu_ratio_with_measured_compute",
        )
        for p in RANKS
    },
    **{("meshgraphnet", p): Explanation(_GROWS_WITH_SHARD.format(485, 99)) for p in RANKS},
}


def layout(name: str, ranks: int, size: int, nodes: int) -> tuple[tuple[int, ...], tuple]:
    """The mesh and this rank's local shape of the timed step at ``ranks``."""
    if name == "meshgraphnet":
        return (ranks,), (nodes // ranks,)
    if name == "unet" and ranks == 4:
        return (2, 2), (size // 2, size // 2)
    return (ranks,), (size // ranks, size)


def sharing(machine: Machine, ranks: int, cores: int) -> Machine:
    """``machine`` for ``ranks`` processes on ``cores`` cores: compute and host rates shared."""
    share = min(1.0, cores / ranks)
    shared = dataclasses.replace(
        machine,
        sustained_flops=machine.sustained_flops * share,
        memory_bytes_per_s=machine.memory_bytes_per_s * share,
        fft_flops_per_s=machine.fft_flops_per_s * share,
        complex_matmul_flops_per_s=machine.complex_matmul_flops_per_s * share,
        host_us_per_op=machine.host_us_per_op / share,
        plain_host_us_per_op=machine.plain_host_us_per_op / share,
        host_us_per_communication_op=machine.host_us_per_communication_op / share,
        host_us_per_fast_op=machine.host_us_per_fast_op / share,
        host_us_per_propagation_op=machine.host_us_per_propagation_op / share,
        host_us_per_handler_op=machine.host_us_per_handler_op / share,
        host_us_per_function_call=machine.host_us_per_function_call / share,
    )
    return scaled_collective_host(shared, 1 / share)


def predict(machine: Machine, models: dict, ranks: int, shape: tuple, cores: int) -> dict:
    """``cpu``: host + compute with a core per rank (``cpu_compute``: its compute);
    ``wall``: the whole step, cores shared, and its ``parts``; seconds."""
    _, alone = best_step(machine, models, ranks, shape)
    _, shared = best_step(sharing(machine, ranks, cores), models, ranks, shape)
    return {
        "cpu": alone["host"] + alone["compute"],
        "cpu_compute": alone["compute"],
        "wall": shared["total"],
        "parts": shared,
    }


def predicted_cpu(
    machine: Machine, models: dict, ranks: int, shape: tuple, cores: int, part: str = "cpu"
) -> float:
    """``predict``'s ``part`` (``cpu``: host + compute; ``cpu_compute``), seconds."""
    return predict(machine, models, ranks, shape, cores)[part]


def time_step(name: str, mesh_shape: tuple[int, ...], shape: tuple, steps: int) -> dict:
    """Rank body: ``steps`` timed steps' wall and CPU seconds after one warm-up, the compute
    probe (``rates``, NOTE [Compute rates paired with the steps]), on 2 or more ranks the
    small calls' (``small_calls``, NOTE [Host terms paired with the steps]), and the rates of
    the step's own kernels (``kernel_rates``, NOTE [The step's own kernels])."""
    _, step = sharded_step(name, mesh_shape, shape)
    step()
    rates = measure_compute(PROBE_REPEATS)
    small_calls = measure_small_calls(PROBE_REPEATS) if math.prod(mesh_shape) > 1 else {}
    kernels = measure_step_kernels(step, PROBE_REPEATS)
    wall, cpu = timed_steps(step, steps)
    return {
        "wall": wall,
        "cpu": cpu,
        "rates": rates,
        "small_calls": small_calls,
        "kernel_rates": kernels,
    }


def time_plain(name: str, size: int, nodes: int, steps: int) -> dict:
    """Rank body (1 rank): the plain model's step on the whole problem, as ``time_step``,
    and the aten ops it dispatches."""
    torch.set_num_threads(1)
    step = training_step(name, False, size, nodes)
    step()
    with _OpCounter() as counter:
        step()
    rates = measure_compute(PROBE_REPEATS)
    wall, cpu = timed_steps(step, steps)
    return {"wall": wall, "cpu": cpu, "rates": rates, "ops": sum(counter.ops.values())}


def slowest_rates(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Each compute rate of the slowest rank at it: the lowest over the ranks' probes."""
    return {kind: min(rates[kind] for rates in per_rank) for kind in per_rank[0]}


def slowest_small_calls(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Each small call's CPU seconds at the slowest rank: the most over the ranks' probes."""
    return {kind: max(cpu[kind] for cpu in per_rank) for kind in per_rank[0]}


def paired_ratios(
    predict_cpu: Callable[[Machine], float],
    machine: Machine,
    cpu: list[float],
    rates: list[dict[str, float]],
    small_calls: list[dict[str, float]] | None = None,
    ranks: int = 1,
    kernel_rates: list[dict[str, float]] | None = None,
    flop_free: Callable[[Machine], Machine] | None = None,
) -> list[float]:
    """Each timed step's predicted over measured CPU time, predicted by ``predict_cpu``
    (``Machine`` -> seconds) on ``machine`` at the compute rates its own call measured
    (``rates[i]`` for ``cpu[i]``; NOTE [Compute rates paired with the steps]) and, where
    given, the CPU of the small calls it probed on its ``ranks`` (``small_calls[i]``; NOTE
    [Host terms paired with the steps]) and the rates of its own kernels
    (``kernel_rates[i]``; NOTE [The step's own kernels]); ``flop_free``: how the paired
    machine prices the kernels without FLOPs (NOTE [One flop-free rate or one a family]),
    ``None``: at the family rates its call measured."""
    small_calls = small_calls or [{} for _ in cpu]
    kernel_rates = kernel_rates or [{} for _ in cpu]
    ratios = []
    for seconds, step_rates, step_calls, kernels in zip(
        cpu, rates, small_calls, kernel_rates, strict=True
    ):
        paired = at_step_kernels(at_rates(machine, step_rates), kernels)
        if step_calls:
            paired = at_small_calls(paired, step_calls, ranks)
        if flop_free is not None:
            paired = flop_free(paired)
        ratios.append(predict_cpu(paired) / seconds)
    return ratios


def measure_steps(name: str, args: argparse.Namespace) -> dict[str, dict]:
    """``plain`` and each rank count -> ``wall`` and ``cpu`` of every timed step (slowest
    rank), interleaved, the compute ``rates`` its call measured, one per step; ``ops`` of the
    plain step."""
    cpu: dict[str, list[float]] = {}
    rates: dict[str, list[dict[str, float]]] = {}
    small_calls: dict[str, list[dict[str, float]]] = {}
    kernel_rates: dict[str, list[dict[str, float]]] = {}
    ops: dict[str, int] = {}

    def run(variant: str) -> list[float]:
        if variant == "plain":
            per_rank = on_ranks(1, time_plain, name, args.size, args.nodes, args.steps)
            ops[variant] = per_rank[0]["ops"]
        else:
            mesh_shape, shape = layout(name, int(variant), args.size, args.nodes)
            per_rank = on_ranks(int(variant), time_step, name, mesh_shape, shape, args.steps)
        cpu.setdefault(variant, []).extend(max(s) for s in zip(*(r["cpu"] for r in per_rank)))
        call_rates = slowest_rates([r["rates"] for r in per_rank])
        rates.setdefault(variant, []).extend(call_rates for _ in range(args.steps))
        probed = [r.get("small_calls") for r in per_rank]
        call_small = slowest_small_calls(probed) if all(probed) else {}
        small_calls.setdefault(variant, []).extend(call_small for _ in range(args.steps))
        kernels = [r.get("kernel_rates") for r in per_rank]
        call_kernels = slowest_rates(kernels) if all(kernels) else {}
        kernel_rates.setdefault(variant, []).extend(call_kernels for _ in range(args.steps))
        return [max(s) for s in zip(*(r["wall"] for r in per_rank))]

    variants = ["plain", *map(str, args.ranks)]
    wall = interleaved_steps(variants, args.rounds, run)
    return {
        v: {
            "wall": wall[v],
            "cpu": cpu[v],
            "rates": rates[v],
            "small_calls": small_calls[v],
            "kernel_rates": kernel_rates[v],
            "ops": ops.get(v),
        }
        for v in variants
    }


def _flop_free_ms(machine: Machine, models: dict, shape: tuple, rates: list[dict]) -> dict:
    """The 1-rank step's flop-free bytes (MB) and their ms at the paired family rates (the
    median call's), at the one memory rate and at ``IN_STEP_FAMILY_RATES``, by family."""
    exchange = choose_exchange(models, 1, shape)
    by_family = models[exchange].flop_free_by_family(1, shape) or {}
    paired = [at_rates(machine, r) for r in rates]
    result = {}
    for family, nbytes in by_family.items():
        field = f"{family}_bytes_per_s"
        looped = statistics.median(getattr(m, field) or m.memory_bytes_per_s for m in paired)
        memory = statistics.median(m.memory_bytes_per_s for m in paired)
        result[family] = {
            "mb": round(nbytes / 1e6, 1),
            "ms_paired": round(nbytes / looped * 1e3, 1),
            "ms_one_rate": round(nbytes / memory * 1e3, 1),
            "ms_in_step": round(nbytes / IN_STEP_FAMILY_RATES[family] * 1e3, 1),
        }
    return result


def measured_compute(machine: Machine, plain: dict) -> float:
    """The plain step's kernel time: its median CPU time less its ops' host time
    (``plain_host_us_per_op``)."""
    return statistics.median(plain["cpu"]) - plain["ops"] * machine.plain_host_us_per_op * 1e-6


def scaling_ratio(
    predicted_s: float, measured_s: float, predicted_1: dict, measured: dict
) -> float | None:
    """Predicted ``T(P) / T(1)`` over measured, CPU time (``predicted_s`` and ``measured_s``
    at ``P``); ``None`` where 1 rank was not timed (``--ranks`` without 1)."""
    if "1" not in measured:
        return None
    measured_1 = statistics.median(measured["1"]["cpu"])
    return round(predicted_s / predicted_1["cpu"] / (measured_s / measured_1), 2)


def judge(ratio: float, explanation: Explanation | None, ratios: dict[str, float]) -> dict:
    """``ratio`` (predicted over measured), whether within ``TOLERANCE``, and whether that is
    met or explained: by a named term, or by a quantified one whose ratio (in ``ratios``) is
    within ``TOLERANCE``."""
    within = abs(ratio - 1) <= TOLERANCE
    holds = explanation is not None and (
        explanation.ratio is None or abs(ratios[explanation.ratio] - 1) <= TOLERANCE
    )
    return {
        "ratio": round(ratio, 2),
        "within": within,
        "explained": None if within or explanation is None else explanation.term,
        "explanation_holds": None if within else holds,
        "ok": within or holds,
    }


def hold(name: str, machine: Machine, models: dict, args: argparse.Namespace) -> list[dict]:
    """Emit one ``step`` record per rank count of ``name``; return them."""
    measured = measure_steps(name, args)
    load = round(os.getloadavg()[0], 1)
    plain = measured["plain"]
    alone = statistics.median(plain["wall"]) / statistics.median(plain["cpu"])
    whole = layout(name, 1, args.size, args.nodes)[1]
    predicted_1 = predict(machine, models, 1, whole, args.cores)
    compute_1 = predicted_1["parts"]["compute"]
    kernels = measured_compute(machine, plain)
    host_1 = plain["ops"] * machine.plain_host_us_per_op * 1e-6
    plain_compute_ratios = paired_ratios(
        partial(
            predicted_cpu, models=models, ranks=1, shape=whole, cores=args.cores, part="cpu_compute"
        ),
        machine,
        [seconds - host_1 for seconds in plain["cpu"]],
        plain["rates"],
    )
    emit(
        "plain",
        model=name,
        ops=plain["ops"],
        measured_cpu_s=spread(plain["cpu"]),
        measured_wall_s=spread(plain["wall"]),
        predicted_compute_ms=round(compute_1 * 1e3, 1),
        measured_compute_ms=round(kernels * 1e3, 1),
        compute_ratio=round(compute_1 / kernels, 2),
        compute_ratio_paired=round(statistics.median(plain_compute_ratios), 2),
        **{
            f"compute_ratio_paired_{label}": round(
                statistics.median(
                    paired_ratios(
                        partial(
                            predicted_cpu,
                            models=models,
                            ranks=1,
                            shape=whole,
                            cores=args.cores,
                            part="cpu_compute",
                        ),
                        machine,
                        [seconds - host_1 for seconds in plain["cpu"]],
                        plain["rates"],
                        flop_free=price,
                    )
                ),
                2,
            )
            for label, price in FLOP_FREE_SCORINGS.items()
        },
        flop_free_ms_by_family=_flop_free_ms(machine, models, whole, plain["rates"]),
        sustained_gflops_paired=spread(
            [at_rates(machine, r).sustained_flops / 1e9 for r in plain["rates"]]
        ),
        load_average=load,
    )
    records = []
    for ranks in args.ranks:
        mesh_shape, shape = layout(name, ranks, args.size, args.nodes)
        predicted = predict(machine, models, ranks, shape, args.cores)
        cpu, wall = spread(measured[str(ranks)]["cpu"]), spread(measured[str(ranks)]["wall"])
        # The same prediction with the plain step's measured kernel time for the compute term
        # (scaled as the model scales its compute to ``ranks``).
        compute = predicted["cpu_compute"]
        corrected = predicted["cpu"] - compute + kernels * compute / compute_1
        ratios = {
            "cpu_ratio_with_measured_compute": round(corrected / cpu["median"], 2),
        }
        run = measured[str(ranks)]
        predict_cpu = partial(
            predicted_cpu, models=models, ranks=ranks, shape=shape, cores=args.cores
        )

        # each step paired with its call's small-call CPU, also its kernels' rates, or neither
        paired, at_kernels, compute_paired = (
            statistics.median(
                paired_ratios(predict_cpu, machine, run["cpu"], run["rates"], *pairings)
            )
            for pairings in (
                (run["small_calls"], ranks),
                (run["small_calls"], ranks, run["kernel_rates"]),
                (),
            )
        )
        ratios["cpu_ratio_with_step_kernels"] = round(at_kernels, 2)
        scored = {
            f"cpu_ratio_{label}": round(
                statistics.median(
                    paired_ratios(
                        predict_cpu,
                        machine,
                        run["cpu"],
                        run["rates"],
                        run["small_calls"],
                        ranks,
                        flop_free=price,
                    )
                ),
                2,
            )
            for label, price in FLOP_FREE_SCORINGS.items()
        }
        record = {
            "model": name,
            "ranks": ranks,
            "mesh": list(mesh_shape),
            "local_shape": list(shape),
            "predicted_ms": {
                "cpu": round(predicted["cpu"] * 1e3, 1),
                "wall": round(predicted["wall"] * 1e3, 1),
                "parts": {k: round(v * 1e3, 2) for k, v in predicted["parts"].items()},
            },
            "measured_cpu_s": cpu,
            "measured_wall_s": wall,
            "cpu": judge(paired, EXPLAINED.get((name, ranks)), ratios),
            "cpu_ratio_at_calibration": round(predicted["cpu"] / cpu["median"], 2),
            **scored,
            "flop_free_gb_per_s_paired": {
                family: spread(
                    [
                        r[f"flop_free:{family}"] / 1e9
                        for r in run["rates"]
                        if f"flop_free:{family}" in r
                    ]
                    or [0.0]
                )
                for family in FLOP_FREE_FAMILIES
            },
            "cpu_ratio_compute_paired_only": round(compute_paired, 2),
            "collective_cpu_scale_paired": spread(
                [
                    small_call_scale(machine, calls, ranks)
                    for calls in measured[str(ranks)]["small_calls"]
                    if calls
                ]
                or [1.0],
                2,
            ),
            "sustained_gflops_paired": spread(
                [at_rates(machine, r).sustained_flops / 1e9 for r in measured[str(ranks)]["rates"]]
            ),
            **ratios,
            "cpu_scaling_ratio": scaling_ratio(
                predicted["cpu"], cpu["median"], predicted_1, measured
            ),
            "wall_ratio": round(predicted["wall"] / wall["median"], 2),
            "wall_over_cpu_1_rank": round(alone, 2),
            "load_average": load,
        }
        emit("step", **record)
        records.append(record)
    return records


def _machine(args: argparse.Namespace) -> Machine:
    """The fitted machine: from ``--machine``, else calibrated now."""
    if args.machine:
        saved = json.loads(Path(args.machine).read_text())["machine"]
        # saved before the Machine priced calls by dispatch path: this machine's presets
        # and the flop-free families' rates, where it was saved before they were fitted
        preset = gloo_cpu(1, cores=1, memory_bytes=1)
        here = dispatch_prices(preset) | {
            f"{family}_bytes_per_s": getattr(preset, f"{family}_bytes_per_s")
            for family in FLOP_FREE_FAMILIES
        }
        return Machine(**{**here, **saved})
    machine, sources, points, rates = calibrate(args.repeats)
    emit_calibration(machine, sources, points, rates)
    return machine


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(GEOMETRY), choices=list(GEOMETRY))
    parser.add_argument("--machine", help="the fitted Machine (benchmarks.calibrate --save)")
    parser.add_argument("--measured", help="the cost model's measurements (cost_model --save)")
    parser.add_argument("--ranks", nargs="+", type=int, default=list(RANKS))
    parser.add_argument("--size", type=int, default=128, help="N of the (1, 1, N, N) field")
    parser.add_argument("--nodes", type=int, default=4096, help="the graph's nodes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per call")
    parser.add_argument("--repeats", type=int, default=7, help="calibration: batches per point")
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    args = parse_arguments(parser, argv)
    saved = json.loads(Path(args.measured).read_text()) if args.measured else {}
    goals, table = [], {}
    with rank_pools():
        machine = _machine(args)
        for name in args.models:
            # The timed steps run on gloo here, whatever the machine was saved as.
            measured = measurements(name, saved, "gloo")
            models, _ = fitted_models(name, measured)
            for record in hold(name, machine, models, args):
                verdict = record["cpu"]
                table[f"{name}_{record['ranks']}"] = {
                    "predicted_cpu_ms": record["predicted_ms"]["cpu"],
                    "measured_cpu_ms": round(record["measured_cpu_s"]["median"] * 1e3, 1),
                    "cpu_ratio": verdict["ratio"],
                    "cpu_ratio_at_calibration": record["cpu_ratio_at_calibration"],
                    **{
                        f"cpu_ratio_{label}": record[f"cpu_ratio_{label}"]
                        for label in FLOP_FREE_SCORINGS
                    },
                    "predicted_wall_ms": record["predicted_ms"]["wall"],
                    "measured_wall_ms": round(record["measured_wall_s"]["median"] * 1e3, 1),
                    "wall_ratio": record["wall_ratio"],
                }
                goals.append(
                    Goal(
                        f"{name} on {record['ranks']} rank(s): predicted CPU time within "
                        f"{TOLERANCE:.0%} of measured, or explained",
                        verdict["ok"],
                    )
                )
    emit_summary(goals, args.check, machine=dataclasses.asdict(machine), **table)


if __name__ == "__main__":
    main()
