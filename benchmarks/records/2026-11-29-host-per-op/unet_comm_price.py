"""Probe (issue 22 item 2): the 4-rank UNet step of calibrate_steps, predicted with the
communication modules' ops at host_us_per_communication_op (after) and at
plain_host_us_per_op (before), paired on the same timed steps (NOTE [Compute rates paired
with the steps], [Host terms paired with the steps]). Usage: python
benchmarks/records/2026-11-29-host-per-op/unet_comm_price.py machine.json out_measured.json"""

import argparse
import dataclasses
import json
import os
import statistics
import sys
from functools import partial
from pathlib import Path

from benchmarks._common import emit, rank_pools
from benchmarks.calibrate_steps import layout, measure_steps, paired_ratios, predict, predicted_cpu
from benchmarks.cost_model import fitted_models, measure_model
from shardsci.planning._machine import Machine

if __name__ == "__main__":
    machine = Machine(**json.loads(Path(sys.argv[1]).read_text())["machine"])
    before = dataclasses.replace(machine, host_us_per_communication_op=machine.plain_host_us_per_op)
    args = argparse.Namespace(size=128, nodes=4096, ranks=[4], rounds=3, steps=2, cores=2)
    with rank_pools():
        load_start = os.getloadavg()[0]
        measured = measure_model("unet", "gloo")
        Path(sys.argv[2]).write_text(json.dumps({"unet": measured}))
        models, _ = fitted_models("unet", measured)
        steps = measure_steps("unet", args)
    mesh, shape = layout("unet", 4, 128, 4096)
    run = steps["4"]
    out = {}
    for label, m in (("after", machine), ("before", before)):
        predict_cpu = partial(predicted_cpu, models=models, ranks=4, shape=shape, cores=2)
        ratios = paired_ratios(predict_cpu, m, run["cpu"], run["rates"], run["small_calls"], 4)
        p = predict(m, models, 4, shape, 2)
        out[label] = {
            "host_us_per_communication_op": m.host_us_per_communication_op,
            "predicted_cpu_ms_at_calibration": round(p["cpu"] * 1e3, 1),
            "predicted_host_ms_at_calibration": round((p["cpu"] - p["cpu_compute"]) * 1e3, 1),
            "paired_cpu_ratio": round(statistics.median(ratios), 3),
            "paired_cpu_ratios": [round(r, 3) for r in ratios],
        }
    emit(
        "unet_4_comm_price",
        measured_cpu_ms=[round(c * 1e3, 1) for c in run["cpu"]],
        plain_cpu_ms=[round(c * 1e3, 1) for c in steps["plain"]["cpu"]],
        load_start=round(load_start, 1),
        load_end=round(os.getloadavg()[0], 1),
        **out,
    )
