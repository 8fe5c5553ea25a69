"""Probe (issue 22, item 1): the busiest rank's aten ops, communication ops and traffic by
label (count_traffic, as cost_model.measure counts them) of one model's step on 1-D and 2-D
meshes. Usage: python benchmarks/records/2026-11-29-cost-model/ops_meshes.py unet 2 4 8 2x2 2x4 4x2 4x4"""

import json
import math
import sys

from benchmarks._common import on_ranks, rank_pools
from benchmarks.cost_model import measure

if __name__ == "__main__":
    name = sys.argv[1]
    shape = (400,) if name == "meshgraphnet" else (16, 16)
    with rank_pools():
        for text in sys.argv[2:]:
            mesh = tuple(int(x) for x in text.split("x"))
            per_rank = on_ranks(math.prod(mesh), measure, name, mesh, shape, "auto")
            busiest = max(per_rank, key=lambda r: r["ops"])
            print(json.dumps({"model": name, "mesh": mesh, "shape": shape, **busiest}), flush=True)
