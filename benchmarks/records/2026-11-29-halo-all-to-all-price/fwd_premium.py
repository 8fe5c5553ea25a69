"""Autograd recording's share of the ShardTensor premium: a 1-rank UNet forward (16² tile),
ShardTensor and plain, with grad (inputs and parameters recorded) and under no_grad,
alternated rounds; process CPU per forward."""

import json
import os
import statistics
import sys
import time

import torch

from benchmarks._common import on_ranks, rank_pools
from benchmarks.compile import CASES
from benchmarks.host_overhead import _field
from shardsci.parallel import domain_parallel
from shardsci.testing import get_mesh


def body(rounds, reps, tile):
    torch.set_num_threads(1)
    forwards = {}
    for v in ("st", "plain"):
        torch.manual_seed(0)
        model = CASES["unet"].build()
        mesh = None
        if v == "st":
            full = get_mesh((1, 1), ("dp", "domain"))
            model = domain_parallel(model, full, dp_axis="dp", domain_axes=["domain"])
            mesh = full["domain"]
        forwards[v] = (model, _field(1, tile, v == "st", mesh))
    out = {f"{v}_{g}": [] for v in forwards for g in ("grad", "nograd")}
    for r in range(rounds):
        for v in ("st", "plain") if r % 2 == 0 else ("plain", "st"):
            model, args = forwards[v]
            for g in ("grad", "nograd") if r % 2 == 0 else ("nograd", "grad"):
                with torch.set_grad_enabled(g == "grad"):
                    model(*args)
                    t = time.process_time()
                    for _ in range(reps):
                        y = model(*args)
                    out[f"{v}_{g}"].append((time.process_time() - t) / reps)
                    del y
    return out


if __name__ == "__main__":
    load = os.getloadavg()[0]
    with rank_pools():
        (res,) = on_ranks(1, body, int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
    med = {k: round(statistics.median(v) * 1e3, 2) for k, v in res.items()}
    spread = {k: [round(min(v) * 1e3, 1), round(max(v) * 1e3, 1)] for k, v in res.items()}
    print(
        json.dumps(
            {
                "load_before": load,
                "load_after": os.getloadavg()[0],
                "median_ms": med,
                "range_ms": spread,
            }
        )
    )
