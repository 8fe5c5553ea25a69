"""One rank of a SLURM launch check: run as ``srun python tests/slurm_job_check.py``.

Each srun task initialises the default process group from the SLURM environment, builds the
``4x2`` mesh named ``("dp", "domain")``, all-reduces its rank over its ``domain`` group and
over the world, and prints one JSON line: rank, world size, launcher, mesh coordinate, both
sums and whether each matched the row-major rank grid ``arange(8).view(4, 2)``. It exits with
status 1 if anything mismatched, so ``srun`` and the job fail too.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from shardsci.distributed import build_mesh, init_distributed

MESH_SPEC = "4x2"
AXIS_NAMES = ("dp", "domain")
DP_SIZE, DOMAIN_SIZE = 4, 2
TIMEOUT_S = 60.0


def expected_report(rank: int) -> dict[str, object]:
    """What rank ``rank`` must report on the row-major ``(DP_SIZE, DOMAIN_SIZE)`` grid.

    Parameters
    ----------
    rank
        Global rank, in ``[0, DP_SIZE * DOMAIN_SIZE)``.

    Returns
    -------
    dict[str, object]
        ``world_size``, ``launcher``, ``coordinate`` (``[dp, domain]``), ``domain_sum`` (sum
        of the ranks sharing this rank's ``dp`` coordinate) and ``world_sum``.
    """
    world_size = DP_SIZE * DOMAIN_SIZE
    dp = rank // DOMAIN_SIZE
    first = dp * DOMAIN_SIZE
    return {
        "world_size": world_size,
        "launcher": "slurm",
        "coordinate": [dp, rank % DOMAIN_SIZE],
        "domain_sum": sum(range(first, first + DOMAIN_SIZE)),
        "world_sum": world_size * (world_size - 1) // 2,
    }


def _summed_rank(rank: int, group: dist.ProcessGroup | None) -> int:
    """Sum of the ranks of ``group`` (the world when ``None``), by all-reduce."""
    value = torch.tensor([rank], dtype=torch.int64)
    dist.all_reduce(value, group=group)
    return int(value.item())


def main() -> int:
    """Run the check on this rank; the process exit status (0 when everything matched)."""
    torch.set_num_threads(1)
    env = init_distributed(timeout_s=TIMEOUT_S)
    mesh = build_mesh(MESH_SPEC, AXIS_NAMES)
    report: dict[str, object] = {
        "rank": env.rank,
        "world_size": env.world_size,
        "launcher": env.launcher,
        "coordinate": list(mesh.get_coordinate()),
        "domain_sum": _summed_rank(env.rank, mesh.get_group("domain")),
        "world_sum": _summed_rank(env.rank, None),
    }
    mismatches = sorted(
        key for key, value in expected_report(env.rank).items() if report[key] != value
    )
    report["mismatches"] = mismatches
    print(json.dumps(report), flush=True)
    dist.destroy_process_group()
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
