"""Start-to-first-step and whole-run wall and CPU time of ``python train.py +recipe=cfd mesh=1``
(and the overrides given), two checkouts alternated: ``python run_wall.py BEFORE_DIR AFTER_DIR
ROUNDS [override ...]``. Each checkout needs the recipe's data in ``data/generated/`` (else the
first run generates it). The first step is the first line with a loss in ``metrics.jsonl``
(run with ``train.log_every=1``); CPU is the run's process and its children's. One JSON line
per run, then the medians."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _first_step_seen(run_dir: Path) -> bool:
    path = run_dir / "metrics.jsonl"
    return path.is_file() and any('"loss"' in line for line in path.read_text().splitlines())


def _run(checkout: str, run_dir: Path, overrides: list[str]) -> dict[str, float]:
    command = [
        sys.executable,
        "train.py",
        "+recipe=cfd",
        "mesh=1",
        f"run_dir={run_dir}",
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    process = subprocess.Popen(
        command, cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    first_step = None
    while process.poll() is None:
        if first_step is None and _first_step_seen(run_dir):
            first_step = time.monotonic() - start
        time.sleep(0.05)
    wall = time.monotonic() - start
    stderr = process.stderr.read()
    if process.returncode:
        raise RuntimeError(f"{checkout}: exit {process.returncode}\n{stderr[-2000:]}")
    return {"first_step_s": round(first_step or float("nan"), 2), "wall_s": round(wall, 2)}


def main() -> None:
    before, after, rounds, *overrides = sys.argv[1:]
    results: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as directory:
        for round_ in range(int(rounds)):
            for name, checkout in (("before", before), ("after", after)):
                cpu0 = os.times()
                load = os.getloadavg()[0]
                result = _run(checkout, Path(directory) / f"{name}{round_}", overrides)
                cpu1 = os.times()
                result["cpu_s"] = round(
                    cpu1.children_user
                    + cpu1.children_system
                    - cpu0.children_user
                    - cpu0.children_system,
                    2,
                )
                results[name].append(result)
                print(
                    json.dumps({"round": round_, "version": name, **result, "load_at_start": load}),
                    flush=True,
                )
    for name, runs in results.items():
        summary = {
            key: (
                statistics.median(r[key] for r in runs),
                min(r[key] for r in runs),
                max(r[key] for r in runs),
            )
            for key in runs[0]
        }
        print(json.dumps({"version": name, "median_min_max": summary}))


if __name__ == "__main__":
    main()
