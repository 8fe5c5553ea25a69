"""Each model's flop-free time in ``cross_models.jsonl`` predicted at the Transolver's in-step
family rates (median over its rounds in the same file), at the Transolver's in-step rate of all
its flop-free ops (one price), and at the paired 64 MiB add, over measured: median (range).
Usage: python cross_table.py cross_models.jsonl"""

import json
import statistics as st
import sys


def spread(values: list[float]) -> str:
    return f"{st.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    with open(sys.argv[1]) as lines:
        rounds = [json.loads(line) for line in lines]
    ts = [r for r in rounds if r["model"] == "transolver"]
    family_rate = {
        f: st.median(r["families"][f]["GB_per_s"] for r in ts) for f in ts[0]["families"]
    }
    one_rate = st.median(r["all_flop_free_GB_per_s"] for r in ts)
    print("transolver in-step GB/s", {f: round(v, 2) for f, v in family_rate.items()}, one_rate)
    for model in ("transolver", "fno", "unet", "vit"):
        rs = [r for r in rounds if r["model"] == model]
        by_family = [
            sum(v["MB"] / family_rate[f] for f, v in r["families"].items()) / r["all_flop_free_ms"]
            for r in rs
        ]
        one = [r["all_flop_free_MB"] / one_rate / r["all_flop_free_ms"] for r in rs]
        add = [r["all_flop_free_MB"] / r["add_64MiB_GB_per_s"] / r["all_flop_free_ms"] for r in rs]
        print(
            model,
            "MB",
            rs[0]["all_flop_free_MB"],
            "ms",
            spread([r["all_flop_free_ms"] for r in rs]),
            "GB/s",
            spread([r["all_flop_free_GB_per_s"] for r in rs]),
            "| by family",
            spread(by_family),
            "| one in-step price",
            spread(one),
            "| add",
            spread(add),
            "| load",
            min(r["load"] for r in rs),
            max(r["load"] for r in rs),
        )


if __name__ == "__main__":
    main()
