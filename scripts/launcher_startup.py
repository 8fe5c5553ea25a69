"""Startup cost and reliability of local launchers: ours, and torch's elastic agent.

``python scripts/launcher_startup.py --ranks 8 --repeats 10`` launches a trivial job (every
rank joins a gloo group and passes a barrier) with ``shardsci.training.run_local_ranks`` (NOTE
[Ranks forked by train.py behave like torchrun's]) and with ``elastic_launch``, torch's agent,
forking (``--methods fork,forkserver,spawn`` adds its other start methods), interleaved, each
launch in a fresh process as ``train.py`` does. It prints one JSON line per launcher: median,
min and max wall seconds from the start of the process to its end (imports included) over the
launches that succeeded, and how many failed (a rank that never joined fails its launch after
``--join-timeout`` seconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]

_LAUNCH = """
import sys
import torch, torch._dynamo, torch.distributed as dist
from datetime import timedelta
sys.path.insert(0, {root!r})
from scripts.launcher_startup import job
launcher, ranks = {launcher!r}, {ranks}
if launcher == "shardsci":
    from shardsci.training import run_local_ranks
    sys.exit(run_local_ranks(ranks, job, {timeout}))

import multiprocessing
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
if launcher == "forkserver":
    multiprocessing.set_forkserver_preload(["torch", "torch._dynamo", "scripts.launcher_startup"])
config = LaunchConfig(
    min_nodes=1, max_nodes=1, nproc_per_node=ranks, run_id="startup", rdzv_backend="c10d",
    rdzv_endpoint="127.0.0.1:0", max_restarts=0, start_method=launcher,
    logs_specs=DefaultLogsSpecs(), shutdown_timeout=5,
)
elastic_launch(config, job)({timeout})
"""


def job(timeout_s: float) -> None:
    """What every rank does: join a gloo group, pass a barrier, leave."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    dist.barrier()
    dist.destroy_process_group()


def _launch(launcher: str, ranks: int, timeout_s: float) -> tuple[float, bool]:
    code = _LAUNCH.format(root=str(ROOT), launcher=launcher, ranks=ranks, timeout=timeout_s)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        timeout=timeout_s * 10,
    )
    return time.perf_counter() - start, done.returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--methods", default="fork", help="elastic start methods to try")
    parser.add_argument("--join-timeout", type=float, default=20.0)
    options = parser.parse_args()
    launchers = ["shardsci", *options.methods.split(",")]
    wall: dict[str, list[float]] = {name: [] for name in launchers}
    failed = dict.fromkeys(launchers, 0)
    for repeat in range(options.repeats):
        for name in launchers if repeat % 2 == 0 else reversed(launchers):
            seconds, ok = _launch(name, options.ranks, options.join_timeout)
            if ok:
                wall[name].append(seconds)
            else:
                failed[name] += 1
    for name in launchers:
        times = wall[name] or [float("nan")]
        record = {
            "launcher": "shardsci fork" if name == "shardsci" else f"elastic_launch {name}",
            "ranks": options.ranks,
            "launches": options.repeats,
            "failed": failed[name],
            "wall_s_median": round(statistics.median(times), 2),
            "wall_s_min": round(min(times), 2),
            "wall_s_max": round(max(times), 2),
        }
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
