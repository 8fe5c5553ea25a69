"""Forward against backward: a 1-rank UNet (16² tile), ShardTensor and plain, alternated
rounds; process CPU of the forward (grad on), the loss, and the backward, and the aten ops each
phase dispatches (host_overhead._OpCounter: ops on ShardTensors and the local ones alike)."""

import json
import os
import statistics
import sys
import time

import torch

from benchmarks._common import on_ranks, rank_pools
from benchmarks.compile import CASES
from benchmarks.host_overhead import _field, _OpCounter
from shardsci import ShardTensor
from shardsci.parallel import domain_parallel
from shardsci.testing import get_mesh


def _phases(model, args, counter=None):
    model.zero_grad(set_to_none=True)
    t0 = time.process_time()
    y = model(*args)
    t1 = time.process_time()
    loss = (y * y).mean()
    if isinstance(loss, ShardTensor):
        loss = loss.full_tensor()
    t2 = time.process_time()
    loss.backward()
    t3 = time.process_time()
    return t1 - t0, t2 - t1, t3 - t2


def body(rounds, tile):
    torch.set_num_threads(1)
    built = {}
    for v in ("st", "plain"):
        torch.manual_seed(0)
        model, mesh = CASES["unet"].build(), None
        if v == "st":
            full = get_mesh((1, 1), ("dp", "domain"))
            model = domain_parallel(model, full, dp_axis="dp", domain_axes=["domain"])
            mesh = full["domain"]
        built[v] = (model, _field(1, tile, v == "st", mesh))
        _phases(*built[v])
    ops = {}
    for v, (model, args) in built.items():
        model.zero_grad(set_to_none=True)
        with _OpCounter() as fwd:
            y = model(*args)
            loss = (y * y).mean()
            if isinstance(loss, ShardTensor):
                loss = loss.full_tensor()
        with _OpCounter() as bwd:
            loss.backward()
        ops[v] = {"forward": sum(fwd.ops.values()), "backward": sum(bwd.ops.values())}
    out = {f"{v}_{p}": [] for v in built for p in ("forward", "loss", "backward")}
    for r in range(rounds):
        for v in ("st", "plain") if r % 2 == 0 else ("plain", "st"):
            for p, s in zip(("forward", "loss", "backward"), _phases(*built[v])):
                out[f"{v}_{p}"].append(s)
    return {"cpu": out, "ops": ops}


if __name__ == "__main__":
    load = os.getloadavg()[0]
    with rank_pools():
        (res,) = on_ranks(1, body, int(sys.argv[1]), int(sys.argv[2]))
    med = {k: round(statistics.median(v) * 1e3, 2) for k, v in res["cpu"].items()}
    spread = {k: [round(min(v) * 1e3, 1), round(max(v) * 1e3, 1)] for k, v in res["cpu"].items()}
    print(
        json.dumps(
            {
                "load_before": load,
                "load_after": os.getloadavg()[0],
                "median_ms": med,
                "range_ms": spread,
                "ops": res["ops"],
            }
        )
    )
