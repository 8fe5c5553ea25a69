"""Probe: measured.json with the FNO's work recounted by this branch's WorkCounter (the
spectral contraction's FLOPs moved from ``flops`` to ``complex_matmul_flops``), written to
measured_complex.json; the traffic runs are kept (the change does not touch them)."""

import json
import sys

from benchmarks.cost_model import work

if __name__ == "__main__":
    source, target = sys.argv[1], sys.argv[2]
    with open(source) as f:
        measured = json.load(f)
    fno = measured["fno"]
    counted = [work("fno", s) for s in fno["flop_sizes"]]
    before = list(fno["flops"])
    fno["flops"], fno["fft_flops"], fno["complex_matmul_flops"], fno["memory_bytes"] = (
        list(column) for column in zip(*counted)
    )
    print(
        json.dumps(
            {
                "flops_before": before,
                **{k: fno[k] for k in ("flops", "complex_matmul_flops", "fft_flops")},
            }
        )
    )
    with open(target, "w") as f:
        json.dump(measured, f)
