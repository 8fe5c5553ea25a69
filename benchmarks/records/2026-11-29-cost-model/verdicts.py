"""Verdict table of a calibrate_steps run: python benchmarks/records/2026-11-29-cost-model/verdicts.py cs.jsonl"""

import json
import sys

rows = []
print(
    "| model | ranks | measured CPU ms [q1-q3] | paired: compute + host (verdict) | compute only"
    " | at step kernels | at calibration | small-call CPU / price, median [min-max] | load |"
)
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
with open(sys.argv[1]) as f:
    for line in f:
        r = json.loads(line)
        if r["record"] != "step":
            continue
        c, m, s = r["cpu"], r["measured_cpu_s"], r["collective_cpu_scale_paired"]
        verdict = "within" if c["within"] else ("explained" if c["ok"] else "**miss**")
        rows.append(verdict)
        print(
            f"| {r['model']} | {r['ranks']} | {m['median'] * 1e3:.0f} [{m['q1'] * 1e3:.0f}-"
            f"{m['q3'] * 1e3:.0f}] | {c['ratio']} ({verdict}) | "
            f"{r['cpu_ratio_compute_paired_only']} | {r['cpu_ratio_with_step_kernels']} | "
            f"{r['cpu_ratio_at_calibration']} | {s['median']} [{s['min']}-{s['max']}] | "
            f"{r['load_average']} |"
        )
print({v: rows.count(v) for v in ("within", "explained", "**miss**")})
