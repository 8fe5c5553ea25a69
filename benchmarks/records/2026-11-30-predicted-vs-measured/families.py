"""Probe: benchmarks.calibrate.measure_flop_free_families, ``argv[1]`` times (default 3),
one JSON line each (GB/s by family, the 64 MiB add's beside it) with the load."""

import json
import os
import sys
import time

import torch

from benchmarks.calibrate import _median_cpu_s, measure_flop_free_families

torch.set_num_threads(1)
a, b, c = (torch.ones(16 * 1024 * 1024) for _ in range(3))
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    rates = measure_flop_free_families(5)
    add = 3 * a.numel() * 4 / _median_cpu_s(lambda: torch.add(a, b, out=c), 5)
    line = {k.removeprefix("flop_free:"): round(v / 1e9, 2) for k, v in rates.items()}
    line |= {"add_64mib": round(add / 1e9, 2), "utc": time.strftime("%H:%M:%S", time.gmtime())}
    print(json.dumps(line | {"load": os.getloadavg()[0]}), flush=True)
