"""Probe: the dry run's projection (parallel=auto's ``choose``, the ``cpu`` machine) of the
UNet candidates train_step_parts times (CFD recipe, 128², global batch 16), and the same plans
projected on the calibrated machine (argv[1], benchmarks.calibrate's JSON) with a core per
rank (the CPU a rank's own work costs); each plan's busiest class's work."""

import argparse
import dataclasses
import json
import sys
import tempfile

from hydra import compose, initialize_config_dir

import shardsci.train  # noqa: F401  registers the config schemas and the recipes
from benchmarks.parallel_auto import ROOT, recipe_overrides
from shardsci.planning import choose, chosen_config, plan_run
from shardsci.planning._choose import project
from shardsci.planning._machine import Machine

LABELS = {1: "dp=1", 2: "slab H=2", 4: "block H=2 x W=2"}

if __name__ == "__main__":
    args = argparse.Namespace(model="unet", batch=16, resolution=128)
    with open(sys.argv[1]) as f:
        machine = Machine(**json.load(f)["machine"])
    with tempfile.TemporaryDirectory() as scratch:
        with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
            cfg = compose("config", overrides=[*recipe_overrides(args), f"run_dir={scratch}"])
        for world, label in LABELS.items():
            chosen = {c.label: c for c in choose(cfg, world).ranked}[label]
            projection = dataclasses.asdict(chosen.projection)
            plan = plan_run(chosen_config(cfg, chosen.decomposition))
            calibrated = project(plan, machine)
            work = [
                {k: getattr(c, k) for k in ("aten_ops", "communication_ops", "flops", "p2p_rounds")}
                for c in plan.classes
            ]
            print(
                json.dumps(
                    {
                        "world": world,
                        "label": label,
                        "projection_s": projection,
                        "calibrated_s": dataclasses.asdict(calibrated),
                        "classes": work,
                    }
                ),
                flush=True,
            )
