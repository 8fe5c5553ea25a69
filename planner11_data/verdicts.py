"""Verdict table of a calibrate_steps run: python planner11_data/verdicts.py cs.jsonl"""

import json
import sys

TOL = 0.25
rows = []
with open(sys.argv[1]) as f:
    for line in f:
        r = json.loads(line)
        if r["record"] == "plain":
            print(f"plain {r['model']}: compute ratio paired {r['compute_ratio_paired']} load {r['load_average']}")
        if r["record"] != "step":
            continue
        c = r["cpu"]
        verdict = "within" if c["within"] else ("explained" if c["ok"] else "MISS")
        only = r["cpu_ratio_compute_paired_only"]
        rows.append(verdict)
        print(
            f"| {r['model']} | {r['ranks']} | {c['ratio']} ({verdict}) | {only} "
            f"| {r['cpu_ratio_with_step_kernels']} | {r['cpu_ratio_at_calibration']} "
            f"| {r['collective_cpu_scale_paired']['median']} | {r['load_average']} |"
        )
print({v: rows.count(v) for v in ("within", "explained", "MISS")})
