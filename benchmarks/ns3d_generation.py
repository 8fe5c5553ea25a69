"""Generating one 3-D turbulence field: time and peak memory per rank, 1 rank against 8.

One ``(1, 3, N, N, N)`` float64 field of the cfd3d solver (``recipes/cfd3d``): the random
initial velocity drawn block by block, then ``--steps`` integrating-factor RK4 steps of the
band-forced flow, once in one process on plain tensors and once on 8 ranks, as a 2x2x2 block
(D, H, W each split evenly; ``--layout block``, the default) or as a slab (D split 8 ways;
``--layout slab``), through shardsci's distributed FFT, one thread per rank, each in freshly
started rank processes. The first step is timed on its own (it includes the sharding
plans made once per process), then the others.

Memory is the **peak resident set size** of each rank process (``ru_maxrss``) minus its RSS
when the rank body starts (torch already imported): the solver's state, its RK4 stages, the
multipliers, the transposes' buffers and the allocator's retained blocks. ``ideal`` is the
1-rank figure / 8. The two runs must agree: each field's energy and ⟨u_i³⟩ are compared
(``max_rel_difference``).

Run ``python -m benchmarks.ns3d_generation [--sizes 64 128] [--steps 3] [--layout slab]``;
goal (``--check``): the two runs agree at every size.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from benchmarks._common import (
    Goal,
    emit,
    emit_summary,
    on_ranks,
    parse_arguments,
    rank_pools,
    restart_pools,
    rss_bytes,
)
from shardsci import ShardTensorSpec
from shardsci.recipes.cfd3d.navier_stokes import NavierStokes3d, SolverConfig, random_velocity
from shardsci.testing import get_mesh

AGREEMENT = 1e-9  # relative; energy and <u_i^3> of the field after the steps
LAYOUTS = {
    "block": ((2, 2, 2), (Shard(2), Shard(3), Shard(4))),
    "slab": ((8,), (Shard(2),)),
}


def generate_field(n: int, steps: int, layout_name: str) -> dict:
    """Rank body: draw one field and integrate it; peak RSS over the body's start, times, and
    checksums of the result."""
    start_rss = rss_bytes()
    config = SolverConfig(resolution=n, dt=0.08 / n)  # the default CFL number at every n
    layout = None
    if dist.get_world_size() > 1:
        mesh_shape, placements = LAYOUTS[layout_name]
        mesh = get_mesh(mesh_shape)
        layout = ShardTensorSpec.build(mesh, placements, (1, 3, n, n, n), config.torch_dtype)
    solver = NavierStokes3d(config)
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    velocity = random_velocity(config, 1, torch.Generator().manual_seed(0), layout)
    velocity = solver.advance(velocity, 1)
    first_wall, first_cpu = time.perf_counter() - wall, time.process_time() - cpu
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    velocity = solver.advance(velocity, steps - 1)
    step_wall = (time.perf_counter() - wall) / (steps - 1)
    step_cpu = (time.process_time() - cpu) / (steps - 1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - start_rss
    energy = (velocity**2).mean(dim=(-3, -2, -1))
    skew = (velocity**3).mean(dim=(-3, -2, -1))
    checksums = [float(v) for v in torch.cat([energy.reshape(-1), skew.reshape(-1)])]
    return {
        "peak_bytes": peak,
        "field_bytes": 3 * n**3 * 8,
        "first_step_wall_s": first_wall,
        "first_step_cpu_s": first_cpu,
        "step_wall_s": step_wall,
        "step_cpu_s": step_cpu,
        "checksums": checksums,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layout", choices=list(LAYOUTS), default="block")
    args = parse_arguments(parser, argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is timed apart)")
    mesh_shape = LAYOUTS[args.layout][0]
    world = int(torch.tensor(mesh_shape).prod())
    goals, summaries = [], []
    with rank_pools():
        for n in args.sizes:
            runs = {}
            for ranks in (1, world):
                restart_pools()  # fresh processes: ru_maxrss is a lifetime peak
                runs[ranks] = on_ranks(ranks, generate_field, n, args.steps, args.layout)
            one = runs[1][0]
            difference = max(
                abs(a - b) / max(abs(a), 1e-30)
                for r in runs[world]
                for a, b in zip(one["checksums"], r["checksums"])
            )
            for ranks, per_rank in runs.items():
                peak = max(r["peak_bytes"] for r in per_rank)
                emit(
                    "ns3d_generation",
                    size=n,
                    ranks=ranks,
                    mesh="plain tensors" if ranks == 1 else "x".join(map(str, mesh_shape)),
                    memory_measure="peak RSS minus RSS at start, per rank process",
                    peak_bytes=[r["peak_bytes"] for r in per_rank],
                    peak_in_fields=round(peak / one["field_bytes"], 2),
                    ratio_to_ideal=round(peak * ranks / one["peak_bytes"], 3),
                    first_step_wall_s=round(max(r["first_step_wall_s"] for r in per_rank), 2),
                    step_wall_s=round(max(r["step_wall_s"] for r in per_rank), 3),
                    step_cpu_s=round(max(r["step_cpu_s"] for r in per_rank), 3),
                )
            largest = max(r["peak_bytes"] for r in runs[world])
            summaries.append(
                {
                    "size": n,
                    "one_rank_peak_mib": round(one["peak_bytes"] / 2**20, 1),
                    "largest_rank_peak_mib": round(largest / 2**20, 1),
                    "ratio_to_ideal": round(largest * world / one["peak_bytes"], 3),
                    "max_rel_difference": difference,
                }
            )
            goals.append(
                Goal(f"{n}³: {world} ranks agree with 1 to {AGREEMENT:g}", difference <= AGREEMENT)
            )
    emit_summary(
        goals,
        args.check,
        layout=args.layout,
        sizes=summaries,
    )


if __name__ == "__main__":
    main()
