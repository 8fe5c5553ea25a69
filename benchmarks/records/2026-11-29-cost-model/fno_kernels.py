"""Probe (issue 22, item 3): the FNO's kernels at its step's own shapes. On P ranks (the
128² field split over H, as calibrate_steps times it), one step of cost_model's sharded FNO is
recorded (every aten call on plain tensors: the local kernels), then each call of a family is
replayed alone on copies of its arguments (CPU time, median of 3) and its FLOPs counted as
WorkCounter counts them: FFTs (``_fft_*``), the spectral contraction (matmul-family calls on
complex tensors), the 1x1 convolutions, and every other FLOP-bearing call. Printed with the
rates calibrate's probe measures now on the same ranks (``measure_compute``): what the cost
model prices the step's FLOPs at. Usage: python benchmarks/records/2026-11-29-cost-model/fno_kernels.py 1 2 4"""

import json
import statistics
import sys
import time

import torch
from torch.utils.flop_counter import flop_registry

from benchmarks._common import on_ranks, rank_pools
from benchmarks.calibrate import COMPUTE, measure_compute
from benchmarks.cost_model import sharded_step
from shardsci import ShardTensor
from shardsci.planning._work import fft_flops
from shardsci.tensor._torch_compat import TorchDispatchMode, tree_leaves, tree_map


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if leaves and not any(isinstance(t, ShardTensor) for t in leaves):
            copy = tree_map(
                lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, (args, kwargs)
            )
            self.calls.append((func, copy, out))
        return out


def family(func, args) -> str | None:
    name = func._overloadpacket.__name__
    if name.startswith("_fft_"):
        return "fft"
    tensors = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
    if name in ("bmm", "mm", "matmul", "baddbmm", "addmm") and any(t.is_complex() for t in tensors):
        return "contraction"
    if "conv" in name:
        return "conv"
    return "other"


def flops_of(func, args, kwargs, out) -> float:
    formula = flop_registry.get(func._overloadpacket)
    if formula is not None:
        return float(formula(*args, **kwargs, out_val=out))
    return float(fft_flops(func, args, out))


def body(ranks: int, size: int) -> dict:
    torch.set_num_threads(1)
    mesh, shape = (ranks,), (size // ranks, size)
    _, step = sharded_step("fno", mesh, shape)
    step()
    recorder = _Recorder()
    with recorder:
        step()
    totals = {}
    for func, (args, kwargs), out in recorder.calls:
        fam = family(func, args)
        flops = flops_of(func, args, kwargs, out)
        if fam == "other" and flops == 0:
            continue
        samples = []
        for _ in range(3):
            start = time.process_time()
            func(*args, **kwargs)
            samples.append(time.process_time() - start)
        entry = totals.setdefault(fam, {"calls": 0, "flops": 0.0, "seconds": 0.0})
        entry["calls"] += 1
        entry["flops"] += flops
        entry["seconds"] += statistics.median(samples)
    rates = measure_compute(3)
    return {
        "families": totals,
        "probe_gflops": {
            "matmul_median": statistics.median(rates[n] for n in COMPUTE) / 1e9,
            "fft": rates["fft"] / 1e9,
        },
    }


if __name__ == "__main__":
    with rank_pools():
        for ranks in map(int, sys.argv[1:]):
            per_rank = on_ranks(ranks, body, ranks, 128)
            r = per_rank[0]
            fams = {
                k: {
                    **v,
                    "gflops": round(v["flops"] / v["seconds"] / 1e9, 2) if v["seconds"] else None,
                    "seconds": round(v["seconds"], 4),
                }
                for k, v in r["families"].items()
            }
            print(
                json.dumps(
                    {
                        "ranks": ranks,
                        "rank0": fams,
                        "probe_gflops": {k: round(v, 2) for k, v in r["probe_gflops"].items()},
                    }
                ),
                flush=True,
            )
