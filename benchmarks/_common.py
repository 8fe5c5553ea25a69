"""What every benchmark shares: JSON-lines output, goals and ``--check``, per-call timing,
running on N gloo ranks.

Records go to stdout, one JSON object per line, so ``python -m benchmarks.<name> | jq`` or a
plain ``json.loads`` per line reads them; anything else a benchmark says goes to stderr.

# NOTE [A benchmark's goals and --check]
A benchmark that states a goal (a speed-up, a memory ratio, bytes at the lower bound, its
result agreeing with one process) reports each as a ``Goal`` in its ``summary`` record
(``goals``: statement and ``met``; ``goals_met``: all of them). Every benchmark takes
``--check``: then a missed goal makes it exit with status 1 after the summary, naming the goal
on stderr, so that a script or CI run fails where a reader of the JSON would have to look. A
benchmark without goals exits 0 under ``--check``. ``tests/test_benchmarks.py`` runs each at a
tiny size, once with a goal made unreachable.

# NOTE [The conditions under every figure]
This machine's speed moves with its load, so every ``summary`` record says what it was
measured under, added by ``emit_summary`` rather than by each benchmark: ``cores`` (those
this process may run on), ``load_average_before`` (the 1-minute load average when the
benchmark parsed its arguments), ``load_average_after`` (when it emitted the summary) and
``wall_s`` (the seconds between).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardsci.testing import Span, Traffic, count_traffic, run_on_ranks, shutdown_pools

__all__ = [
    "Goal",
    "emit",
    "emit_summary",
    "interleaved_medians_us",
    "interleaved_steps",
    "least_squares",
    "on_ranks",
    "parse_arguments",
    "rank_pools",
    "restart_pools",
    "rss_bytes",
    "spread",
    "step_traffic",
]

_RANK_TIMEOUT_S = 300.0
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """This process's resident set size now, in bytes (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE_BYTES


def emit(record: str, **fields: Any) -> None:
    """Print one JSON object, ``{"record": record, **fields}``, on its own line of stdout."""
    print(json.dumps({"record": record, **fields}), flush=True)


@dataclass(frozen=True)
class Goal:
    """A target a benchmark states and whether this run met it (NOTE [A benchmark's goals and
    --check])."""

    statement: str
    met: bool


@dataclass
class _Started:
    """When the running benchmark parsed its arguments, and the load then."""

    wall: float = 0.0
    load_average: float = 0.0


_started = _Started()


def parse_arguments(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """``parser``'s arguments plus ``--check``; starts the run's clock (NOTE [The conditions
    under every figure])."""
    parser.add_argument(
        "--check", action="store_true", help="exit with status 1 when a goal is missed"
    )
    args = parser.parse_args(argv)
    _started.wall, _started.load_average = time.perf_counter(), os.getloadavg()[0]
    return args


def emit_summary(goals: Sequence[Goal], check: bool, **fields: Any) -> None:
    """Emit the ``summary`` record: ``fields``, the conditions of the run (NOTE [The
    conditions under every figure]), ``goals`` and ``goals_met``. With ``check``, a missed
    goal then ends the run with status 1, naming it on stderr."""
    emit(
        "summary",
        **fields,
        cores=len(os.sched_getaffinity(0)),
        load_average_before=round(_started.load_average, 1),
        load_average_after=round(os.getloadavg()[0], 1),
        wall_s=round(time.perf_counter() - _started.wall, 1),
        goals=[{"goal": goal.statement, "met": bool(goal.met)} for goal in goals],
        goals_met=all(goal.met for goal in goals),
    )
    missed = [goal.statement for goal in goals if not goal.met]
    if check and missed:
        print(f"--check: goal missed: {'; '.join(missed)}", file=sys.stderr, flush=True)
        raise SystemExit(1)


def interleaved_medians_us(
    candidates: dict[str, Callable[[], object]],
    *,
    rounds: int = 1000,
    calls_per_round: int = 10,
    warmup_rounds: int = 100,
) -> dict[str, float]:
    """Median wall time of one call of each candidate, in microseconds.

    Each round times ``calls_per_round`` back-to-back calls of every candidate in turn (with
    ``time.perf_counter_ns``), so that drift in the machine's speed affects all candidates
    alike and their ratios are taken side by side. The first ``warmup_rounds`` rounds fill
    caches and are discarded.

    Parameters
    ----------
    candidates : dict
        Name -> a function of no arguments running the operation once.
    rounds, calls_per_round, warmup_rounds : int
        Timed rounds, calls per timed batch, and discarded rounds.

    Returns
    -------
    dict
        Name -> median over rounds of (batch time / ``calls_per_round``), in µs.
    """
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for round_index in range(warmup_rounds + rounds):
        for name, fn in candidates.items():
            start = time.perf_counter_ns()
            for _ in range(calls_per_round):
                fn()
            elapsed_ns = time.perf_counter_ns() - start
            if round_index >= warmup_rounds:
                samples[name].append(elapsed_ns / calls_per_round / 1e3)
    return {name: statistics.median(times) for name, times in samples.items()}


def interleaved_steps(
    variants: list[str], rounds: int, run: Callable[[str], list[float]]
) -> dict[str, list[float]]:
    """Variant -> every timed step, from ``rounds`` rounds in which each variant runs once
    (``run(variant)`` returns the seconds of its steps), the order reversed every round so
    that drift in the machine's speed affects all variants alike."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for _ in range(rounds):
        for name in order:
            samples[name] += run(name)
        order.reverse()
    return samples


def timed_steps(step: Callable[[], None], steps: int) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds (``time.process_time``) of each of ``steps`` calls of ``step``
    on this rank, each started after a barrier of the process group."""
    walls, cpus = [], []
    for _ in range(steps):
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return walls, cpus


def least_squares(rows: list[list[float]], values: list[float]) -> list[float]:
    """``x`` of least squares ``rows @ x = values``, in float64."""
    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(values, dtype=torch.float64).unsqueeze(1)
    return torch.linalg.lstsq(a, b, driver="gelsd").solution.squeeze(1).tolist()


def spread(samples: list[float], digits: int = 4) -> dict[str, float]:
    """Median and spread of step times: ``median``, ``q1``, ``q3`` (quartiles), ``min``,
    ``max``, ``n``."""
    ordered = sorted(samples)
    q1, _, q3 = (
        statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1 else ordered * 3
    )
    return {
        "median": round(statistics.median(ordered), digits),
        "q1": round(q1, digits),
        "q3": round(q3, digits),
        "min": round(ordered[0], digits),
        "max": round(ordered[-1], digits),
        "n": len(ordered),
    }


def on_ranks(world_size: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """Run the module-level ``fn(*args)`` on ``world_size`` gloo ranks; results in rank order."""
    return run_on_ranks(world_size, fn, *args, timeout_s=_RANK_TIMEOUT_S)


@contextmanager
def rank_pools() -> Iterator[None]:
    """Stop the rank pools started by :func:`on_ranks` when the block exits."""
    try:
        yield
    finally:
        shutdown_pools()


def restart_pools() -> None:
    """Stop the rank pools, so that the next :func:`on_ranks` starts fresh processes (for a
    figure over a process's lifetime, such as its peak resident set size)."""
    shutdown_pools()


def step_traffic(
    step: Callable[[], None], model: Any, label: Callable[[Span], str] = lambda span: span.kind
) -> tuple[Counter, Counter]:
    """One training ``step``'s traffic (``count_traffic``; rank body), calls and bytes
    received by ``label`` of each collective's span (default: its kind; NOTE [The span of a
    collective]): the step under ``model.no_sync()``, with ``p2p_rounds`` (halo exchanges)
    among the calls, and ``gradient_all_reduce``, what a second step with gradient reduction
    (``domain_parallel``) issues beyond it under the label ``"all_reduce"``."""
    with model.no_sync(), count_traffic() as without:
        step()
    with count_traffic() as with_gradients:
        step()
    calls, received = _by_label(without, label)
    calls["p2p_rounds"] = without.p2p_rounds
    more_calls, more_received = _by_label(with_gradients, label)
    calls["gradient_all_reduce"] = more_calls["all_reduce"] - calls["all_reduce"]
    received["gradient_all_reduce"] = more_received["all_reduce"] - received["all_reduce"]
    return calls, received


def _by_label(traffic: Traffic, label: Callable[[Span], str]) -> tuple[Counter, Counter]:
    calls, received = Counter(), Counter()
    for span, n in traffic.calls_by_span.items():
        calls[label(span)] += n
        received[label(span)] += traffic.received_by_span[span]
    return calls, received
