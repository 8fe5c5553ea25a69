"""``parallel=auto`` against measurement: every candidate decomposition run, the chosen one's
step time against the best measured (issue 22, item 5).

For each world size (``--worlds``), ``choose`` (NOTE [How parallel=auto chooses]) plans and
ranks every decomposition of the CFD recipe's run (``--model``, ``--resolution``, ``--batch``)
on this machine (``parallel.machine=cpu``); then every candidate that fits is trained as a user
runs it, ``python train.py +recipe=cfd mesh=<its mesh> parallel.*=<its roles>
train.steps=<2k> train.log_every=<k>``, the candidates interleaved (their order reversed every
round) for ``--rounds`` rounds. A run's step time is that of its second ``k`` steps (from the
two cumulative throughputs it logs: the first step's warm-up and the start-up excluded).
Goal: the chosen candidate's median step time within ``GOAL_RATIO`` of the best median
measured. The load average before and after is in the summary: the 2 cores are shared.

Run ``python -m benchmarks.parallel_auto [--worlds 4 8] [--rounds 2] [--steps 6] [--resolution
64] [--batch 16] [--model fno] [--check]`` (≈15 min for 4 and 8 ranks on a quiet machine);
``--replay out.jsonl`` ranks an earlier output's runs again with today's projection (the same
settings), training nothing. A run's ``run_cpu_s`` is the CPU time of the whole ``train.py``
run, every rank and the start-up included (``RUSAGE_CHILDREN``).
JSON lines: ``candidate`` (world, label, mesh, projected parts in ms, measured ``step_s``),
``choice`` per world (chosen, best measured, ``ratio``), ``summary``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir

import shardsci.train  # noqa: F401  registers the config schemas and the recipes
from benchmarks._common import Goal, emit, emit_summary, parse_arguments, spread
from shardsci.planning import Candidate, choose

ROOT = Path(__file__).resolve().parents[1]
GOAL_RATIO = 1.10


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


def step_seconds(
    overrides: list[str], run_dir: Path, args: argparse.Namespace
) -> tuple[float, float]:
    """Wall seconds per step of the second half of a ``2 k``-step run of ``overrides``, and
    the CPU seconds of the whole run (every rank's, start-up included: the children's
    ``RUSAGE_CHILDREN`` user plus system time)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    half = args.steps // 2
    command = [
        sys.executable,
        "train.py",
        *overrides,
        f"train.steps={2 * half}",
        f"train.log_every={half}",
        f"train.eval_every={10 * half}",
        "train.checkpoint_every=0",
        f"run_dir={run_dir}",
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rates = [r["cells_per_s"] for r in map(json.loads, lines) if "cells_per_s" in r]
    cells = args.batch * args.resolution**2
    first, second = half * cells / rates[-2], 2 * half * cells / rates[-1]
    return (second - first) / half, cpu


def replayed(paths: list[str], world: int) -> list[dict]:
    """The ``run`` records of ``world`` ranks in the JSON lines of ``paths`` (an earlier
    run's output): ranked again without training anything."""
    records = (json.loads(line) for path in paths for line in Path(path).read_text().splitlines())
    return [r for r in records if r.get("record") == "run" and r["world"] == world]


def measure_world(world: int, args: argparse.Namespace, scratch: Path) -> Goal:
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=[*recipe_overrides(args), f"run_dir={scratch}"])
    choice = choose(cfg, world)
    measured: dict[str, list[float]] = {c.label: [] for c in choice.ranked}
    cpu_measured: dict[str, list[float]] = {c.label: [] for c in choice.ranked}
    for run in replayed(args.replay, world):
        measured[run["label"]].append(run["step_s"])
        if "run_cpu_s" in run:  # not in outputs from before 2026-11-28 17:20 UTC
            cpu_measured[run["label"]].append(run["run_cpu_s"])
    missing = [label for label, runs in measured.items() if args.replay and not runs]
    if missing:
        raise SystemExit(f"--replay: no run of {missing} on {world} ranks in {args.replay}")
    order = list(enumerate(choice.ranked))
    for round_index in range(0 if args.replay else args.rounds):
        for number, candidate in order:
            run_dir = scratch / f"world{world}_candidate{number}_round{round_index}"
            configs = scratch / f"world{world}_candidate{number}_configs"
            overrides = [*recipe_overrides(args), *candidate_overrides(candidate, configs)]
            seconds, cpu = step_seconds(overrides, run_dir, args)
            measured[candidate.label].append(seconds)
            cpu_measured[candidate.label].append(cpu)
            emit(
                "run",
                world=world,
                label=candidate.label,
                round=round_index,
                step_s=seconds,
                run_cpu_s=round(cpu, 2),
            )
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
    )
    return Goal(
        f"{world} ranks: chosen within {GOAL_RATIO}x of the best measured", ratio <= GOAL_RATIO
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="training steps per run (even)")
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
    args = parse_arguments(parser, argv)
    with tempfile.TemporaryDirectory() as scratch:
        goals = [measure_world(world, args, Path(scratch)) for world in args.worlds]
    emit_summary(
        goals,
        args.check,
    )


if __name__ == "__main__":
    main()
