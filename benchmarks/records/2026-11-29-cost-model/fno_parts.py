"""Probe (issue 22, item 4): a zoo model's plain training step at N² (batch 1, one thread), CPU
time by class of aten op: each op's thread CPU time less the ops nested in it, its FLOPs
(torch's flop counter; FFTs as ``WorkCounter`` counts them) and bytes (tensor arguments and
results of non-view ops); classes: ``fft``, ``complex_mm`` (matmuls with a complex operand),
``conv``, ``other_flops``, ``view``, and ``noflop:<op>`` for every op without FLOPs. Also the
unwatched step's CPU time and the watched step's time outside every op. Usage: python
benchmarks/records/2026-11-29-cost-model/fno_parts.py 128 fno"""

import json
import os
import statistics
import sys
import time
from collections import Counter

import torch
from torch.utils.flop_counter import flop_registry

from benchmarks.compile import CASES
from shardsci.planning._work import MATMULS, fft_flops
from shardsci.tensor._torch_compat import TorchDispatchMode, tree_leaves


def klass(func, args, flops: float, fft: float) -> str:
    name = func._overloadpacket.__name__
    complex_operand = any(isinstance(t, torch.Tensor) and t.is_complex() for t in args)
    if fft:
        return "fft"
    if flops and func._overloadpacket in MATMULS and complex_operand:
        return "complex_mm"
    if flops and "conv" in name:
        return "conv"
    if flops:
        return "other_flops"
    if getattr(func, "is_view", False):
        return "view"
    return "noflop:" + name


class ByClass(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seconds, self.flops, self.bytes, self.calls = (
            Counter(),
            Counter(),
            Counter(),
            Counter(),
        )
        self.nested = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.nested.append(0.0)
        start = time.thread_time()
        out = func(*args, **kwargs)
        inside, inner = time.thread_time() - start, self.nested.pop()
        if self.nested:
            self.nested[-1] += inside
        formula = flop_registry.get(func._overloadpacket)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula else 0
        fft = 0 if formula else fft_flops(func, args, out)
        name = klass(func, args, flops, fft)
        self.seconds[name] += inside - inner
        self.flops[name] += flops + fft
        self.calls[name] += 1
        if not getattr(func, "is_view", False):
            tensors = tree_leaves((args, kwargs, out))
            self.bytes[name] += sum(
                t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)
            )
        return out


def main() -> None:
    torch.set_num_threads(1)
    size, name, steps = int(sys.argv[1]), sys.argv[2], 3
    torch.manual_seed(0)
    model, x = CASES[name].build(), torch.randn(1, 1, size, size)

    def step():
        out = model(x)
        (out * out).mean().backward()

    for _ in range(2):
        step()
    plain = []
    for _ in range(5):
        start = time.process_time()
        step()
        plain.append(time.process_time() - start)
    watch = ByClass()
    start = time.thread_time()
    with watch:
        for _ in range(steps):
            step()
    thread = time.thread_time() - start
    classes = {
        k: {
            "ms": round(watch.seconds[k] / steps * 1e3, 2),
            "calls": watch.calls[k] // steps,
            "MFLOP": round(watch.flops[k] / steps / 1e6, 1),
            "MB": round(watch.bytes[k] / steps / 1e6, 1),
        }
        for k in sorted(watch.seconds, key=lambda k: -watch.seconds[k])
    }
    print(
        json.dumps(
            {
                "model": name,
                "N": size,
                "plain_cpu_ms": round(statistics.median(plain) * 1e3, 1),
                "watched_ms": round(thread / steps * 1e3, 1),
                "outside_ops_ms": round((thread - sum(watch.seconds.values())) / steps * 1e3, 1),
                "load": os.getloadavg()[0],
                "classes": classes,
            }
        )
    )


if __name__ == "__main__":
    main()
