"""Steps per second of the CFD recipe on several meshes, as a user runs it.

``python train.py +recipe=cfd mesh=<mesh> train.steps=40 logger=none`` (the default 64x64 data,
global batch 16) for each mesh, the meshes interleaved in each of ``--rounds`` rounds. A run's
figure is the throughput its last logged step reports (``cells_per_s`` in ``metrics.jsonl``:
all 40 steps, the first one's warm-up included) divided by the cells of a step; ``ratio`` is a
mesh's median over the first mesh's. Each run has its own run directory under a temporary
one; the data file is the recipe's default for the resolution (generated once, by the first
run). Goals (issue 7), where the first mesh is ``1``: ``GOALS``.

Run ``python -m benchmarks.recipe_throughput [--meshes 1 2x1 1x2 4x2] [--rounds 3] [--steps 40]
[--resolution 64] [--batch 16] [--check]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks._common import Goal, emit, emit_summary, parse_arguments, spread

ROOT = Path(__file__).resolve().parents[1]
# Mesh -> the least steps per second it must reach, as a fraction of mesh 1's (issue 7).
GOALS = {"1x2": 0.7, "4x2": 0.35}


def steps_per_second(mesh: str, run_dir: Path, args: argparse.Namespace) -> float:
    """One run of the recipe on ``mesh`` (``args``: steps, resolution, batch); its steps per
    second."""
    command = [
        sys.executable,
        "train.py",
        "+recipe=cfd",
        f"mesh={mesh}",
        f"train.steps={args.steps}",
        f"train.log_every={args.steps}",  # the figure is the last step's: all steps
        f"train.global_batch={args.batch}",
        f"data.dataset.solver.resolution={args.resolution}",
        "logger=none",
        f"run_dir={run_dir}",
    ]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True, timeout=1800)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "cells_per_s" in r][-1]
    return last["cells_per_s"] / (args.batch * args.resolution**2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", nargs="+", default=["1", "2x1", "1x2", "4x2"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="training steps per run")
    parser.add_argument("--resolution", type=int, default=64, help="H = W of the data")
    parser.add_argument("--batch", type=int, default=16, help="global batch")
    args = parse_arguments(parser, argv)
    rates: dict[str, list[float]] = {mesh: [] for mesh in args.meshes}
    with tempfile.TemporaryDirectory() as scratch:
        order = list(args.meshes)
        for round_index in range(args.rounds):
            for mesh in order:
                run_dir = Path(scratch) / f"{mesh}_{round_index}"
                rates[mesh].append(steps_per_second(mesh, run_dir, args))
            order.reverse()
    base = statistics.median(rates[args.meshes[0]])
    ratios = {mesh: statistics.median(values) / base for mesh, values in rates.items()}
    for mesh, values in rates.items():
        emit(
            "recipe_throughput",
            mesh=mesh,
            steps=args.steps,
            resolution=args.resolution,
            global_batch=args.batch,
            steps_per_s=spread(values, digits=3),
            ratio_to_first=round(ratios[mesh], 3),
        )
    goals = [
        Goal(f"mesh {mesh} at least {least}x mesh 1's steps per second", ratios[mesh] >= least)
        for mesh, least in GOALS.items()
        if mesh in ratios and args.meshes[0] == "1"
    ]
    emit_summary(
        goals,
        args.check,
        first_mesh=args.meshes[0],
    )


if __name__ == "__main__":
    main()
