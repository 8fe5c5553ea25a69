"""A few of the 3-D recipe's 512-rank candidates planned in full, each step against its first
rank class's bound (the search itself did not finish here). From the repository root:
``OMP_NUM_THREADS=1 python benchmarks/records/2026-11-30-auto-512/probe3d.py``."""

import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

import shardsci.train  # noqa: F401  (registers the config schemas)
from shardsci.planning._choose import Decomposition, chosen_config, project
from shardsci.planning._dry_run import planned_machine, start_plan
from shardsci.training import ParallelConfig, config_from

OVERRIDES = ["+recipe=cfd3d", "mesh=512", "parallel=auto", "parallel.machine=h100",
             "train.global_batch=512", "data.dataset.solver.resolution=256"]  # fmt: skip
CANDIDATES = [
    Decomposition(512, ()),
    Decomposition(256, (("D", 2),)),
    Decomposition(128, (("D", 2), ("H", 2))),
    Decomposition(64, (("D", 2), ("H", 2), ("W", 2))),
]

with initialize_config_dir(str(Path.cwd() / "configs"), version_base=None):
    cfg = compose("config", overrides=[*OVERRIDES, f"run_dir={tempfile.mkdtemp()}"])
machine, _ = planned_machine(config_from(ParallelConfig, cfg.parallel), 512)
for d in CANDIDATES:
    start = time.process_time()
    plan = start_plan(chosen_config(cfg, d), 80)
    first = project(plan.so_far(), machine)
    whole = plan.finished()
    if whole.problems:
        print(d.describe(3), whole.problems, flush=True)
        continue
    p = project(whole, machine)
    peak = max(c.memory.peak for c in whole.classes) / 2**30
    print(
        f"{d.describe(3):30s} mesh {d.mesh:12s} peak {peak:.3f} GiB  compute "
        f"{p.compute * 1e3:.4g}  comm {p.communication * 1e3:.4g}  host {p.host * 1e3:.4g}  "
        f"step {p.step * 1e3:.4g} ms (first class's bound {first.step * 1e3:.4g}); "
        f"{len(whole.classes)} classes, {time.process_time() - start:.1f} s CPU",
        flush=True,
    )
