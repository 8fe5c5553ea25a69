"""Probe (issue 22): a zoo model's plain step at N² (default the Transolver; batch 1, one thread), the thread CPU time
and bytes of its ops without FLOPs by kernel family (pointwise, reduction/normalization, copy)
and by whether an input broadcasts (a tensor input with fewer elements than the output), each
round alternated with calibrate's contiguous add (64 MiB float32, 3 arrays' bytes) and the
same add at 10 MB (the step's typical size). Usage: PYTHONPATH=$PWD python families.py 128 5 [model]"""

import json
import os
import statistics
import sys
import time
from collections import Counter

import torch

from benchmarks.compile import CASES
from shardsci.planning._work import COPIES, counts_flops
from shardsci.tensor._torch_compat import TorchDispatchMode, tree_leaves

aten = torch.ops.aten
REDUCTIONS = {
    "sum",
    "mean",
    "amax",
    "amin",
    "max",
    "min",
    "var",
    "std",
    "var_mean",
    "norm",
    "native_layer_norm",
    "native_layer_norm_backward",
    "native_group_norm",
    "native_group_norm_backward",
    "_softmax",
    "_softmax_backward_data",
    "_log_softmax",
    "_log_softmax_backward_data",
    "logsumexp",
}
INDEXING = {
    "index",
    "index_select",
    "gather",
    "scatter",
    "scatter_add",
    "index_add",
    "index_put",
    "_unsafe_view",
    "slice_backward",
    "select_backward",
    "expand_backward",
}


def family(func, args, out) -> str:
    name = func._overloadpacket.__name__
    if func._overloadpacket in COPIES or name in INDEXING:
        return "copy"
    if name in REDUCTIONS:
        return "reduction"
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    n = max((t.numel() for t in outs), default=0)
    ins = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
    if any(t.numel() < n for t in ins):
        return "pointwise_broadcast"
    if any(not t.is_contiguous() for t in ins + outs):
        return "pointwise_strided"
    return "pointwise_contiguous"


class ByFamily(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seconds, self.bytes, self.calls = Counter(), Counter(), Counter()
        self.ops = Counter()
        self.nested = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.nested.append(0.0)
        start = time.thread_time()
        out = func(*args, **kwargs)
        inside, inner = time.thread_time() - start, self.nested.pop()
        if self.nested:
            self.nested[-1] += inside
        if counts_flops(func) or getattr(func, "is_view", False):
            return out
        fam = family(func, args, out)
        moved = sum(
            t.nbytes for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)
        )
        self.seconds[fam] += inside - inner
        self.bytes[fam] += moved
        self.calls[fam] += 1
        self.ops[(fam, func._overloadpacket.__name__)] += 1
        return out


def add_rate(numel: int, repeats: int) -> float:
    a, b, c = torch.randn(numel), torch.randn(numel), torch.empty(numel)
    torch.add(a, b, out=c)
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        torch.add(a, b, out=c)
        times.append(time.thread_time() - start)
    return 3 * numel * 4 / statistics.median(times) / 1e9


def main() -> None:
    torch.set_num_threads(1)
    size, rounds = int(sys.argv[1]), int(sys.argv[2])
    name = sys.argv[3] if len(sys.argv) > 3 else "transolver"
    torch.manual_seed(0)
    model, x = CASES[name].build(), torch.randn(1, 1, size, size)

    def step():
        out = model(x)
        (out * out).mean().backward()

    for _ in range(2):
        step()
    per_round = []
    for r in range(rounds):
        load = os.getloadavg()[0]
        big = add_rate(16 * 2**20, 5)
        small = add_rate(2_621_440 // 3 * 3 // 3, 20)  # 3 x 3.5 MB = 10.5 MB moved
        watch = ByFamily()
        with watch:
            step()
        fams = {
            k: {
                "ms": round(watch.seconds[k] * 1e3, 2),
                "MB": round(watch.bytes[k] / 1e6, 1),
                "calls": watch.calls[k],
                "GB_per_s": round(watch.bytes[k] / watch.seconds[k] / 1e9, 2),
            }
            for k in sorted(watch.seconds)
        }
        tot_b, tot_s = sum(watch.bytes.values()), sum(watch.seconds.values())
        per_round.append(
            {
                "model": name,
                "round": r,
                "load": round(load, 1),
                "add_64MiB_GB_per_s": round(big, 2),
                "add_10MB_GB_per_s": round(small, 2),
                "all_flop_free_GB_per_s": round(tot_b / tot_s / 1e9, 2),
                "all_flop_free_MB": round(tot_b / 1e6, 1),
                "all_flop_free_ms": round(tot_s * 1e3, 1),
                "families": fams,
            }
        )
        print(json.dumps(per_round[-1]), flush=True)
    ops = sorted(f"{f}:{n} x{c}" for (f, n), c in watch.ops.items())
    print(json.dumps({"ops_by_family_last_round": ops}), flush=True)


if __name__ == "__main__":
    main()
