"""``parallel=auto`` against measurement: every candidate decomposition run, the chosen one's
step time against the best measured (issue 22, item 5).

For each world size (``--worlds``), ``choose`` (NOTE [How parallel=auto chooses]) plans and
ranks every decomposition of the CFD recipe's run (``--model``, ``--resolution``, ``--batch``)
on this machine (``parallel.machine=cpu``); then every candidate that fits is trained as a user
runs it, ``python train.py +recipe=cfd mesh=<its mesh> parallel.*=<its roles>
train.steps=<--steps> train.log_every=1``, the candidates interleaved (their order reversed
every round) for ``--rounds`` rounds. A run's step time is the median wall time of its steps
after the first ``WARMUP_STEPS`` (each step's from the cumulative throughputs it logs: the
first steps' warm-up and the start-up excluded). Goal: the chosen candidate's median step time
within ``GOAL_RATIO`` of the best median measured.

# NOTE [A quiet machine for the verdict]
On 2 cores shared with other users, a candidate's runs spread 2-7x and the ratio follows the
share of the cores the others leave it (benchmarks/README.md, "What dp=8 waits on"), so each
run records what it shared the machine with: the load average before and after it, and
``others_cores``, the cores other processes kept busy while it ran (``/proc/stat``'s busy time
of every CPU over the run, less the run's own CPU time, over its wall time; 0 on a quiet
machine, up to the number of cores). The ``choice`` record gives the largest
``others_cores`` of its runs: a verdict is a quiet machine's only where that is small. The
load average is no such measure here: the run's own ranks lift it (8 ranks: to about 8).

Run ``python -m benchmarks.parallel_auto [--worlds 4 8] [--rounds 2] [--steps 6] [--resolution
64] [--batch 16] [--model fno] [--budget-s S] [--check]``. With 8 ranks ``choose`` takes about
20 s and a run of a candidate about 13 s of start-up plus its steps (0.5-1.7 s each, the first
about 2 s more): about 23 s at ``--steps 6``, 10 candidates a round (2026-11-29, load 4-13:
benchmarks/README.md). ``--replay out.jsonl`` ranks an earlier output's runs again with today's
projection (the same settings), training nothing. A run's ``run_cpu_s`` is the CPU time of the
whole ``train.py`` run, every rank and the start-up included (``RUSAGE_CHILDREN``).
``--budget-s`` stops before a round that would end past it (a round's time: the mean of the
rounds so far; ``stopped`` says after which), so a loaded machine gives fewer rounds, not an
overrun. JSON lines: ``run`` (one per run, its ``step_s`` and ``steps_s``, CPU, load and
``others_cores``), ``candidate`` (world, label, mesh, projected parts in ms, measured
``step_s``), ``choice`` per world (chosen, best measured, ``ratio``, ``rounds`` run), ``summary``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

import shardsci.train  # noqa: F401  registers the config schemas and the recipes
from benchmarks._common import Goal, emit, emit_summary, parse_arguments, spread
from shardsci.planning import Candidate, choose

ROOT = Path(__file__).resolve().parents[1]
GOAL_RATIO = 1.10
WARMUP_STEPS = 2
"""A run's first steps, not timed: the first step's planning and warm-up, and the second's."""


def recipe_overrides(args: argparse.Namespace) -> list[str]:
    """The run every candidate trains: the recipe, its model, data size and batch."""
    return [
        "+recipe=cfd",
        f"model={args.model}",
        f"train.global_batch={args.batch}",
        f"data.dataset.solver.resolution={args.resolution}",
        "logger=none",
        "parallel.machine=cpu",
        "eval.rollout_steps=1",  # the evaluation after training is not timed
    ]


def candidate_overrides(candidate: Candidate, configs: Path) -> list[str]:
    """The command-line settings that run ``candidate``'s decomposition and no choice: its
    mesh, and its axis roles as a ``parallel`` option of its own in the config directory
    ``configs`` (written here; ``parallel.domain`` cannot be set on the command line over
    the options' ``null``)."""
    parallel = candidate.decomposition.parallel()
    (configs / "parallel").mkdir(parents=True, exist_ok=True)
    (configs / "parallel" / "candidate.yaml").write_text(
        json.dumps(
            {
                "axis_names": parallel.axis_names,
                "data_parallel": parallel.data_parallel,
                "domain": parallel.domain,
                "choose": False,
            }
        )
    )
    return [
        f"mesh={candidate.decomposition.mesh}",
        f"hydra.searchpath=[file://{configs}]",
        "parallel=candidate",
    ]


def busy_cpu_s() -> float:
    """CPU seconds every core of this machine has been busy since boot (``/proc/stat``: all
    but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def step_times(cells_per_s: list[float], cells: float) -> list[float]:
    """Each step's wall seconds from the throughputs a run logs after every step
    (``cells_per_s[k]``: ``cells`` per step over the ``k + 1`` steps so far, cumulative)."""
    elapsed = [0.0] + [(k + 1) * cells / rate for k, rate in enumerate(cells_per_s)]
    return [after - before for before, after in itertools.pairwise(elapsed)]


def run_steps(overrides: list[str], run_dir: Path, args: argparse.Namespace) -> dict:
    """One ``--steps``-step run of ``overrides``: ``step_s``, the median wall seconds of its
    steps after ``WARMUP_STEPS`` (``steps_s``: each of them); ``run_cpu_s``, the CPU seconds of
    the whole run (every rank's, start-up included: the children's ``RUSAGE_CHILDREN`` user
    plus system time); and what it shared the machine with (NOTE [A quiet machine for the
    verdict]): ``load_before``, ``load_after`` and ``others_cores``."""
    if args.steps <= WARMUP_STEPS:
        raise SystemExit(f"--steps must be more than {WARMUP_STEPS} (the untimed steps)")
    command = [
        sys.executable,
        "train.py",
        *overrides,
        f"train.steps={args.steps}",
        "train.log_every=1",
        f"train.eval_every={10 * args.steps}",
        "train.checkpoint_every=0",
        f"run_dir={run_dir}",
    ]
    load_before = os.getloadavg()[0]
    before, busy, started = resource.getrusage(resource.RUSAGE_CHILDREN), busy_cpu_s(), time.time()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    after, busy, wall = (
        resource.getrusage(resource.RUSAGE_CHILDREN),
        busy_cpu_s() - busy,
        time.time() - started,
    )
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rates = [r["cells_per_s"] for r in map(json.loads, lines) if "cells_per_s" in r]
    steps = step_times(rates, args.batch * args.resolution**2)[WARMUP_STEPS:]
    return {
        "step_s": statistics.median(steps),
        "steps_s": [round(s, 4) for s in steps],
        "run_cpu_s": round(cpu, 2),
        "load_before": round(load_before, 1),
        "load_after": round(os.getloadavg()[0], 1),
        "others_cores": round(max(0.0, busy - cpu) / wall, 2),
    }


def replayed(paths: list[str], world: int) -> list[dict]:
    """The ``run`` records of ``world`` ranks in the JSON lines of ``paths`` (an earlier
    run's output): ranked again without training anything."""
    records = (json.loads(line) for path in paths for line in Path(path).read_text().splitlines())
    return [r for r in records if r.get("record") == "run" and r["world"] == world]


def measure_world(
    world: int, args: argparse.Namespace, scratch: Path, deadline: float | None
) -> Goal:
    """Choose for ``world`` ranks, run every candidate ``--rounds`` times (fewer where another
    round would end past ``deadline``, a ``time.monotonic()``; at least one), emit the records
    and return the goal."""
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=[*recipe_overrides(args), f"run_dir={scratch}"])
    choice = choose(cfg, world, prune=False)  # every candidate projected, to run them all
    measured: dict[str, list[float]] = {c.label: [] for c in choice.ranked}
    cpu_measured: dict[str, list[float]] = {c.label: [] for c in choice.ranked}
    others: list[float] = []
    for run in replayed(args.replay, world):
        measured[run["label"]].append(run["step_s"])
        if "run_cpu_s" in run:  # not in outputs from before 2026-11-28 17:20 UTC
            cpu_measured[run["label"]].append(run["run_cpu_s"])
        if "others_cores" in run:  # not in outputs from before 2026-11-29 09:16 UTC
            others.append(run["others_cores"])
    missing = [label for label, runs in measured.items() if args.replay and not runs]
    if missing:
        raise SystemExit(f"--replay: no run of {missing} on {world} ranks in {args.replay}")
    order = list(enumerate(choice.ranked))
    rounds, started = 0 if args.replay else args.rounds, time.monotonic()
    for round_index in range(rounds):
        per_round = (time.monotonic() - started) / max(round_index, 1)
        if round_index and deadline is not None and time.monotonic() + per_round > deadline:
            emit("stopped", world=world, rounds=round_index, round_s=round(per_round, 1))
            rounds = round_index
            break
        for number, candidate in order:
            run_dir = scratch / f"world{world}_candidate{number}_round{round_index}"
            configs = scratch / f"world{world}_candidate{number}_configs"
            overrides = [*recipe_overrides(args), *candidate_overrides(candidate, configs)]
            run = run_steps(overrides, run_dir, args)
            measured[candidate.label].append(run["step_s"])
            cpu_measured[candidate.label].append(run["run_cpu_s"])
            others.append(run["others_cores"])
            emit("run", world=world, label=candidate.label, round=round_index, **run)
        order.reverse()
    medians = {label: statistics.median(values) for label, values in measured.items()}
    for number, candidate in enumerate(choice.ranked, start=1):
        p = candidate.projection
        emit(
            "candidate",
            world=world,
            projected_rank=number,
            label=candidate.label,
            mesh=candidate.decomposition.mesh,
            peak_gib=round(candidate.peak_bytes / 2**30, 4),
            projected_ms={
                part: round(getattr(p, part) * 1e3, 2)
                for part in ("compute", "communication", "host", "step")
            },
            step_s=spread(measured[candidate.label], digits=3),
            run_cpu_s=spread(cpu_measured[candidate.label], digits=2)
            if cpu_measured[candidate.label]
            else None,
        )
    for candidate in choice.dropped:
        emit("dropped", world=world, label=candidate.label, problem=candidate.problem)
    chosen = choice.best.label
    best = min(medians, key=medians.get)
    ratio = medians[chosen] / medians[best]
    emit(
        "choice",
        world=world,
        chosen=chosen,
        best_measured=best,
        chosen_step_s=round(medians[chosen], 3),
        best_step_s=round(medians[best], 3),
        ratio=round(ratio, 3),
        measured_order=sorted(medians, key=medians.get),
        others_cores_max=max(others) if others else None,
        rounds=rounds,
    )
    return Goal(
        f"{world} ranks: chosen within {GOAL_RATIO}x of the best measured", ratio <= GOAL_RATIO
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--steps", type=int, default=6, help=f"training steps per run, {WARMUP_STEPS} untimed"
    )
    parser.add_argument("--resolution", type=int, default=64, help="H = W of the data")
    parser.add_argument("--batch", type=int, default=16, help="global batch")
    parser.add_argument("--model", default="fno", help="configs/model/<name>")
    parser.add_argument(
        "--replay",
        nargs="*",
        default=[],
        metavar="JSONL",
        help="rank again the runs of these earlier outputs instead of training",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        help="start no round that would end past this many seconds from now (rounds so far: "
        "their mean); at least one round runs",
    )
    args = parse_arguments(parser, argv)
    deadline = None if args.budget_s is None else time.monotonic() + args.budget_s
    with tempfile.TemporaryDirectory() as scratch:
        goals = [measure_world(world, args, Path(scratch), deadline) for world in args.worlds]
    emit_summary(goals, args.check)


if __name__ == "__main__":
    main()
