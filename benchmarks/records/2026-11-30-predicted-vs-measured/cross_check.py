"""Each model's flop-free time inside its own plain step at 128² (planner21's
``../2026-11-30-flop-free-families/cross_models.jsonl``: every flop-free op's own thread CPU
time and bytes by family, 4 models x 4 rounds, 01:42-01:45 UTC) predicted at three prices,
over measured, median (range) of the rounds:
- ``loop``: the family rates of ``measure_flop_free_families`` (median of the runs of the
  ``families_*.jsonl`` given, kernels timed in a loop);
- ``in-step``: the Transolver's in-step family rates (``IN_STEP_FAMILY_RATES``, the preset
  until this record);
- ``one rate``: every flop-free byte at the round's own 64 MiB add.
Usage: python cross_check.py families_1.jsonl [families_2.jsonl ...]"""

import json
import statistics as st
import sys
from pathlib import Path

from benchmarks.calibrate_steps import IN_STEP_FAMILY_RATES

HERE = Path(__file__).parent
CROSS = HERE.parent / "2026-11-30-flop-free-families" / "cross_models.jsonl"


def spread(values: list[float]) -> str:
    return f"{st.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    probes = [
        json.loads(line) for path in sys.argv[1:] for line in Path(path).read_text().splitlines()
    ]
    loop = {f: st.median(p[f] for p in probes) * 1e9 for f in IN_STEP_FAMILY_RATES}
    print(
        "loop GB/s (median of",
        len(probes),
        "runs):",
        {f: round(r / 1e9, 2) for f, r in loop.items()},
    )
    rounds = [json.loads(line) for line in CROSS.read_text().splitlines()]
    print(
        "| model | flop-free MB | measured ms | loop | in-step (Transolver's) | one rate (64 MiB add) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for model in ("transolver", "fno", "unet", "vit"):
        rs = [r for r in rounds if r["model"] == model]

        def over(rates: dict, rs: list[dict] = rs) -> list[float]:
            return [
                sum(v["MB"] * 1e6 / rates[f] for f, v in r["families"].items())
                * 1e3
                / r["all_flop_free_ms"]
                for r in rs
            ]

        one = [r["all_flop_free_MB"] / r["add_64MiB_GB_per_s"] / r["all_flop_free_ms"] for r in rs]
        measured = [r["all_flop_free_ms"] for r in rs]
        print(
            f"| {model} | {rs[0]['all_flop_free_MB']:.0f} | {spread(measured)} | "
            f"{spread(over(loop))} | {spread(over(IN_STEP_FAMILY_RATES))} | {spread(one)} |"
        )


if __name__ == "__main__":
    main()
