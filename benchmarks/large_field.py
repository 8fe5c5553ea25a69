"""A training step on the largest field the machine holds: memory per rank at 4 ranks against
1 rank.

``UNet(width=32, depth=3, padding_mode="circular")``, batch 1, one step (forward, MSE loss,
backward) on an ``n x n`` field, once on 1 rank (plain tensors) and once on 4 ranks (H split
evenly, ``shardsci.parallel.domain_parallel``), one thread per rank, each in freshly started
rank processes.

Memory is the **peak resident set size** of each rank process (``ru_maxrss``) minus its RSS
when the rank body starts (the interpreter and torch, already imported), so it counts the
model, the field, the activations saved for backward, the gradients and the allocator's
retained blocks on this CPU; ``ideal`` is the 1-rank figure / 4. Bytes received are counted by
``shardsci.testing.count_traffic``. Goal: the two runs agree (the loss and every gradient's
norm, ``max_rel_difference`` at most ``AGREEMENT``).

Run ``python -m benchmarks.large_field [--size 1536] [--ranks 4] [--check]``. On a quiet 24 GiB
machine the default fits (about 9.5 GiB at 1 rank); 2048² needs about 17 GiB at 1 rank.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

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
from shardsci import Shard, ShardTensor, distribute_tensor
from shardsci.models import UNet
from shardsci.parallel import domain_parallel
from shardsci.testing import count_traffic, get_mesh

AGREEMENT = 1e-4  # float32: the loss and gradient norms, summed in another order


def step_memory(size: int) -> dict:
    """Rank body: one step; peak RSS over the body's start, wall and CPU seconds, the loss,
    every gradient's norm, and the step's bytes received by kind."""
    start_rss = rss_bytes()
    torch.manual_seed(0)
    model = UNet(width=32, depth=3, padding_mode="circular")
    x, y = torch.randn(1, 1, size, size), torch.randn(1, 1, size, size)
    world = dist.get_world_size()
    if world > 1:
        mesh = get_mesh((1, world), ("dp", "domain"))
        model = domain_parallel(model, mesh, dp_axis="dp", domain_axes=["domain"])
        rows = {0: (size // world,) * world}
        x, y = (distribute_tensor(t, mesh["domain"], [Shard(2)], rows) for t in (x, y))
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    with count_traffic() as traffic:
        loss = F.mse_loss(model(x), y)
        if isinstance(loss, ShardTensor):
            loss = loss.full_tensor()
        loss.backward()
    return {
        "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - start_rss,
        "wall_s": time.perf_counter() - wall,
        "cpu_s": time.process_time() - cpu,
        "loss": loss.item(),
        "grad_norms": [p.grad.norm().item() for p in model.parameters()],
        "received": dict(traffic.received_by_kind),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1536)
    parser.add_argument("--ranks", type=int, default=4)
    args = parse_arguments(parser, argv)
    runs = {}
    with rank_pools():
        for world in (1, args.ranks):
            restart_pools()  # fresh processes: ru_maxrss is a lifetime peak
            runs[world] = on_ranks(world, step_memory, args.size)
    one, many = runs[1][0], runs[args.ranks]
    values = [(one["loss"], r["loss"]) for r in many] + [
        (a, b) for r in many for a, b in zip(one["grad_norms"], r["grad_norms"])
    ]
    difference = max(abs(a - b) / max(abs(a), 1e-30) for a, b in values)
    ideal = one["peak_bytes"] / args.ranks
    for world, per_rank in runs.items():
        emit(
            "large_field",
            size=args.size,
            ranks=world,
            memory_measure="peak RSS minus RSS at start, per rank process",
            peak_bytes=[r["peak_bytes"] for r in per_rank],
            ideal_bytes=int(one["peak_bytes"] / world),
            ratio_to_ideal=round(
                max(r["peak_bytes"] for r in per_rank) * world / one["peak_bytes"], 3
            ),
            wall_s=round(max(r["wall_s"] for r in per_rank), 2),
            cpu_s=round(max(r["cpu_s"] for r in per_rank), 2),
            received_bytes=[r["received"] for r in per_rank],
        )
    agree = Goal(
        f"{args.ranks} ranks agree with 1 rank to {AGREEMENT:g} (loss, gradient norms)",
        difference <= AGREEMENT,
    )
    emit_summary(
        [agree],
        args.check,
        size=args.size,
        ranks=args.ranks,
        one_rank_peak_gib=round(one["peak_bytes"] / 2**30, 2),
        largest_rank_peak_gib=round(max(r["peak_bytes"] for r in many) / 2**30, 2),
        ratio_to_ideal=round(max(r["peak_bytes"] for r in many) / ideal, 3),
        max_rel_difference=difference,
    )


if __name__ == "__main__":
    main()
