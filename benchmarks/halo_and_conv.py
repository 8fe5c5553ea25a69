"""Halos and convolutions on spatially sharded tensors: bytes, speed-up, memory, overlap.

Three parts, each in its own module, sharing one set of rank pools:

- ``halo_bytes``: bytes ``halo_exchange`` moves against the lower bound from the layout
  (slab and 2x2 block decompositions, uneven shards);
- ``conv_scaling``: a convolution's forward and backward on 1 rank against 2 ranks (one
  thread each), with and without ``overlap_halos()``;
- ``activation_memory``: bytes saved for backward per rank by a conv stack at 1, 2 and 4
  ranks against the ideal 1/N.

Run ``python -m benchmarks.halo_and_conv [part ...]`` (all parts by default). Each part
emits its records; a last ``summary`` record holds every part's summary fields and wall
time. The JSON fields are listed in README.md.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from benchmarks import activation_memory, conv_scaling, halo_bytes
from benchmarks._common import emit, rank_pools

PARTS: dict[str, Callable[[], dict[str, object]]] = {
    "halo_bytes": halo_bytes.run,
    "conv_scaling": conv_scaling.run,
    "activation_memory": activation_memory.run,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", metavar="part", help=f"any of {list(PARTS)}")
    names = parser.parse_args(argv).parts or list(PARTS)
    unknown = [name for name in names if name not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {unknown}; expected any of {list(PARTS)}")
    start = time.perf_counter()
    summary: dict[str, dict[str, object]] = {}
    with rank_pools():
        for name in names:
            part_start = time.perf_counter()
            summary[name] = PARTS[name]()
            summary[name]["wall_s"] = round(time.perf_counter() - part_start, 1)
    emit("summary", **summary, wall_s=round(time.perf_counter() - start, 1))


if __name__ == "__main__":
    main()
