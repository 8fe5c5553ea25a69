"""Probe (issue 22): per-family bandwidths from small kernels at the Transolver's 128² shapes
(calibrate-style: one thread, thread CPU time, median of repeats, bytes = tensor arguments and
results), alternated round by round with the watched plain Transolver step (families.py):
the step's flop-free time predicted at one price (calibrate's 64 MiB contiguous add) and at the
families' prices, against its measured time. Usage: PYTHONPATH=$PWD python paired.py 5"""

import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import families as fam

torch.manual_seed(0)
t64 = torch.randn(1, 64, 128, 128)  # channels-first field
cl64 = torch.randn(1, 128, 128, 64)
perm64 = t64.permute(0, 2, 3, 1)  # (1,128,128,64), non-contiguous
g128 = torch.randn(1, 128, 128, 128)
h5 = torch.randn(1, 128, 128, 4, 32)
d41 = torch.rand(4, 1) + 1
p16 = torch.randn(1, 4, 16, 128, 128).permute(0, 3, 4, 1, 2)  # (1,128,128,4,16) strided
s64 = torch.randn(16384, 64)
w, b = torch.ones(64), torch.zeros(64)

KERNELS = {
    "pointwise_contiguous": [
        lambda: (torch.add(cl64, cl64), (cl64, cl64, cl64)),
        lambda: (F.gelu(g128), (g128, g128)),
    ],
    "pointwise_broadcast": [lambda: (torch.div(h5, d41), (h5, d41, h5))],
    "pointwise_strided": [lambda: (torch.add(perm64, cl64), (perm64, cl64, cl64))],
    "reduction": [
        lambda: (F.layer_norm(perm64, (64,), w, b), (perm64, cl64, w, b)),
        lambda: (torch.softmax(h5, -1), (h5, h5)),
        lambda: (s64.sum(0), (s64,)),
    ],
    "copy": [lambda: (p16.clone(), (p16, p16))],
}


def rate(kernel, repeats=9) -> float:
    _, tensors = kernel()
    nbytes = sum(t.nbytes for t in tensors)
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        kernel()
        times.append(time.thread_time() - start)
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    torch.set_num_threads(1)
    rounds = int(sys.argv[1])
    model, x = fam.CASES["transolver"].build(), torch.randn(1, 1, 128, 128)

    def step():
        out = model(x)
        (out * out).mean().backward()

    for _ in range(2):
        step()
    for r in range(rounds):
        load = os.getloadavg()[0]
        add = fam.add_rate(16 * 2**20, 5)
        rates = {f: statistics.median(rate(k) for k in ks) for f, ks in KERNELS.items()}
        watch = fam.ByFamily()
        with watch:
            step()
        measured = sum(watch.seconds.values())
        one = sum(watch.bytes.values()) / (add * 1e9)
        by_family = sum(watch.bytes[f] / (rates[f] * 1e9) for f in watch.bytes)
        print(
            json.dumps(
                {
                    "round": r,
                    "load": round(load, 1),
                    "add_64MiB_GB_per_s": round(add, 2),
                    "family_GB_per_s": {f: round(v, 2) for f, v in rates.items()},
                    "step_family_GB_per_s": {
                        f: round(watch.bytes[f] / watch.seconds[f] / 1e9, 2)
                        for f in sorted(watch.bytes)
                    },
                    "step_family_MB": {
                        f: round(watch.bytes[f] / 1e6, 1) for f in sorted(watch.bytes)
                    },
                    "measured_ms": round(measured * 1e3, 1),
                    "one_price_ms": round(one * 1e3, 1),
                    "by_family_ms": round(by_family * 1e3, 1),
                    "ratio_one_price": round(one / measured, 3),
                    "ratio_by_family": round(by_family / measured, 3),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
