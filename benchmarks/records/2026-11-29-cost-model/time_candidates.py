"""Probe (issue 22, item 5): how long one ``parallel_auto`` run of a candidate takes, to size the
8-rank check: ``choose`` for ``--world`` ranks, then each candidate of ``--labels`` run once as
``parallel_auto`` runs it (``run_steps``), with the whole run's wall seconds. Usage: python
benchmarks/records/2026-11-29-cost-model/time_candidates.py --world 8 --steps 6 --labels "dp=8"
"slab H=8" (the 09:07-09:10 UTC lines of parallel_auto_runs_0907.jsonl came from the same probe
on the step_seconds of before 5ccdc27: ``step_s`` the mean of the second half of the steps)."""

import argparse
import json
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

import shardsci.train  # noqa: F401  registers the config schemas and the recipes
from benchmarks import parallel_auto


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--labels", nargs="*")
    options = parser.parse_args()
    args = argparse.Namespace(model="fno", batch=16, resolution=64, steps=options.steps)
    scratch, started = Path(tempfile.mkdtemp()), time.time()
    overrides = parallel_auto.recipe_overrides(args)
    with initialize_config_dir(config_dir=str(parallel_auto.ROOT / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, f"run_dir={scratch}"])
    choice = parallel_auto.choose(cfg, options.world)
    print(json.dumps({"choose_s": round(time.time() - started, 1)}), flush=True)
    for number, candidate in enumerate(choice.ranked):
        if options.labels and candidate.label not in options.labels:
            continue
        configs, run_dir = scratch / f"configs{number}", scratch / f"run{number}"
        started = time.time()
        run = parallel_auto.run_steps(
            [*overrides, *parallel_auto.candidate_overrides(candidate, configs)], run_dir, args
        )
        wall = round(time.time() - started, 1)
        print(json.dumps({"label": candidate.label, "run_wall_s": wall, **run}), flush=True)


if __name__ == "__main__":
    main()
