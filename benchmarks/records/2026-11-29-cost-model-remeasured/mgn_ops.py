"""The MeshGraphNet's aten ops a step on 2, 4, 8 and 16 METIS parts of 100 nodes, as
cost_model measures them for the H100 machine (NCCL's issue), the busiest rank's. Usage:
python mgn_ops.py"""

import json
import os

from benchmarks._common import on_ranks, rank_pools
from benchmarks.cost_model import measure

if __name__ == "__main__":
    out = {"load_before": os.getloadavg()}
    with rank_pools():
        for parts in (2, 4, 8, 16):
            per_rank = on_ranks(parts, measure, "meshgraphnet", (parts,), (100,), "auto", "nccl")
            busiest = max(per_rank, key=lambda r: r["ops"])
            out[parts] = {k: busiest[k] for k in ("ops", "communication_ops", "peers")}
    out["load_after"] = os.getloadavg()
    print(json.dumps(out))
