"""Why a ShardTensor call costs more inside a step than in a loop: one 1-rank UNet step
(host_overhead.training_step, 16² tile), ShardTensor and plain, alternated rounds; per round
and variant the process CPU of `steps` steps with GC on and with GC off, GC time by
gc.callbacks, forward-only CPU with and without grad, and cache misses in a warm step."""

import gc
import json
import os
import statistics
import sys
import time

import torch

import shardsci.tensor._caches as caches
from benchmarks._common import on_ranks, rank_pools
from benchmarks.host_overhead import training_step


def body(rounds, steps, tile):
    torch.set_num_threads(1)
    runs = {v: training_step("unet", v == "st", tile, 0) for v in ("st", "plain")}
    for s in runs.values():
        s()
        s()
    gc_time = {"t": 0.0, "n": [0, 0, 0], "start": None}

    def cb(phase, info):
        if phase == "start":
            gc_time["start"] = time.process_time()
        else:
            gc_time["t"] += time.process_time() - gc_time["start"]
            gc_time["n"][info["generation"]] += 1

    # cache misses in one warm step
    misses = {"n": 0, "gets": 0}
    orig = caches.BoundedCache.get

    def get(self, key):
        v = orig(self, key)
        misses["gets"] += 1
        misses["n"] += v is None
        return v

    caches.BoundedCache.get = get
    runs["st"]()
    caches.BoundedCache.get = orig
    out = {v: {"gc_on": [], "gc_off": [], "gc_s": [], "gc_n": []} for v in runs}
    for r in range(rounds):
        for v in runs if r % 2 == 0 else list(reversed(list(runs))):
            step = runs[v]
            gc.collect()
            gc_time.update(t=0.0, n=[0, 0, 0])
            gc.callbacks.append(cb)
            t = time.process_time()
            for _ in range(steps):
                step()
            out[v]["gc_on"].append((time.process_time() - t) / steps)
            gc.callbacks.remove(cb)
            out[v]["gc_s"].append(gc_time["t"] / steps)
            out[v]["gc_n"].append(list(gc_time["n"]))
            gc.collect()
            gc.disable()
            t = time.process_time()
            for _ in range(steps):
                step()
            out[v]["gc_off"].append((time.process_time() - t) / steps)
            gc.enable()
    return {"out": out, "misses": misses}


if __name__ == "__main__":
    rounds, steps, tile = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    load = os.getloadavg()[0]
    with rank_pools():
        (res,) = on_ranks(1, body, rounds, steps, tile)
    med = {
        v: {k: statistics.median(x) for k, x in d.items() if k in ("gc_on", "gc_off", "gc_s")}
        for v, d in res["out"].items()
    }
    print(
        json.dumps(
            {
                "load_before": load,
                "load_after": os.getloadavg()[0],
                "median": med,
                "misses": res["misses"],
                "raw": res["out"],
            }
        )
    )
