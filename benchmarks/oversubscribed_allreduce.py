"""Gloo's all-reduce on 2, 4 and 8 ranks sharing this machine's cores, against the price
``parallel=auto`` puts on it (``gloo_cpu``): do more ranks than cores cost what the planner
says (issue 22, item 1)?

# NOTE [Ranks sharing cores]
A ring all-reduce on ``P`` ranks is ``2 (P - 1)`` steps, each waking the next rank's process;
with more ranks than cores, each wake-up may wait for a core. ``gloo_cpu(P)`` prices this by
the ranks' share of the cores (``cores / P``): it divides the host CPU time of issuing a call
(``host_us_per_collective``) and of each ring step (``host_us_per_collective_step``), and
the bandwidth, by that share, and a CPU step pays ``host + device``. This benchmark times
``dist.all_reduce`` (``benchmarks.calibrate.time_collectives``: batches of calls from a
barrier, the median batch, the slowest rank's wall and CPU seconds) at ``calibrate``'s sizes
on each world of ``--worlds``, and emits each point's price (``collective_s`` plus
``collective_host_s`` on ``gloo_cpu(P)``, this machine's cores) and their ratio, and the wall
seconds per ring step. Goal: the latency-bound calls (at most ``LATENCY_BOUND_BYTES`` per rank)
priced within ``GOAL_RATIO`` of their measured wall time on every world.

Run ``python -m benchmarks.oversubscribed_allreduce [--worlds 2 4 8] [--repeats 5]``; JSON
lines: ``point`` per world and size, ``summary``.
"""

from __future__ import annotations

import argparse

from benchmarks._common import Goal, emit, emit_summary, on_ranks, parse_arguments, rank_pools
from benchmarks.calibrate import SIZES, received_bytes, time_collectives
from shardsci.planning._machine import collective_host_s, collective_s, gloo_cpu, ring_steps

LATENCY_BOUND_BYTES = 16 * 1024
GOAL_RATIO = 1.25


def price_s(ranks: int, nbytes: int) -> float:
    """Seconds ``parallel=auto`` prices one all-reduce of ``nbytes`` per rank on ``ranks``
    ranks of this machine: device plus host (``host_overlaps_device`` is false on a CPU)."""
    machine = gloo_cpu(ranks)
    received = received_bytes("all_reduce", ranks, nbytes)
    device = collective_s(machine, "all_reduce", ranks, 1, received, 1)
    return device + collective_host_s(machine, "all_reduce", ranks, 1, received)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=5, help="timed batches per point")
    args = parse_arguments(parser, argv)
    worst: dict[int, float] = {}
    with rank_pools():
        for world in args.worlds:
            per_rank = on_ranks(world, time_collectives, "all_reduce", args.repeats)
            for measured in zip(*per_rank):
                wall = max(m["seconds"] for m in measured)
                cpu = max(m["cpu_seconds"] for m in measured)
                nbytes = measured[0]["bytes"]
                ratio = price_s(world, nbytes) / wall
                emit(
                    "point",
                    ranks=world,
                    bytes=nbytes,
                    wall_ms=round(wall * 1e3, 3),
                    cpu_ms=round(cpu * 1e3, 3),
                    wall_ms_per_ring_step=round(wall * 1e3 / ring_steps("all_reduce", world), 3),
                    priced_ms=round(price_s(world, nbytes) * 1e3, 3),
                    priced_over_measured=round(ratio, 3),
                )
                if nbytes <= LATENCY_BOUND_BYTES:
                    worst[world] = max(worst.get(world, 1.0), ratio, 1 / ratio)
    goals = [
        Goal(
            f"{world} ranks: latency-bound all-reduces priced within {GOAL_RATIO}x of measured",
            worst[world] <= GOAL_RATIO,
        )
        for world in args.worlds
    ]
    emit_summary(goals, args.check, worst_latency_bound_ratio=worst, sizes=list(SIZES))


if __name__ == "__main__":
    main()
