"""Probe (issue 22 item 3, the in-step factor): does a step's working set, evicting the caches
between calls, make a ShardTensor call cost 2-4x its loop figure?

Hypothesis (falsifiable): ``calibrate_dispatch`` times each call back to back, its code and
data hot in L1/L2; in a step, the kernels between calls (MBs of activations) evict them, and
the call pays the misses. Test: the CPU a ShardTensor call adds over the plain call
(``calibrate_dispatch``'s ops and operands, one rank), each call timed alone
(``time.thread_time_ns``), back to back (``hot``) and with a sweep of ``SWEEP_MIB`` MiB
between calls (``swept``: reads and writes a buffer 4x this machine's 4 MiB L2, untimed).
The hypothesis predicts swept / hot well above 1 (toward the measured 2.3-2.7); near 1
falsifies it for the L1/L2 caches. ``argv[1]``: rounds (default 5), alternated; one JSON
line a round with the load, and a last line of medians. Controls: ``argv[2]`` the sweep's MiB (1: within L2), ``argv[3]`` ``read`` (a
sum: no dirty lines to write back) or ``write`` (default).
Run: PYTHONPATH=$PWD python benchmarks/records/2026-11-30-predicted-vs-measured/in_step_cache.py
5 [16 [write]]
"""

import json
import os
import statistics
import sys
import time

import torch

from benchmarks._common import on_ranks, rank_pools
from benchmarks.calibrate_dispatch import OPS, _operands

SWEEP_MIB = int(sys.argv[2]) if len(sys.argv) > 2 else 16
WRITE = (sys.argv[3] if len(sys.argv) > 3 else "write") == "write"
CALLS = 40
TIMED = ("add", "gelu", "mean_hw", "sum_c", "narrow_w", "conv2d", "group_norm", "layer_norm")


def per_call_us(op, x, weight, sweep: torch.Tensor | None) -> float:
    total = 0
    for _ in range(CALLS):
        if sweep is not None:
            sweep.add_(1.0) if WRITE else sweep.sum()
        start = time.thread_time_ns()
        op(x, weight)
        total += time.thread_time_ns() - start
    return total / CALLS / 1e3


def body(rounds: int) -> list[str]:
    """Rank body (1 rank): the rounds' JSON lines."""
    torch.set_num_threads(1)
    lines = []
    x, plain, weight = _operands()
    sweep = torch.zeros(SWEEP_MIB * 2**20 // 4)
    results: dict[str, dict[str, list[float]]] = {}
    for r in range(rounds):
        line = {"round": r, "load": os.getloadavg()[0]}
        for name in TIMED:
            op, _ = OPS[name]
            op(x, weight), op(plain, weight)
            added = {}
            modes = (("hot", None), ("swept", sweep))
            for mode, buffer in modes if r % 2 == 0 else modes[::-1]:
                shard = per_call_us(op, x, weight, buffer)
                local = per_call_us(op, plain, weight, buffer)
                added[mode] = shard - local
                results.setdefault(name, {}).setdefault(mode, []).append(shard - local)
                results[name].setdefault(f"{mode}_plain", []).append(local)
            line[name] = {k: round(v, 1) for k, v in added.items()}
        lines.append(json.dumps(line))
    medians = {
        name: {k: round(statistics.median(v), 1) for k, v in modes.items()}
        | {
            "swept_over_hot": round(
                statistics.median(modes["swept"]) / statistics.median(modes["hot"]), 2
            )
        }
        for name, modes in results.items()
    }
    stamp = {
        "utc": time.strftime("%H:%M:%S", time.gmtime()),
        "sweep_mib": SWEEP_MIB,
        "write": WRITE,
    }
    lines.append(json.dumps({"medians": medians} | stamp))
    return lines


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import in_step_cache  # the rank body by an importable name

    with rank_pools():
        (found,) = on_ranks(1, in_step_cache.body, int(sys.argv[1]) if len(sys.argv) > 1 else 5)
    print("\n".join(found))
