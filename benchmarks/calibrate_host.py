"""The host's price of an aten op, measured alone and repeated: for a host the whole of
``benchmarks.calibrate`` is not run on (a GPU node's).

Each run is ``benchmarks.calibrate.measure_host``, what ``calibrate`` fits
``Machine.host_us_per_op`` and ``plain_host_us_per_op`` with: a UNet training step at a 16²
tile on 1 rank, the ShardTensor step and the plain one alternated, the CPU time
(``time.process_time``) of each over the aten ops it dispatches. At that tile the kernels cost
almost nothing, so the figures are the host's dispatch and Python. ``--runs`` runs, each on a
fresh rank; the median and spread of each figure. With ``--device cuda`` also the plain step
with the model and its field on the GPU, synchronised after each step (``plain_us_per_op_cuda``):
what launching an op costs a GPU host's CPU. A ShardTensor step on a GPU is not measured here.

The presets' figures (``GLOO_HOST_US_PER_OP`` and ``GLOO_PLAIN_HOST_US_PER_OP`` in
``shardsci/planning/_machine.py``, which the H100 preset assumes) come from ``calibrate`` runs
on this machine; this command gives another host's to set with ``--set host_us_per_op=...``.

Run ``python -m benchmarks.calibrate_host [--runs 5] [--repeats 7] [--device cuda]``; JSON
lines on stdout: one ``host_run`` per run, then the ``summary`` (each figure's spread, the
host's CPU model and the load).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from benchmarks._common import (
    emit,
    emit_summary,
    parse_arguments,
    rank_pools,
    restart_pools,
    spread,
)
from benchmarks.calibrate import measure_host
from benchmarks.compile import CASES
from benchmarks.host_overhead import _OpCounter

TILE = 16
"""H = W of the field: ``measure_host``'s tile."""


def plain_us_per_op_on(device: str, steps: int) -> float:
    """µs of CPU time per aten op of the plain UNet step at ``TILE`` on ``device``, each
    step synchronised: the median over ``steps`` steps after one warm-up."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = CASES["unet"].build().to(device)
    x = torch.randn(1, 1, TILE, TILE, device=device)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        out = model(x)
        (out * out).mean().backward()
        if device != "cpu":
            torch.cuda.synchronize(device)

    step()
    with _OpCounter() as counter:
        step()
    ops = sum(counter.ops.values())
    cpu = []
    for _ in range(steps):
        start = time.process_time()
        step()
        cpu.append(time.process_time() - start)
    return statistics.median(cpu) / ops * 1e6


def _cpu_model() -> str:
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds a run")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parse_arguments(parser, argv)
    figures: dict[str, list[float]] = {"host_us_per_op": [], "plain_host_us_per_op": []}
    with rank_pools():
        for run in range(args.runs):
            restart_pools()
            shardtensor, plain = measure_host(args.repeats)
            figures["host_us_per_op"].append(shardtensor)
            figures["plain_host_us_per_op"].append(plain)
            emit(
                "host_run",
                run=run,
                host_us_per_op=round(shardtensor, 2),
                plain_host_us_per_op=round(plain, 2),
                load_average=round(os.getloadavg()[0], 1),
            )
    if args.device == "cuda":
        figures["plain_us_per_op_cuda"] = [plain_us_per_op_on("cuda", 20) for _ in range(args.runs)]
    emit_summary(
        [],
        args.check,
        **{name: spread(values, 2) for name, values in figures.items()},
        cpu_model=_cpu_model(),
        torch=torch.__version__,
    )


if __name__ == "__main__":
    main()
