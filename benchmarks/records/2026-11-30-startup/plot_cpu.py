"""CPU time of one rollout picture, two implementations of ``save_rollout`` alternated in one
process: ``python plot_cpu.py BEFORE.py AFTER.py [rounds]`` (each file a copy of
``shardsci/training/_plots.py``). One JSON line per picture, then the medians."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def _load(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.save_rollout


def main() -> None:
    before, after = _load(sys.argv[1]), _load(sys.argv[2])
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    x = torch.linspace(0, 2 * math.pi, 64)
    wave = 0.7 * torch.sin(x[:, None] + x[None, :])
    truths = torch.stack([(1 + 0.06 * k) * wave for k in range(10)])
    predictions = truths + 0.02 * torch.cos(3 * x)[None, None, :]
    errors = {
        "this trajectory": [0.0044 * 1.4**k for k in range(10)],
        "held-out mean": [0.0046 * 1.4**k for k in range(10)],
        "persistence (held-out mean)": [0.1 * 1.18**k for k in range(10)],
    }
    title = "training step 600: a 10-step rollout of held-out trajectory 32, vorticity"
    times: dict[str, list[float]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as directory:
        for save in (before, after):  # matplotlib's import and first-figure costs, not timed
            save(Path(directory) / "warm.png", predictions, truths, errors, title)
        for round_ in range(rounds):
            for name, save in (("before", before), ("after", after)):
                start = time.process_time()
                save(Path(directory) / f"{name}.png", predictions, truths, errors, title)
                times[name].append(time.process_time() - start)
                print(
                    json.dumps(
                        {
                            "round": round_,
                            "version": name,
                            "cpu_s": round(times[name][-1], 4),
                            "load": os.getloadavg()[0],
                        }
                    )
                )
    for name, values in times.items():
        print(
            json.dumps(
                {
                    "version": name,
                    "median_cpu_s": round(statistics.median(values), 4),
                    "min": round(min(values), 4),
                    "max": round(max(values), 4),
                }
            )
        )


if __name__ == "__main__":
    main()
