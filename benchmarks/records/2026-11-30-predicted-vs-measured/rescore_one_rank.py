"""calib3: the 1-rank predictions of ``cs_<model>.jsonl`` re-scored with the ops a 1-rank
step dispatches (NOTE [Ops per peer] in ``benchmarks/cost_model.py``), no new step run.

On one rank the prediction is host + compute; only the host term moves (the ops and their
dispatch paths; no collective is issued on one rank), and the µs per op are the
calibration's, not paired with the steps (NOTE [Host terms paired with the steps]). So each
ratio moves by (new host - old host) / measured: the judged (paired) ratio by that over the
median measured CPU, the calibration's and the measured-compute ratios exactly.

Usage (from the checkout, venv active): python rescore_one_rank.py measured.json cs_unet.jsonl
(``measured.json``: ``cost_model.measure_model``'s JSON by model, without the 1-rank run;
``ops_one_rank.json``'s run is added to it for the new prediction)."""

import json
import sys
from argparse import Namespace
from pathlib import Path

from benchmarks.calibrate_steps import _machine
from benchmarks.cost_model import fitted_models

HERE = Path(__file__).parent
MACHINE = HERE.parent / "2026-11-29-cost-model-remeasured" / "machine_1.json"


def main() -> None:
    measured_all = json.loads(Path(sys.argv[1]).read_text())
    one_rank = json.loads((HERE / "ops_one_rank.json").read_text())["runs"]
    machine = _machine(Namespace(machine=str(MACHINE)))
    steps = {}
    for path in sys.argv[2:]:
        for line in Path(path).read_text().splitlines():
            record = json.loads(line)
            if record.get("record") == "step" and record["ranks"] == 1:
                steps[record["model"]] = record
    print(
        "| model | ops (law / counted) | communication ops | host ms (law / counted) | "
        "predicted / measured CPU ms | judged | at calibration | with measured compute |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, measured in measured_all.items():
        record = steps.get(name)
        if record is None:
            continue
        runs = {x: [r for r in rs if r["ranks"] != 1] for x, rs in measured["runs"].items()}
        old_models, _ = fitted_models(name, {**measured, "runs": runs})
        new_models, _ = fitted_models(
            name, {**measured, "runs": {x: [*rs, one_rank[name]] for x, rs in runs.items()}}
        )
        shape = tuple(record["local_shape"])
        exchange = next(iter(old_models))  # one exchange on one rank: none is issued
        old, new = old_models[exchange], new_models[exchange]
        old_ops, old_comm = old._by_op_laws(old.ops, 1), old._by_op_laws(old.communication_ops, 1)
        host_old = record["predicted_ms"]["parts"]["host"]
        host_new = new.host_s(machine, 1, shape) * 1e3
        measured_ms = record["measured_cpu_s"]["median"] * 1e3
        shift = (host_new - host_old) / measured_ms
        cpu_new = record["predicted_ms"]["cpu"] + host_new - host_old
        print(
            f"| {name} | {old_ops:.0f} / {new.op_count(1)[0]:.0f} | {old_comm:.0f} / 0 | "
            f"{host_old:.1f} / {host_new:.1f} | {cpu_new:.0f} / {measured_ms:.0f} | "
            f"{record['cpu']['ratio']:.2f} -> **{record['cpu']['ratio'] + shift:.2f}** | "
            f"{record['cpu_ratio_at_calibration']:.2f} -> {cpu_new / measured_ms:.2f} | "
            f"{record['cpu_ratio_with_measured_compute']:.2f} -> "
            f"{record['cpu_ratio_with_measured_compute'] + shift:.2f} |"
        )


if __name__ == "__main__":
    main()
