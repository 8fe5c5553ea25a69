"""The plain UNet step's CPU at a 128² and a 64² field (one process, alternated): the kernels
a 1-rank and a 2x2-block rank run, plus plain ops' host. Usage: python plain_tiles.py rounds"""

import json
import os
import statistics
import sys
import time

import torch

from benchmarks._common import on_ranks, rank_pools
from benchmarks.host_overhead import _OpCounter, training_step


def body(rounds):
    torch.set_num_threads(1)
    steps = {t: training_step("unet", False, t, 0) for t in (128, 64)}
    ops = {}
    for t, s in steps.items():
        s()
        with _OpCounter() as c:
            s()
        ops[t] = sum(c.ops.values())
    cpu = {t: [] for t in steps}
    for r in range(rounds):
        for t in steps if r % 2 == 0 else list(reversed(list(steps))):
            start = time.process_time()
            steps[t]()
            cpu[t].append(time.process_time() - start)
    return {t: {"ops": ops[t], "cpu_ms": sorted(round(c * 1e3, 1) for c in cpu[t])} for t in steps}


if __name__ == "__main__":
    load = os.getloadavg()
    with rank_pools():
        (res,) = on_ranks(1, body, int(sys.argv[1]))
    res = {str(k): v | {"median_ms": statistics.median(v["cpu_ms"])} for k, v in res.items()}
    print(json.dumps({"load_before": load, "load_after": os.getloadavg(), **res}))
