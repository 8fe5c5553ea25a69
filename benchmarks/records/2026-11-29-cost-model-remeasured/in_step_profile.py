"""Where a 4-rank UNet step's main-thread CPU goes, by module (issue 22, planner18): one step
of cost_model's sharded_step under cProfile with a thread-CPU timer, on 1 rank (128²) and on
2x2 blocks of 64². Per rank: the profiled thread CPU in all, inside shardsci's communication
modules (_work.COMMUNICATION_MODULES, entered from outside them), and inside c10d ops called
from there. The profiler inflates Python calls, so the shares, not the milliseconds, are the
figure. Usage: python in_step_profile.py"""

import cProfile
import json
import os
import pstats
import time

from benchmarks._common import on_ranks, rank_pools
from benchmarks.cost_model import sharded_step
from shardsci.planning._work import COMMUNICATION_MODULES

PATHS = tuple("shardsci/tensor/" + m.rsplit(".", 1)[1] + ".py" for m in COMMUNICATION_MODULES)


def _in_comm(func):
    return func[0].endswith(PATHS)


def body(mesh_shape, shape, steps):
    _, step = sharded_step("unet", mesh_shape, shape)
    step()
    step()
    profile = cProfile.Profile(timer=time.thread_time)
    profile.enable()
    for _ in range(steps):
        step()
    profile.disable()
    stats = pstats.Stats(profile).stats
    total = sum(tt for _, _, tt, _, _ in stats.values())
    entered = 0.0
    by_entry = {}
    for func, (_, _, _, _, callers) in stats.items():
        if not _in_comm(func):
            continue
        for caller, (_, _, _, ct) in callers.items():
            if not _in_comm(caller):
                entered += ct
                key = f"{func[0].rsplit('/', 1)[1]}:{func[2]}"
                by_entry[key] = by_entry.get(key, 0.0) + ct
    c10d = sum(
        tt
        for func, (_, _, tt, _, _) in stats.items()
        if "c10d" in func[2] or "all_to_all" in func[2] or "all_reduce" in func[2]
    )
    top = sorted(by_entry.items(), key=lambda kv: -kv[1])[:8]
    return {
        "total_ms": total * 1e3 / steps,
        "communication_modules_ms": entered * 1e3 / steps,
        "c10d_builtin_tottime_ms": c10d * 1e3 / steps,
        "entries_ms": {k: round(v * 1e3 / steps, 2) for k, v in top},
    }


if __name__ == "__main__":
    out = {"load_before": os.getloadavg()}
    with rank_pools():
        out["1"] = on_ranks(1, body, (1,), (128, 128), 2)
        out["4"] = on_ranks(4, body, (2, 2), (64, 64), 2)
    out["load_after"] = os.getloadavg()
    print(json.dumps(out))
