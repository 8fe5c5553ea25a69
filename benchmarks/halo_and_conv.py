"""Halos and convolutions on spatially sharded tensors: bytes, speed-up, memory, overlap.

Three parts, each in its own module, sharing one set of rank pools:

- ``halo_bytes``: bytes ``halo_exchange`` moves against the lower bound from the layout
  (slab and 2x2 block decompositions, uneven shards);
- ``conv_scaling``: a convolution's forward and backward on 1 rank against 2 ranks (one
  thread each), with and without ``overlap_halos()``;
- ``activation_memory``: bytes saved for backward per rank by a conv stack at 1, 2 and 4
  ranks against the ideal 1/N.

Run ``python -m benchmarks.halo_and_conv [part ...] [--shrink N] [--rounds N] [--check]`` (all
parts by default; ``--shrink`` divides the spatial extents of ``conv_scaling`` and
``activation_memory``, ``--rounds`` sets ``conv_scaling``'s rounds). Each part emits its
records; a last ``summary`` record holds every part's summary fields and wall time, and every
part's goals. The JSON fields are listed in README.md.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from benchmarks import activation_memory, conv_scaling, halo_bytes
from benchmarks._common import Goal, emit_summary, parse_arguments, rank_pools

Part = Callable[[argparse.Namespace], tuple[dict[str, object], list[Goal]]]
PARTS: dict[str, Part] = {
    "halo_bytes": lambda args: halo_bytes.run(),
    "conv_scaling": lambda args: conv_scaling.run(args.shrink, args.rounds),
    "activation_memory": lambda args: activation_memory.run(args.shrink),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", metavar="part", help=f"any of {list(PARTS)}")
    parser.add_argument("--shrink", type=int, default=1, help="divide spatial extents by N")
    parser.add_argument("--rounds", type=int, default=None, help="conv_scaling's rounds")
    args = parse_arguments(parser, argv)
    names = args.parts or list(PARTS)
    unknown = [name for name in names if name not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {unknown}; expected any of {list(PARTS)}")
    summary: dict[str, dict[str, object]] = {}
    goals: list[Goal] = []
    with rank_pools():
        for name in names:
            part_start = time.perf_counter()
            summary[name], part_goals = PARTS[name](args)
            summary[name]["wall_s"] = round(time.perf_counter() - part_start, 1)
            goals += part_goals
    emit_summary(goals, args.check, **summary)


if __name__ == "__main__":
    main()
