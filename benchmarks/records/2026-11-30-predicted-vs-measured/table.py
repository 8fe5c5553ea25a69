"""The predicted-vs-measured table of ``cs_<model>.jsonl`` (``calibrate_steps`` records):
per model and rank count, predicted / measured CPU ms (judged: family rates paired), and the
same steps' ratio at one flop-free rate and at the in-step family rates; the plain step's
compute ratios and flop-free ms by family. Usage: python table.py cs_unet.jsonl ..."""

import json
import sys
from pathlib import Path

MODELS = ("unet", "fno", "vit", "transolver", "meshgraphnet")


def main() -> None:
    rows, plains = {}, {}
    for path in sys.argv[1:]:
        for line in Path(path).read_text().splitlines():
            record = json.loads(line)
            if record.get("record") == "plain":
                plains[record["model"]] = record
            elif record.get("record") == "step":
                rows[(record["model"], record["ranks"])] = record
    print(
        "| model | ranks | predicted / measured CPU ms | by family (judged) | one rate | "
        "in-step rates | with measured compute | with step kernels | load |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for model in MODELS:
        for ranks in (1, 2, 4):
            r = rows.get((model, ranks))
            if r is None:
                continue
            verdict = r["cpu"]
            mark = "within" if verdict["within"] else ("explained" if verdict["ok"] else "miss")
            print(
                f"| {model} | {ranks} | {r['predicted_ms']['cpu']:.0f} / "
                f"{r['measured_cpu_s']['median'] * 1e3:.0f} "
                f"({r['measured_cpu_s']['min'] * 1e3:.0f}-{r['measured_cpu_s']['max'] * 1e3:.0f}) | "
                f"**{verdict['ratio']:.2f}** {mark} | {r['cpu_ratio_one_flop_free_rate']:.2f} | "
                f"{r['cpu_ratio_in_step_family_rates']:.2f} | "
                f"{r['cpu_ratio_with_measured_compute']:.2f} | "
                f"{r['cpu_ratio_with_step_kernels']:.2f} | {r['load_average']} |"
            )
    print()
    print(
        "| model | plain compute ratio: by family / one rate / in-step | flop-free MB | "
        "flop-free ms: paired families / one rate / in-step |"
    )
    print("| --- | --- | --- | --- |")
    for model in MODELS:
        p = plains.get(model)
        if p is None:
            continue
        fam = p["flop_free_ms_by_family"]
        total = {
            k: sum(v[k] for v in fam.values())
            for k in ("mb", "ms_paired", "ms_one_rate", "ms_in_step")
        }
        print(
            f"| {model} | {p['compute_ratio_paired']:.2f} / "
            f"{p['compute_ratio_paired_one_flop_free_rate']:.2f} / "
            f"{p['compute_ratio_paired_in_step_family_rates']:.2f} | {total['mb']:.0f} | "
            f"{total['ms_paired']:.0f} / {total['ms_one_rate']:.0f} / {total['ms_in_step']:.0f} |"
        )


if __name__ == "__main__":
    main()
