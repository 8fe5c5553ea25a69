"""The cost model's bandwidth term held against a shaped link: two ranks, each in its own
network namespace (an emulated node), joined by a veth pair shaped with ``tc ... tbf``.

# NOTE [Emulated nodes]
Each rank runs in a network namespace of its own (``ip netns``), the two joined by a veth pair
whose both ends are shaped by a token bucket (``tc qdisc replace ... root tbf rate R``) or
left unshaped (``unshaped``: a veth, as fast as loopback); gloo binds the veth
(``GLOO_SOCKET_IFNAME``). For each model, the training step of ``benchmarks.cost_model``
(``sharded_step``: H split over 2 ranks of a ``(1, 1, N, N)`` field; a graph of ``--nodes``
in 2 METIS parts) is timed at every rate, the rates interleaved round by round (the link is
reshaped between rounds; the ranks keep running). Prediction: ``cost_model.step_s`` on the
calibrated machine (``benchmarks.calibrate --save``) with its link bandwidth set to each rate;
what is compared is how the step moves, ``T(rate) - T(unshaped)``, predicted against measured
(medians of wall time; the slowest rank; ``ratio`` null where the step did not slow down). Needs root (``ip netns``); the namespaces are removed
at the end, also on failure. Only 2 ranks: a third namespace adds nothing the model would not
cost the same way.

Run ``python -m benchmarks.calibrate_bandwidth --machine machine.json --measured
measured.json [--models unet fno] [--rates 1gbit 200mbit] [--rounds 3] [--steps 2]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks._common import Goal, emit, emit_summary, parse_arguments, spread
from benchmarks.calibrate_steps import layout, sharing
from benchmarks.cost_model import GEOMETRY, best_step, fitted_models, sharded_step
from shardsci.planning._machine import Machine

NAMESPACES = ("shardsci_node0", "shardsci_node1")
DEVICES = ("ssveth0", "ssveth1")
ADDRESSES = ("10.77.0.1", "10.77.0.2")
PORT = 29577
UNSHAPED = "unshaped"
TOLERANCE = 0.25
_UNITS = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}


def rate_bytes_per_s(rate: str) -> float:
    """``tc``'s ``1gbit``, ``200mbit`` or ``500kbit`` in bytes per second."""
    for unit, bits in _UNITS.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * bits / 8
    raise ValueError(f"rate {rate!r}: expected a number and one of {list(_UNITS)}, e.g. 1gbit")


def _run(*command: str, check: bool = True) -> None:
    subprocess.run(command, check=check, capture_output=True)


def create_nodes() -> None:
    """Two namespaces joined by a veth pair, addressed and up (any earlier ones removed)."""
    delete_nodes()
    for ns in NAMESPACES:
        _run("ip", "netns", "add", ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")
    _run(
        "ip",
        "link",
        "add",
        DEVICES[0],
        "netns",
        NAMESPACES[0],
        "type",
        "veth",
        "peer",
        "name",
        DEVICES[1],
        "netns",
        NAMESPACES[1],
    )
    for ns, device, address in zip(NAMESPACES, DEVICES, ADDRESSES):
        _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", device)
        _run("ip", "-n", ns, "link", "set", device, "up")


def delete_nodes() -> None:
    for ns in NAMESPACES:
        _run("ip", "netns", "delete", ns, check=False)


def shape_link(rate: str) -> None:
    """Both ends of the veth pair limited to ``rate`` (a token bucket), or unshaped."""
    for ns, device in zip(NAMESPACES, DEVICES):
        tc = ("ip", "netns", "exec", ns, "tc", "qdisc")
        if rate == UNSHAPED:
            _run(*tc, "del", "dev", device, "root", check=False)
        else:
            _run(
                *tc,
                "replace",
                "dev",
                device,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "256kb",
                "latency",
                "400ms",
            )


# --------------------------------------------------------------------------- a rank
def serve(rank: int, size: int, nodes: int) -> None:
    """Rank ``rank`` in its namespace: for every command line on stdin (``model``,
    ``steps``), one warm-up step and ``steps`` timed ones; their wall seconds as a JSON line."""
    os.environ |= {
        "MASTER_ADDR": ADDRESSES[0],
        "MASTER_PORT": str(PORT),
        "GLOO_SOCKET_IFNAME": DEVICES[rank],
    }
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=300))
    steps = {}
    for line in sys.stdin:
        command = json.loads(line)
        name = command["model"]
        if name not in steps:
            steps[name] = sharded_step(name, *layout(name, 2, size, nodes))[1]
        steps[name]()
        walls = []
        for _ in range(command["steps"]):
            dist.barrier()
            start = time.perf_counter()
            steps[name]()
            walls.append(time.perf_counter() - start)
        print(json.dumps(walls), flush=True)
    dist.destroy_process_group()


# --------------------------------------------------------------------------- the run
def measure(args: argparse.Namespace) -> dict[tuple[str, str], list[float]]:
    """(model, rate) -> every timed step's wall seconds (the slowest rank), the rates
    interleaved round by round, the order reversed every round."""
    rates = [UNSHAPED, *args.rates]
    samples: dict[tuple[str, str], list[float]] = {(m, r): [] for m in args.models for r in rates}
    command = [sys.executable, "-m", "benchmarks.calibrate_bandwidth", "--size", str(args.size)]
    command += ["--nodes", str(args.nodes), "--rank"]
    create_nodes()
    ranks: list[subprocess.Popen] = []
    try:
        for rank, ns in enumerate(NAMESPACES):
            ranks.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", ns, *command, str(rank)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for _ in range(args.rounds):
            for rate in rates:
                shape_link(rate)
                for name in args.models:
                    for process in ranks:
                        process.stdin.write(json.dumps({"model": name, "steps": args.steps}))
                        process.stdin.write("\n")
                        process.stdin.flush()
                    walls = [json.loads(process.stdout.readline()) for process in ranks]
                    samples[(name, rate)] += [max(s) for s in zip(*walls)]
            rates.reverse()
        for process in ranks:
            process.stdin.close()
            process.wait(timeout=60)
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
        delete_nodes()
    return samples


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["unet", "fno"], choices=list(GEOMETRY))
    parser.add_argument("--machine", help="the fitted Machine (benchmarks.calibrate --save)")
    parser.add_argument("--measured", help="the cost model's measurements (cost_model --save)")
    parser.add_argument("--rates", nargs="+", default=["1gbit", "200mbit"])
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--nodes", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = parse_arguments(parser, argv)
    if args.rank is not None:
        serve(args.rank, args.size, args.nodes)
        return
    if not (args.machine and args.measured):
        raise SystemExit("calibrate_bandwidth needs --machine FILE and --measured FILE")
    machine = sharing(
        Machine(**json.loads(Path(args.machine).read_text())["machine"]), 2, args.cores
    )
    saved = json.loads(Path(args.measured).read_text())
    samples = measure(args)
    goals, summary = [], {}
    for name in args.models:
        models, _ = fitted_models(name, saved[name])
        shape = layout(name, 2, args.size, args.nodes)[1]
        base = statistics.median(samples[(name, UNSHAPED)])
        predicted_base = best_step(machine, models, 2, shape)[1]["total"]
        for rate in args.rates:
            link = min(rate_bytes_per_s(rate), machine.nvlink_bytes_per_s)
            shaped = dataclasses.replace(machine, nvlink_bytes_per_s=link, ib_bytes_per_s=link)
            predicted = best_step(shaped, models, 2, shape)[1]["total"]
            measured = statistics.median(samples[(name, rate)])
            moved, predicted_moved = measured - base, predicted - predicted_base
            ratio = predicted_moved / moved if moved > 0 else None
            emit(
                "bandwidth",
                model=name,
                rate=rate,
                wall_s=spread(samples[(name, rate)]),
                unshaped_wall_s=spread(samples[(name, UNSHAPED)]),
                measured_added_ms=round(moved * 1e3, 1),
                predicted_added_ms=round(predicted_moved * 1e3, 1),
                ratio=None if ratio is None else round(ratio, 2),
                load_average=round(os.getloadavg()[0], 1),
            )
            summary[f"{name}_{rate}"] = {
                "measured_added_ms": round(moved * 1e3, 1),
                "predicted_added_ms": round(predicted_moved * 1e3, 1),
            }
            goals.append(
                Goal(
                    f"{name} at {rate}: predicted step time added within {TOLERANCE:.0%}",
                    ratio is not None and abs(ratio - 1) <= TOLERANCE,
                )
            )
    emit_summary(goals, args.check, **summary)


if __name__ == "__main__":
    main()
