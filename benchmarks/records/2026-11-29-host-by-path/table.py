"""The table of benchmarks/README.md's "host time by dispatch path" section, from
``calibrate_dispatch`` records: each model's 1-rank ShardTensor premium (its step's CPU over the
plain step's) against two pricings, both calibrated on the UNet of the same run. ``flat``: the
machine's pricing today (every ShardTensor op at the UNet's CPU per op, the plain step's ops at
its plain rate); ``by path``: the step's ShardTensor calls by path at the run's per-path
figures; ``x scale``: those times the UNet's premium over its own priced calls. Each cell holds
one figure per record, in the order given. Run ``python table.py cd.jsonl cd2.jsonl ...``."""

import json
import sys
from pathlib import Path


def rows(path: str) -> dict[str, dict]:
    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    steps = {r["model"]: r for r in records if r["record"] in ("step", "dispatch_step")}
    unet = steps["unet"]
    st_us = unet["cpu_ms"]["shardtensor"]["median"] / unet["ops"]["shardtensor"]
    plain_us = unet["cpu_ms"]["torch"]["median"] / unet["ops"]["torch"]
    scale = unet["added_ms"] / unet["priced_ms"]
    figures = next(r for r in records if r["record"] == "summary")["added_us_per_call"]
    print(f"{path}: flat {st_us * 1e3:.1f} / {plain_us * 1e3:.1f} us, scale {scale:.2f}, {figures}")
    table = {}
    for name, r in steps.items():
        added = r["added_ms"]
        flat = r["ops"]["shardtensor"] * st_us - r["ops"]["torch"] * plain_us
        table[name] = {
            "premium": f"{added:.1f}",
            "flat": f"{flat / added:.2f}",
            "by path": f"{r['priced_over_added']:.2f}",
            "x scale": f"{r['priced_ms'] * scale / added:.2f}",
            "per plain op": f"{r['added_us_per_plain_op']:.0f}/{r['priced_us_per_plain_op']:.0f}",
        }
    return table


runs = [rows(path) for path in sys.argv[1:]]
columns = list(next(iter(runs[0].values())))
print("| model | " + " | ".join(columns) + " |")
print("| --- " * (len(columns) + 1) + "|")
for name in runs[0]:
    cells = [" / ".join(run[name][c] for run in runs) for c in columns]
    print(f"| {name} | " + " | ".join(cells) + " |")
