"""Steps per second of the CFD recipe on several meshes, as a user runs it.

``python train.py +recipe=cfd mesh=<mesh> train.steps=40 logger=none`` (the default 64x64 data,
global batch 16) for each mesh, the meshes interleaved in each of ``--rounds`` rounds. A run's
figure is the throughput its last logged step reports (``cells_per_s`` in ``metrics.jsonl``:
all 40 steps, the first one's warm-up included) divided by the cells of a step; ``ratio`` is a
mesh's median over mesh ``1``'s. Each run has its own run directory under a temporary one; the
data file is the recipe's default (generated once, by the first run).

Run ``python -m benchmarks.recipe_throughput [--meshes 1 2x1 1x2 4x2] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._common import emit, spread

ROOT = Path(__file__).resolve().parents[1]
STEPS = 40
CELLS_PER_STEP = 16 * 64 * 64  # global batch x cells of a 64x64 sample


def steps_per_second(mesh: str, run_dir: Path) -> float:
    """One run of the recipe on ``mesh``; its steps per second."""
    command = [
        sys.executable,
        "train.py",
        "+recipe=cfd",
        f"mesh={mesh}",
        f"train.steps={STEPS}",
        "logger=none",
        f"run_dir={run_dir}",
    ]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True, timeout=1800)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "cells_per_s" in r][-1]
    return last["cells_per_s"] / CELLS_PER_STEP


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", nargs="+", default=["1", "2x1", "1x2", "4x2"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rates: dict[str, list[float]] = {mesh: [] for mesh in args.meshes}
    with tempfile.TemporaryDirectory() as scratch:
        order = list(args.meshes)
        for round_index in range(args.rounds):
            for mesh in order:
                run_dir = Path(scratch) / f"{mesh}_{round_index}"
                rates[mesh].append(steps_per_second(mesh, run_dir))
            order.reverse()
    base = statistics.median(rates[args.meshes[0]])
    for mesh, values in rates.items():
        emit(
            "recipe_throughput",
            mesh=mesh,
            steps=STEPS,
            steps_per_s=spread(values, digits=3),
            ratio_to_first=round(statistics.median(values) / base, 3),
        )
    emit(
        "summary",
        first_mesh=args.meshes[0],
        load_average=round(os.getloadavg()[0], 1),
        wall_s=round(time.perf_counter() - start, 1),
    )


if __name__ == "__main__":
    main()
