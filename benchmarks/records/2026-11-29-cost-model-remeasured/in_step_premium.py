"""Where a 4-rank UNet step's CPU goes (issue 22, planner18): cost_model's own step on 2x2
blocks of 64² (calibrate_steps' 4-rank UNet), against 1 rank on the whole 128² field.
Per rank and timed step: process CPU, the main thread's CPU (time.thread_time) and the rest
(gloo's worker threads and torch's), the main thread's CPU inside c10d ops (a dispatch mode,
in separate steps), aten ops (and those of communication modules), and count_traffic's calls
by span priced by collective_host_s on a saved calibration. Usage:
python in_step_premium.py machine.json steps rounds"""

import json
import os
import statistics
import sys
import time
from collections import Counter

import torch
import torch.distributed as dist

from benchmarks._common import on_ranks, rank_pools
from benchmarks.cost_model import sharded_step
from shardsci.planning._machine import Machine, collective_host_s
from shardsci.planning._work import WorkCounter
from shardsci.tensor import _halo
from shardsci.tensor._torch_compat import TorchDispatchMode
from shardsci.testing import count_traffic

HALO = {"cpu": 0.0, "depth": 0, "ops": 0, "c10d": 0.0}


def _timed(fn):
    """``fn`` with its main-thread CPU added to HALO (outermost calls only)."""

    def wrapper(*args, **kwargs):
        HALO["depth"] += 1
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            HALO["depth"] -= 1
            if HALO["depth"] == 0:
                HALO["cpu"] += time.thread_time() - start

    return wrapper


class C10dTimer(TorchDispatchMode):
    """Main-thread CPU and calls inside c10d / _c10d_functional ops (waits included)."""

    def __init__(self):
        super().__init__()
        self.cpu = Counter()
        self.calls = Counter()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        HALO["ops"] += HALO["depth"] > 0
        if func.namespace in ("c10d", "_c10d_functional"):
            t = time.thread_time()
            out = func(*args, **(kwargs or {}))
            name = func.__name__.split(".")[0]
            self.cpu[name] += time.thread_time() - t
            if HALO["depth"]:
                HALO["c10d"] += time.thread_time() - t
            self.calls[name] += 1
            return out
        return func(*args, **(kwargs or {}))


def body(mesh_shape, shape, steps, rounds):
    # before the step is built: a run plan may hold the functions it calls
    _halo.extended, _halo.added_to_owners = map(_timed, (_halo.extended, _halo.added_to_owners))
    _, step = sharded_step("unet", mesh_shape, shape)
    step()
    step()
    with count_traffic() as traffic:
        step()
    with WorkCounter() as work:
        step()
    out = {"process": [], "main": [], "wall": [], "c10d_main": [], "c10d_by": None}
    out["halo_main"] = []
    for _ in range(rounds):
        for _ in range(steps):
            dist.barrier()
            HALO["cpu"] = 0.0
            w, p, m = time.perf_counter(), time.process_time(), time.thread_time()
            step()
            out["halo_main"].append(HALO["cpu"])
            out["wall"].append(time.perf_counter() - w)
            out["process"].append(time.process_time() - p)
            out["main"].append(time.thread_time() - m)
        timer = C10dTimer()
        dist.barrier()
        with timer:
            step()
        out["c10d_main"].append(sum(timer.cpu.values()))
        out["c10d_by"] = {k: [timer.calls[k], round(v * 1e3, 2)] for k, v in timer.cpu.items()}
        out["ops_mode"] = timer.ops
    HALO.update(ops=0, c10d=0.0)
    with C10dTimer():
        step()
    out["halo_ops"], out["halo_c10d_ms"] = HALO["ops"], round(HALO["c10d"] * 1e3, 2)
    out["ops"] = work.ops if hasattr(work, "ops") else None
    out["communication_ops"] = getattr(work, "communication_ops", None)
    out["spans"] = [
        [s.kind, len(s.ranks), s.group, n, traffic.received_by_span[s]]
        for s, n in traffic.calls_by_span.items()
    ]
    return out


def priced(machine, spans):
    return sum(
        collective_host_s(machine, k, g if k == "all_to_all" else r, n, b)
        for k, r, g, n, b in spans
    )


if __name__ == "__main__":
    with open(sys.argv[1]) as saved:
        machine = Machine(**json.load(saved)["machine"])
    steps, rounds = int(sys.argv[2]), int(sys.argv[3])
    result = {"load_before": os.getloadavg()}
    with rank_pools():
        for label, mesh, shape in (("1", (1,), (128, 128)), ("4", (2, 2), (64, 64))):
            per_rank = on_ranks(
                len(mesh) and int(torch.tensor(mesh).prod()), body, mesh, shape, steps, rounds
            )
            result[label] = per_rank
    result["load_after"] = os.getloadavg()
    summary = {}
    for label in ("1", "4"):
        ranks = result[label]
        row = {}
        for key in ("process", "main", "wall", "c10d_main", "halo_main"):
            row[key + "_ms"] = [round(statistics.median(r[key]) * 1e3, 1) for r in ranks]
        row["other_threads_ms"] = [
            round(statistics.median(p - m for p, m in zip(r["process"], r["main"])) * 1e3, 1)
            for r in ranks
        ]
        row["ops"] = [r["ops"] for r in ranks]
        row["ops_mode"] = [r["ops_mode"] for r in ranks]
        row["communication_ops"] = [r["communication_ops"] for r in ranks]
        row["priced_collective_host_ms"] = [
            round(priced(machine, r["spans"]) * 1e3, 1) for r in ranks
        ]
        row["priced_ops_host_ms"] = [
            round(
                (
                    (r["ops"] - r["communication_ops"]) * machine.host_us_per_op
                    + r["communication_ops"] * machine.plain_host_us_per_op
                )
                * 1e-3,
                1,
            )
            if r["ops"] is not None
            else None
            for r in ranks
        ]
        row["halo_ops"] = [r["halo_ops"] for r in ranks]
        row["halo_c10d_ms"] = [r["halo_c10d_ms"] for r in ranks]
        row["c10d_by_rank0"] = ranks[0]["c10d_by"]
        row["spans_rank0"] = ranks[0]["spans"]
        summary[label] = row
    result["summary"] = summary
    print(json.dumps(result))
