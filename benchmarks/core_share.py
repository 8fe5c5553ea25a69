"""The share of this machine's cores that ranks get under other users' load: the same work
done in one stretch or in chunks separated by short collectives (issue 22, item 1: why dp=8
waits, NOTE [A rank's share of the cores]).

# NOTE [A rank's share of the cores]
Every rank of ``--world`` does the same ``--chunks x --per-chunk`` matmuls (``(128, 128)``,
one thread): ``solid`` in one stretch, as a data-parallel rank's forward and backward, or
``chatty`` with an all-reduce of one number inside its pair of ranks after every chunk, as a
domain-parallel rank's transposes. The modes alternate, their order reversed every round.
Per run: the slowest rank's wall seconds, all ranks' CPU seconds, and their ``share`` of the
cores (CPU over wall x cores). On a machine shared with other processes the kernel's
scheduler decides the share; a rank that sleeps often in short collectives is woken ahead of
processes that never sleep. ``train_step_parts`` saw dp=8's ranks receive 9-46 % of the two
cores against 32-72 % for dp=4 x slab H=2 in the same pairs of runs.

Run ``python -m benchmarks.core_share [--world 8] [--rounds 3] [--chunks 40] [--per-chunk
25]``; JSON lines: ``run`` per mode and round, ``summary`` (each mode's median wall and share).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks._common import emit, emit_summary, on_ranks, parse_arguments, rank_pools

MODES = ("solid", "chatty")


def work(mode: str, chunks: int, per_chunk: int) -> tuple[float, float]:
    """Rank body: wall and CPU seconds of ``mode``'s matmuls (NOTE above), from a barrier."""
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]
    x = torch.randn(128, 128)
    one = torch.ones(1)
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(chunks):
        for _ in range(per_chunk):
            x = torch.tanh(x @ x)
        if mode == "chatty":
            dist.all_reduce(one, group=pairs[rank // 2])
    cpu = time.process_time() - cpu
    return time.perf_counter() - wall, cpu


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=8, help="ranks (even)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=40)
    parser.add_argument("--per-chunk", type=int, default=25, help="matmuls per chunk")
    args = parse_arguments(parser, argv)
    if args.world % 2:
        parser.error("--world must be even (the chatty mode pairs the ranks)")
    cores = len(os.sched_getaffinity(0))
    walls: dict[str, list[float]] = {mode: [] for mode in MODES}
    shares: dict[str, list[float]] = {mode: [] for mode in MODES}
    order = list(MODES)
    with rank_pools():
        for round_index in range(args.rounds):
            for mode in order:
                per_rank = on_ranks(args.world, work, mode, args.chunks, args.per_chunk)
                wall = max(w for w, _ in per_rank)
                cpu = sum(c for _, c in per_rank)
                walls[mode].append(wall)
                shares[mode].append(cpu / (wall * cores))
                emit(
                    "run",
                    mode=mode,
                    round=round_index,
                    wall_s=round(wall, 3),
                    all_ranks_cpu_s=round(cpu, 3),
                    share=round(shares[mode][-1], 3),
                    load_average=round(os.getloadavg()[0], 1),
                )
            order.reverse()
    emit_summary(
        [],
        args.check,
        world=args.world,
        median_wall_s={m: round(statistics.median(walls[m]), 3) for m in MODES},
        median_share={m: round(statistics.median(shares[m]), 3) for m in MODES},
    )


if __name__ == "__main__":
    main()
