"""The cost model's ``Machine`` fitted to this machine: gloo over loopback, one thread per rank.

# NOTE [Calibrating the machine]
Every parameter of ``shardsci.planning._machine.Machine`` that a step on this machine depends
on is measured here by a microbenchmark and fitted through the same formulas the projection
uses (``halo_s``, ``all_to_all_s``, ``all_gather_s``, ``all_reduce_s``), so that a wrong
formula shows as a residual rather than being absorbed into a parameter:

- ``base_latency_s``, ``nvlink_step_latency_s`` (= ``net_step_latency_s``: one host, no
  network) and ``nvlink_bytes_per_s`` (= ``ib_bytes_per_s``): one weighted least-squares fit
  (relative residuals) over a point-to-point ping-pong on 2 ranks (half a round trip: one
  message) and ``all_to_all_single``, ``all_gather_into_tensor`` and ``all_reduce`` on 2 and
  4 ranks, each at several sizes (``SIZES``); every call's time is the slowest rank's, the
  median over ``repeats`` batches. Gloo has neither NCCL's LL protocol nor its tree:
  ``ll_bandwidth_fraction = simple_latency_factor = 1``, ``tree_base_latency_s =
  GLOO_NO_TREE_S`` (never chosen) and the all-reduces fitted as rings. Each point's
  fitted-over-measured ratio is emitted (``collective`` records), with the CPU time a call
  costs the slowest rank (``cpu_seconds``: c10d and gloo on the host).
- ``host_us_per_collective``, ``host_us_per_collective_step``, ``host_us_per_all_to_all``,
  ``host_us_per_all_to_all_peer`` and ``host_s_per_byte_received``: a second least-squares
  fit (absolute residuals, each non-negative), of every call's ``cpu_seconds`` as ``per call +
  per step x ring steps (ring_steps) + per byte x bytes received``, an all-to-all's as ``per
  all-to-all + per other rank of its group + per byte`` (NOTE [What an all-to-all posts]):
  what ``collective_host_s`` charges the host. Besides the whole all-to-alls above, the fit
  has halos sent as one all-to-all (``time_halo_all_to_alls``: a piece to each neighbour of a
  ring, none to the others) over groups of 2, 4 and 8 ranks: the per-peer term is a
  difference between groups of a few hundred µs, below one run's noise at this machine's
  load (a probe of 2026-11-29 read -0.11 to 0.39 ms a call at load 18-22). So each group is
  measured in ``HALO_ROUNDS`` rounds, the groups' order reversed every round, each round's
  figure the slowest rank's median over ``3 x repeats`` batches, and a point is the median
  of its rounds (``halo`` records give every round's figure and the load).
  A call's CPU time is taken between two short computations (``GAP_MATMULS``), as a step
  issues it: back to back, gloo's threads stay awake and a small call costs half as much.
  Until 2026-11-29 only the calls up to 16 KiB were fitted, without the bytes: gloo's copies
  of a step's megabytes (an FNO's transposes and gradients: 15 MB a rank on 2 ranks at 128²)
  cost the CPU and were not priced.
- ``sustained_flops``: a training step's FLOPs (``WorkCounter``, as the cost model and the dry
  run count them) over its seconds, for the convolutions and matmuls the zoo runs
  (``COMPUTE``), one thread, CPU time; the median over them (each rate is emitted).
- ``fft_flops_per_s``: the same for the FNO's spectral transforms (``rfft2`` and ``irfft2``
  of a ``(1, 32, 128, 128)`` field, forward and backward), FFT FLOPs as ``WorkCounter``
  counts them (NOTE [FFT FLOPs are counted apart]).
- ``memory_bytes_per_s``: ``torch.add(a, b, out=c)`` on arrays far beyond the caches, bytes as
  the cost model's memory traffic counts them (arguments and result).
- ``<family>_bytes_per_s`` of each family of kernels without FLOPs (NOTE [Kernels without
  FLOPs by family] in ``shardsci.planning._work``): ``measure_flop_free_families``, a few
  forward kernels of the family at the zoo's step shapes (``(16384, 64)`` tokens, a ``(1, 32,
  128, 128)`` field), bytes as ``WorkCounter`` counts a step's, over their CPU seconds in a
  loop, one thread. These rates predict the flop-free time measured inside the Transolver's,
  FNO's, UNet's and ViT's plain steps at 128² at 0.95 / 1.21 / 1.07 / 0.68 of measured, where
  the Transolver's own in-step rates gave 0.96 / 1.17 / 1.52 / 0.77 and the 64 MiB add alone
  0.33 / 0.55 / 0.91 / 0.35 (``benchmarks/records/2026-11-30-predicted-vs-measured``,
  ``cross_check.py``).
- ``host_us_per_op`` and ``plain_host_us_per_op``: ``benchmarks.host_overhead``'s measurement
  (a UNet step at a 16² tile on 1 rank; CPU time over the aten ops dispatched).
- ``host_us_per_communication_op``: a periodic halo exchange's forward and backward
  (``time_halo_exchange``: ``extend`` of a ``COMMUNICATION_SHARD`` shard and its adjoint) on 2
  ranks and on 2x2 (``COMMUNICATION_MESHES``), every op of it dispatched by the communication
  modules (``WorkCounter.communication_ops``); its CPU time between two computations, in
  ``HALO_ROUNDS`` alternated rounds as the halo all-to-alls, less what ``collective_host_s``
  charges its all-to-alls on the fitted machine (``count_traffic``'s calls) and its other ops
  at ``plain_host_us_per_op``, over its communication ops (``communication_op_us``); the
  median over the meshes (``halo_exchange`` records). A step's communication ops cost their
  modules' Python around each slice and copy (a 4-rank UNet step's profile: about 20 µs an
  op), which the plain ops' rate left out.
- ``strided_copy_s_per_run`` (NOTE [Strided copies]): the CPU time of copying a piece of a
  field narrowed along W less that of the same bytes narrowed along H, over the runs the first
  has more (``contiguous_runs``), for FNO-sized fields split 2, 4 and 8 ways (``STRIDED``);
  the median over them.

Four ranks on this machine's 2 cores share them: the fitted figures are per rank with a core
to itself (the collectives on 4 ranks are measured oversubscribed, so their latencies include
the waits for a core). ``host_overlaps_device`` is false: on a CPU the same core launches and
runs the kernels.

Run ``python -m benchmarks.calibrate [--repeats 7] [--save machine.json]``; JSON lines on
stdout (``parameters`` with ``sources``, ``collective``, ``compute`` records and the
``summary``), fields in README.md. ``benchmarks.calibrate_steps`` predicts step times with the
result.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks._common import (
    emit,
    emit_summary,
    on_ranks,
    parse_arguments,
    rank_pools,
)
from benchmarks.host_overhead import time_variants
from shardsci import Shard, ShardTensor
from shardsci.planning._machine import (
    Machine,
    collective_host_s,
    collective_s,
    dispatch_prices,
    gloo_cpu,
    ring_steps,
)
from shardsci.planning._work import FLOP_FREE_FAMILIES, WorkCounter, contiguous_runs
from shardsci.tensor._halo import Extension, extend, extension
from shardsci.tensor._torch_compat import TorchDispatchMode, tree_leaves, tree_map
from shardsci.testing import count_traffic, get_mesh

SIZES = (256, 16 * 1024, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024)  # bytes per rank's input
HALO_SIZES = (256, 16 * 1024, 64 * 1024)  # bytes of one face: a halo sends one per side
HALO_WORLDS = (2, 4, 8)
HALO_ROUNDS = 5
KINDS = ("p2p", "all_to_all", "all_gather", "all_reduce")
WORLDS = {"p2p": (2,), "all_to_all": (2, 4), "all_gather": (2, 4), "all_reduce": (2, 4)}
# Gloo's all-reduce is a ring: a tree latency no all-reduce here would choose.
GLOO_NO_TREE_S = 1.0
ONE_HOST = 64  # ranks per "node": every rank of these runs shares one


# --------------------------------------------------------------------------- collectives
def collective_rows(kind: str, ranks: int, nbytes: float) -> list[float]:
    """Coefficients of ``(base latency, step latency, seconds per byte)`` in the Machine's
    cost of one ``kind`` call on ``ranks`` ranks with ``nbytes`` per rank's input, LL and
    Simple alike and one node (NOTE [Calibrating the machine]): a message
    (``halo_s``), an all-to-all's ``P - 1`` pieces, an all-gather's and an all-reduce's
    ring."""
    return [1.0, float(ring_steps(kind, ranks)), received_bytes(kind, ranks, nbytes)]


def received_bytes(kind: str, ranks: int, nbytes: float) -> float:
    """Bytes the busiest rank receives in one ``kind`` call with ``nbytes`` per rank's input,
    as ``count_traffic`` counts them (an all-reduce at its ring's ``2 (P - 1) / P``)."""
    return {
        "p2p": nbytes,
        "all_to_all": nbytes * (ranks - 1) / ranks,
        "all_gather": nbytes * (ranks - 1),
        "all_reduce": nbytes * 2 * (ranks - 1) / ranks,
    }[kind]


def gloo_machine(
    base: Machine, base_latency_s: float, step_s: float, bytes_per_s: float
) -> Machine:
    """``base`` with the fitted collective parameters of a one-host gloo (no LL, no tree)."""
    return dataclasses.replace(
        base,
        base_latency_s=base_latency_s,
        tree_base_latency_s=GLOO_NO_TREE_S,
        nvlink_step_latency_s=step_s,
        net_step_latency_s=step_s,
        nvlink_bytes_per_s=bytes_per_s,
        ib_bytes_per_s=bytes_per_s,
        ll_bandwidth_fraction=1.0,
        simple_latency_factor=1.0,
        gpus_per_node=ONE_HOST,
    )


def nonnegative_fit(rows: list[list[float]], values: list[float], weights: list[float]) -> list:
    """``x >= 0`` of least squares ``rows @ x = values``, each residual times its weight: the
    first negative coefficient dropped (set to 0) and the rest refitted, until none is."""
    active = list(range(len(rows[0])))
    while True:
        a = torch.tensor([[r[i] * w for i in active] for r, w in zip(rows, weights)])
        b = torch.tensor([v * w for v, w in zip(values, weights)]).unsqueeze(1)
        solution = torch.linalg.lstsq(a.double(), b.double(), driver="gelsd").solution
        fitted = dict(zip(active, solution.squeeze(1).tolist()))
        negative = [i for i, v in fitted.items() if v < 0]
        if not negative or len(active) == 1:
            break
        active.remove(negative[0])
    return [max(fitted.get(i, 0.0), 0.0) for i in range(len(rows[0]))]


def fit_collectives(points: list[dict]) -> dict[str, float]:
    """``base_latency_s``, ``step_latency_s``, ``bytes_per_s`` fitted to ``points`` (``kind``,
    ``ranks``, ``bytes``, ``seconds``) by least squares on relative residuals, each parameter
    kept non-negative (one dropped to zero and the rest refitted if it came out negative)."""
    rows = [collective_rows(p["kind"], p["ranks"], p["bytes"]) for p in points]
    seconds = [p["seconds"] for p in points]
    base, step, per_byte = nonnegative_fit(rows, seconds, [1.0 / s for s in seconds])
    return {
        "base_latency_s": base,
        "step_latency_s": step,
        "bytes_per_s": 1.0 / per_byte if per_byte > 0 else float("inf"),
    }


def predicted_collective_s(machine: Machine, kind: str, ranks: int, nbytes: float) -> float:
    """One ``kind`` call with ``nbytes`` per rank's input, as the projection costs it
    (``collective_s``, from the bytes the busiest rank receives)."""
    return collective_s(machine, kind, ranks, 1, received_bytes(kind, ranks, nbytes), 1)


def _call_once(kind: str, x: torch.Tensor, out: torch.Tensor) -> None:
    """One ``kind`` call with input ``x`` into ``out`` (``p2p``: a round trip, rank 0 first)."""
    if kind == "p2p":
        peer = 1 - dist.get_rank()
        if peer == 1:
            dist.send(x, peer)
            dist.recv(out, peer)
        else:
            dist.recv(out, peer)
            dist.send(x, peer)
    elif kind == "all_to_all":
        dist.all_to_all_single(out, x)
    elif kind == "all_gather":
        dist.all_gather_into_tensor(out, x)
    else:
        dist.all_reduce(x)


GAP_MATMULS = 20
"""``(96, 96)`` matmuls between two calls whose CPU time is taken (about 0.4 ms): a step
computes between its collectives, so gloo's threads are woken for every call."""


def _gap(matrix: torch.Tensor) -> None:
    for _ in range(GAP_MATMULS):
        matrix @ matrix


def time_collectives(kind: str, repeats: int) -> list[dict]:
    """Rank body: seconds of one ``kind`` call at each of ``SIZES`` (median over ``repeats``
    batches of calls back to back, each batch started from a barrier; this rank's time), and
    the CPU seconds one costs the rank between two ``_gap`` computations, as a step issues it
    (the batch's CPU time less its gaps': 150 against 330 µs for a 256 B all-reduce on 2
    ranks, 300 against 680 for an all-gather, 2026-11-29 at load 29)."""
    torch.set_num_threads(1)
    world = dist.get_world_size()
    matrix = torch.randn(96, 96)
    gap_s = _median_cpu_s(lambda: _gap(matrix), repeats)
    results = []
    for nbytes in SIZES:
        x = torch.zeros(nbytes // 4)
        out = torch.empty(x.numel() * world) if kind == "all_gather" else torch.empty_like(x)
        calls = max(2, min(20, (1 << 20) // nbytes))
        _call_once(kind, x, out)
        samples = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                _call_once(kind, x, out)
            samples.append((time.perf_counter() - start) / calls)
        per_message = 2 if kind == "p2p" else 1
        cpu = _cpu_between_gaps_s(kind, x, out, calls, repeats, matrix, gap_s)
        results.append(
            {
                "kind": kind,
                "ranks": world,
                "bytes": nbytes,
                "received": received_bytes(kind, world, nbytes),
                "seconds": statistics.median(samples) / per_message,
                "cpu_seconds": cpu / per_message,
            }
        )
    return results


def _cpu_between_gaps_s(
    kind: str,
    x: torch.Tensor,
    out: torch.Tensor,
    calls: int,
    repeats: int,
    matrix: torch.Tensor,
    gap_s: float,
) -> float:
    """Median over ``repeats`` batches (each from a barrier) of the CPU seconds one ``kind``
    call costs this rank between two ``_gap`` computations (``gap_s`` each)."""
    cpu = []
    for _ in range(repeats):
        dist.barrier()
        start = time.process_time()
        for _ in range(calls):
            _gap(matrix)
            _call_once(kind, x, out)
        cpu.append((time.process_time() - start) / calls - gap_s)
    return statistics.median(cpu)


SMALL_CALLS = ("all_to_all", "all_gather", "all_reduce")
"""The kinds ``measure_small_calls`` probes, at ``SIZES[0]`` bytes a rank."""


def measure_small_calls(repeats: int) -> dict[str, float]:
    """Rank body: the CPU seconds one small call (``SIZES[0]`` bytes a rank) of each of
    ``SMALL_CALLS`` costs this rank between two computations, over all ranks, now (NOTE
    [Host terms paired with the steps] in ``benchmarks/calibrate_steps.py``)."""
    torch.set_num_threads(1)
    world = dist.get_world_size()
    matrix = torch.randn(96, 96)
    gap_s = _median_cpu_s(lambda: _gap(matrix), repeats)
    cpu = {}
    for kind in SMALL_CALLS:
        x = torch.zeros(SIZES[0] // 4)
        out = torch.empty(x.numel() * world) if kind == "all_gather" else torch.empty_like(x)
        _call_once(kind, x, out)
        cpu[kind] = _cpu_between_gaps_s(kind, x, out, 10, repeats, matrix, gap_s)
    return cpu


def small_call_scale(machine: Machine, cpu: dict[str, float], ranks: int) -> float:
    """What small calls cost now on ``ranks`` ranks (``cpu``, from ``measure_small_calls``)
    over what ``collective_host_s`` prices them at on ``machine``: the median over the kinds."""
    return statistics.median(
        seconds / collective_host_s(machine, kind, ranks, 1, received_bytes(kind, ranks, SIZES[0]))
        for kind, seconds in cpu.items()
    )


def at_small_calls(machine: Machine, cpu: dict[str, float], ranks: int) -> Machine:
    """``machine`` with its collective CPU terms (per call, per ring step, per byte) scaled by
    ``small_call_scale``."""
    return scaled_collective_host(machine, small_call_scale(machine, cpu, ranks))


COLLECTIVE_HOST_FIELDS = (
    "host_us_per_collective",
    "host_us_per_collective_step",
    "host_us_per_all_to_all",
    "host_us_per_all_to_all_peer",
    "host_s_per_byte_received",
)
"""The ``Machine`` fields ``collective_host_s`` prices with."""


def scaled_collective_host(machine: Machine, scale: float) -> Machine:
    """``machine`` with every collective CPU term (``COLLECTIVE_HOST_FIELDS``) times
    ``scale``."""
    return dataclasses.replace(
        machine, **{name: getattr(machine, name) * scale for name in COLLECTIVE_HOST_FIELDS}
    )


def neighbour_splits(world: int, rank: int, rows: int) -> list[int]:
    """Rows of an all-to-all's piece for each rank of a ring of ``world``: ``rows`` for each
    neighbour (both faces to the one other rank of a ring of 2), none for the others: a
    periodic halo sent as one all-to-all (NOTE [What an all-to-all posts])."""
    splits = [0] * world
    for side in (-1, 1):
        splits[(rank + side) % world] += rows
    splits[rank] = 0
    return splits


def time_halo_all_to_alls(repeats: int) -> list[dict]:
    """Rank body: the CPU seconds one halo all-to-all (``neighbour_splits``, a face of each
    of ``HALO_SIZES`` bytes) costs this rank between two ``_gap`` computations (median over
    ``3 x repeats`` batches of 10)."""
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    matrix = torch.randn(96, 96)
    gap_s = _median_cpu_s(lambda: _gap(matrix), repeats)
    results = []
    for nbytes in HALO_SIZES:
        splits = neighbour_splits(world, rank, nbytes // 4)
        x, out = torch.zeros(sum(splits)), torch.empty(sum(splits))
        dist.all_to_all_single(out, x, splits, splits)
        cpu = []
        for _ in range(3 * repeats):
            dist.barrier()
            start = time.process_time()
            for _ in range(10):
                _gap(matrix)
                dist.all_to_all_single(out, x, splits, splits)
            cpu.append((time.process_time() - start) / 10 - gap_s)
        received = 4 * sum(splits) - 4 * splits[rank]
        results.append(
            {
                "kind": "all_to_all",
                "pieces": "neighbours",
                "ranks": world,
                "bytes": nbytes,
                "received": received,
                "cpu_seconds": statistics.median(cpu),
            }
        )
    return results


def measure_halo_all_to_alls(repeats: int) -> list[dict]:
    """``time_halo_all_to_alls`` on every group of ``HALO_WORLDS`` in ``HALO_ROUNDS``
    rounds, the order reversed every round: a point per group and size, its ``cpu_seconds``
    the median of its rounds' slowest ranks (``rounds``: each round's, ``loads``: the
    1-minute load average at each round's start)."""
    rounds: dict[tuple[int, int], list[float]] = {}
    first: dict[tuple[int, int], dict] = {}
    loads = []
    for r in range(HALO_ROUNDS):
        loads.append(os.getloadavg()[0])
        for world in HALO_WORLDS if r % 2 == 0 else tuple(reversed(HALO_WORLDS)):
            per_rank = on_ranks(world, time_halo_all_to_alls, repeats)
            for measured in zip(*per_rank):
                key = (world, measured[0]["bytes"])
                first.setdefault(key, measured[0])
                rounds.setdefault(key, []).append(max(m["cpu_seconds"] for m in measured))
    return [
        {
            **first[key],
            "cpu_seconds": statistics.median(values),
            "rounds": values,
            "loads": loads,
        }
        for key, values in sorted(rounds.items())
    ]


def measure_collectives(repeats: int) -> list[dict]:
    """Every kind on every world of ``WORLDS``; a point's time is the slowest rank's."""
    points = []
    for kind in KINDS:
        for world in WORLDS[kind]:
            per_rank = on_ranks(world, time_collectives, kind, repeats)
            for measured in zip(*per_rank):
                slowest = {k: max(m[k] for m in measured) for k in ("seconds", "cpu_seconds")}
                points.append({**measured[0], **slowest})
    return points


def host_row(point: dict) -> list[float]:
    """Coefficients of ``COLLECTIVE_HOST_FIELDS`` (µs, µs, µs, µs, s a byte) in the CPU
    seconds ``collective_host_s`` charges for one call of ``point`` (``kind``, ``ranks``: its
    group, ``received``)."""
    ranks, received = float(point["ranks"]), float(point["received"])
    if point["kind"] == "all_to_all":
        return [0.0, 0.0, 1e-6, 1e-6 * (ranks - 1), received]
    return [1e-6, 1e-6 * ring_steps(point["kind"], point["ranks"]), 0.0, 0.0, received]


def fit_collective_host(points: list[dict]) -> dict[str, float]:
    """``COLLECTIVE_HOST_FIELDS`` fitted to every call's CPU time (``cpu_seconds``) as
    ``collective_host_s`` prices it (``host_row``), least squares on absolute residuals (a
    step adds its calls' CPU seconds: the costly calls matter, not a 40 µs message's 10 %),
    each coefficient kept non-negative (``nonnegative_fit``)."""
    rows = [host_row(p) for p in points]
    cpu = [p["cpu_seconds"] for p in points]
    # Columns scaled to order 1 for the solver; the coefficients scaled back.
    scales = [max(abs(r[i]) for r in rows) or 1.0 for i in range(len(rows[0]))]
    fitted = nonnegative_fit(
        [[x / c for x, c in zip(r, scales)] for r in rows], cpu, [1.0] * len(cpu)
    )
    return dict(zip(COLLECTIVE_HOST_FIELDS, (f / c for f, c in zip(fitted, scales))))


# --------------------------------------------------------------------------- communication ops
COMMUNICATION_MESHES = ((2,), (2, 2))
"""Meshes ``measure_communication_ops`` exchanges halos on: 2 ranks splitting H, and 2x2
blocks (the UNet's 4 ranks in ``benchmarks.calibrate_steps``)."""
COMMUNICATION_SHARD = (1, 16, 32, 32)
"""A rank's shard ``(B, C, H, W)`` of the exchanged field: a UNet level of width 16 at a 32²
tile."""


def _halo_extension(x: ShardTensor, dims: tuple[int, ...]) -> Extension:
    """The extension a circular 3x3 convolution of ``x`` asks for: one cell each side of every
    split dim of ``dims``, periodic (as ``halo_exchange`` plans it)."""
    requests = []
    for dim in dims:
        sizes = x._spec.sharding_by_dim[dim].sizes
        offsets = [sum(sizes[:k]) for k in range(len(sizes))]
        requests.append(
            (dim, tuple((o - 1, o + n + 1) for o, n in zip(offsets, sizes)), "periodic")
        )
    return extension(x._spec, tuple(requests))


def time_halo_exchange(mesh_shape: tuple[int, ...], repeats: int) -> dict:
    """Rank body: one halo exchange of a ``COMMUNICATION_SHARD`` shard split over
    ``mesh_shape`` (H, then W), forward and backward (``extend``, ``torch.autograd.grad``),
    the CPU seconds a call costs this rank between two ``_gap`` computations (median over
    ``3 x repeats`` batches of 10), its aten ops (``ops``; ``communication_ops``: those the
    communication modules dispatch, ``WorkCounter``) and its collectives (``calls``: kind,
    ranks posted to, calls and bytes received, by ``count_traffic``)."""
    torch.set_num_threads(1)
    mesh = get_mesh(mesh_shape)
    dims = (2, 3)[: len(mesh_shape)]
    local = torch.randn(COMMUNICATION_SHARD)
    sizes = {
        axis: (COMMUNICATION_SHARD[dim],) * n for axis, (dim, n) in enumerate(zip(dims, mesh_shape))
    }
    x = ShardTensor.from_local(local, mesh, [Shard(d) for d in dims], sizes)
    ext = _halo_extension(x, dims)
    leaf = local.clone().requires_grad_()
    grad = torch.randn(ext.buffer_shape(local.shape))

    def exchange() -> None:
        torch.autograd.grad(extend(leaf, ext), leaf, grad)

    exchange()
    with WorkCounter() as work, count_traffic() as traffic:
        exchange()
    matrix = torch.randn(96, 96)
    gap_s = _median_cpu_s(lambda: _gap(matrix), repeats)
    cpu = []
    for _ in range(3 * repeats):
        dist.barrier()
        start = time.process_time()
        for _ in range(10):
            _gap(matrix)
            exchange()
        cpu.append((time.process_time() - start) / 10 - gap_s)
    calls = [
        {
            "kind": span.kind,
            "posted": span.group if span.kind == "all_to_all" else len(span.ranks),
            "calls": n,
            "received": traffic.received_by_span[span],
        }
        for span, n in traffic.calls_by_span.items()
    ]
    return {
        "mesh": list(mesh_shape),
        "ops": work.ops,
        "communication_ops": work.communication_ops,
        "calls": calls,
        "cpu_seconds": statistics.median(cpu),
    }


def measure_communication_ops(repeats: int) -> list[dict]:
    """``time_halo_exchange`` on each of ``COMMUNICATION_MESHES`` in ``HALO_ROUNDS`` rounds,
    the order reversed every round: per mesh the slowest rank's, its ``cpu_seconds`` the
    median of its rounds' (``rounds``: each round's; ``loads``: the 1-minute load average at
    each round's start)."""
    rounds: dict[tuple[int, ...], list[float]] = {}
    first: dict[tuple[int, ...], dict] = {}
    loads = []
    for r in range(HALO_ROUNDS):
        loads.append(os.getloadavg()[0])
        meshes = COMMUNICATION_MESHES if r % 2 == 0 else tuple(reversed(COMMUNICATION_MESHES))
        for mesh_shape in meshes:
            per_rank = on_ranks(math.prod(mesh_shape), time_halo_exchange, mesh_shape, repeats)
            slowest = max(per_rank, key=lambda m: m["cpu_seconds"])
            first.setdefault(mesh_shape, slowest)
            rounds.setdefault(mesh_shape, []).append(slowest["cpu_seconds"])
    return [
        {**first[m], "cpu_seconds": statistics.median(v), "rounds": v, "loads": loads}
        for m, v in rounds.items()
    ]


def communication_op_us(machine: Machine, exchange: dict) -> float:
    """µs of CPU per communication op of one measured halo exchange (``time_halo_exchange``):
    its CPU time less its collectives' as ``collective_host_s`` prices them on ``machine``
    (the fitted collective terms) and its other ops at ``plain_host_us_per_op``, over its
    communication ops."""
    issued = sum(
        collective_host_s(machine, c["kind"], c["posted"], c["calls"], c["received"])
        for c in exchange["calls"]
    )
    others = (exchange["ops"] - exchange["communication_ops"]) * machine.plain_host_us_per_op
    return (exchange["cpu_seconds"] * 1e6 - issued * 1e6 - others) / exchange["communication_ops"]


# --------------------------------------------------------------------------- compute
def _conv(channels: int, size: int) -> Callable[[], None]:
    conv = torch.nn.Conv2d(channels, channels, 3, padding=1)
    x = torch.randn(1, channels, size, size, requires_grad=True)
    return lambda: conv(x).sum().backward()


def _matmul(tokens: int, width: int) -> Callable[[], None]:
    linear = torch.nn.Linear(width, width)
    x = torch.randn(tokens, width, requires_grad=True)
    return lambda: linear(x).sum().backward()


# The zoo's dense work (``benchmarks.compile.CASES``): the UNet's 3x3 convolutions at width 16
# and 64, the ViT's (width 128) and Transolver's (64) token projections, the FNO's and
# MeshGraphNet's pointwise layers (width 32, 64).
COMPUTE = {
    "conv3x3_16ch_64sq": lambda: _conv(16, 64),
    "conv3x3_64ch_32sq": lambda: _conv(64, 32),
    "linear_1024x128": lambda: _matmul(1024, 128),
    "linear_4096x64": lambda: _matmul(4096, 64),
    "linear_4096x32": lambda: _matmul(4096, 32),
}


def _spectral(channels: int, size: int) -> Callable[[], None]:
    x = torch.randn(1, channels, size, size, requires_grad=True)
    return lambda: torch.fft.irfft2(torch.fft.rfft2(x), s=(size, size)).sum().backward()


def _contraction(channels: int, modes: int) -> Callable[[], None]:
    """The FNO's spectral contraction at its defaults (NOTE [Complex matmuls are counted
    apart]): ``(1, C, 2 m, m)`` retained modes mixed by a ``(C, C, 2 m, m)`` complex weight."""
    x = torch.randn(1, channels, 2 * modes, modes, dtype=torch.complex64)
    weight = torch.randn(channels, channels, 2 * modes, modes, dtype=torch.complex64)
    weight.requires_grad_(True)
    return lambda: torch.einsum("bixy,ioxy->boxy", x, weight).abs().sum().backward()


def _median_cpu_s(fn: Callable[[], None], repeats: int) -> float:
    """Median CPU seconds of ``fn`` after one warm-up call: a core's rate, which other
    processes on a shared machine disturb less than wall time."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        samples.append(time.process_time() - start)
    return statistics.median(samples)


def measure_compute(repeats: int) -> dict[str, float]:
    """FLOP/s of each of ``COMPUTE`` (forward and backward, one thread, CPU time), of the
    FFTs (``fft``) and of the spectral contraction (``complex_matmul``), and the memory
    bandwidth (``memory``) and each flop-free family's (``flop_free:<family>``,
    ``measure_flop_free_families``), bytes per second."""
    torch.set_num_threads(1)
    rates = {}
    for name, build in COMPUTE.items():
        step = build()
        with WorkCounter() as counter:
            step()
        rates[name] = counter.flops / _median_cpu_s(step, repeats)
    spectral = _spectral(32, 128)
    with WorkCounter() as counter:
        spectral()
    rates["fft"] = counter.fft_flops / _median_cpu_s(spectral, repeats)
    contraction = _contraction(32, 12)
    with WorkCounter() as counter:
        contraction()
    rates["complex_matmul"] = counter.complex_matmul_flops / _median_cpu_s(contraction, repeats)
    a, b, c = (torch.ones(16 * 1024 * 1024) for _ in range(3))
    rates["memory"] = 3 * a.numel() * 4 / _median_cpu_s(lambda: torch.add(a, b, out=c), repeats)
    return rates | measure_flop_free_families(repeats)


# The kernels without FLOPs of each family (NOTE [Kernels without FLOPs by family] in
# ``shardsci.planning._work``) at the zoo's step shapes: a Transolver's or ViT's ``(16384, 64)``
# tokens at 128² (4 MiB) and a UNet's or FNO's ``(1, 32, 128, 128)`` field (2 MiB), forward
# ops; each family's kernels classified as ``WorkCounter`` classifies a step's.
_TOKENS, _FIELD = (16384, 64), (1, 32, 128, 128)


def _family_kernels() -> dict[str, list[Callable[[], object]]]:
    a, b = torch.randn(*_TOKENS), torch.randn(*_TOKENS)
    f, g = torch.randn(*_FIELD), torch.randn(*_FIELD)
    at = torch.randn(_TOKENS[1], _TOKENS[0]).mT  # a transposed operand beside a contiguous one
    row, column = torch.randn(_TOKENS[1]), torch.randn(_TOKENS[0], 1)
    channel = torch.randn(1, _FIELD[1], 1, 1)
    weight, bias = torch.ones(_TOKENS[1]), torch.zeros(_TOKENS[1])
    index = torch.randperm(_TOKENS[0])
    return {
        "pointwise_contiguous": [
            lambda: a + b,
            lambda: a * b,
            lambda: torch.nn.functional.gelu(a),
            lambda: f - g,
        ],
        "pointwise_broadcast": [lambda: a + row, lambda: a / column, lambda: f * channel],
        "pointwise_strided": [lambda: at + b, lambda: at * b, lambda: f.mT + g],
        "reduction": [
            lambda: a.sum(-1),
            lambda: torch.softmax(a, -1),
            lambda: torch.nn.functional.layer_norm(a, (_TOKENS[1],), weight, bias),
            lambda: f.mean((2, 3)),
        ],
        "copy": [
            lambda: a.clone(),
            lambda: torch.cat([f, g], 1),
            lambda: a.index_select(0, index),
        ],
    }


FAMILY_CALLS_TIMED = 5
"""Calls of one flop-free kernel per timed sample (one takes about a millisecond)."""


def measure_flop_free_families(repeats: int) -> dict[str, float]:
    """Bytes per second of each family of kernels without FLOPs (``FLOP_FREE_FAMILIES``):
    its kernels' bytes (``WorkCounter``'s ``flop_free_bytes_by_family``, as a step's are
    counted) over their CPU seconds (each the median of ``repeats`` samples of
    ``FAMILY_CALLS_TIMED`` calls), one thread; keys ``flop_free:<family>``.

    Raises
    ------
    AssertionError
        Where ``WorkCounter`` puts a kernel's bytes in another family (or counts FLOPs).
    """
    torch.set_num_threads(1)
    rates = {}
    for family, kernels in _family_kernels().items():
        nbytes = seconds = 0.0
        for kernel in kernels:
            with WorkCounter() as counter:
                kernel()
            counted = dict(counter.flop_free_bytes_by_family)
            assert set(counted) == {family} and not counter.flops, (family, counted)
            nbytes += counted[family]
            batch = _median_cpu_s(
                lambda k=kernel: [k() for _ in range(FAMILY_CALLS_TIMED)], repeats
            )
            seconds += batch / FAMILY_CALLS_TIMED
        rates[f"flop_free:{family}"] = nbytes / seconds
    return rates


def at_flop_free_families(machine: Machine, rates: dict[str, float]) -> Machine:
    """``machine`` with each ``<family>_bytes_per_s`` that ``rates`` measured
    (``measure_flop_free_families``' keys); the others ``machine``'s."""
    measured = {
        f"{key.removeprefix('flop_free:')}_bytes_per_s": rate
        for key, rate in rates.items()
        if key.startswith("flop_free:")
    }
    return dataclasses.replace(machine, **measured)


def one_flop_free_rate(machine: Machine) -> Machine:
    """``machine`` with no family rates: every flop-free byte at ``memory_bytes_per_s`` (the
    one rate of the cost model until 2026-11-30)."""
    return dataclasses.replace(
        machine, **{f"{family}_bytes_per_s": None for family in FLOP_FREE_FAMILIES}
    )


class _KernelRecorder(TorchDispatchMode):
    """Every aten call on plain tensors while active (a ShardTensor step's local kernels),
    with copies of its arguments; no collective (``c10d``)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        local = tensors and all(type(t) is torch.Tensor for t in tensors)
        if local and func.namespace == "aten":  # a collective is not replayed on one rank
            copied = tree_map(
                lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, (args, kwargs)
            )
            self.calls.append((func, *copied))
        return out


def measure_step_kernels(step: Callable[[], None], repeats: int) -> dict[str, float]:
    """The FLOP rates of ``step``'s own kernels at its own shapes (NOTE [The step's own
    kernels] in ``benchmarks/calibrate_steps.py``): ``flops``, FLOPs over CPU seconds of every
    call with FLOPs but no FFT or complex matmul; ``fft``, of its FFTs; ``complex_matmul``, of
    its complex matmuls; each call replayed alone on copies of
    its arguments (median of ``repeats``), FLOPs as ``WorkCounter`` counts them."""
    recorder = _KernelRecorder()
    with recorder:
        step()
    kinds = ("flops", "fft", "complex_matmul")
    flops, seconds = dict.fromkeys(kinds, 0.0), dict.fromkeys(kinds, 0.0)
    for func, args, kwargs in recorder.calls:
        with WorkCounter() as counter:
            func(*args, **kwargs)
        counted = (counter.flops, counter.fft_flops, counter.complex_matmul_flops)
        if not any(counted):
            continue
        kind, count = next((k, c) for k, c in zip(kinds, counted) if c)
        flops[kind] += count
        seconds[kind] += _median_cpu_s(lambda f=func, a=args, k=kwargs: f(*a, **k), repeats)
    return {kind: flops[kind] / seconds[kind] for kind in flops if seconds[kind] > 0}


def at_step_kernels(machine: Machine, rates: dict[str, float]) -> Machine:
    """``machine`` with ``sustained_flops``, ``fft_flops_per_s`` and
    ``complex_matmul_flops_per_s`` the rates of a step's own kernels
    (``measure_step_kernels``; a rate the step lacks stays ``machine``'s)."""
    return dataclasses.replace(
        machine,
        sustained_flops=rates.get("flops", machine.sustained_flops),
        fft_flops_per_s=rates.get("fft", machine.fft_flops_per_s),
        complex_matmul_flops_per_s=rates.get("complex_matmul", machine.complex_matmul_flops_per_s),
    )


def at_rates(machine: Machine, rates: dict[str, float]) -> Machine:
    """``machine`` with the compute rates ``measure_compute`` measured (``rates``):
    ``sustained_flops`` the median FLOP/s of ``COMPUTE``, the FFTs', the complex matmuls',
    the memory's and each flop-free family's where measured (``at_flop_free_families``)."""
    return dataclasses.replace(
        at_flop_free_families(machine, rates),
        sustained_flops=statistics.median(rates[name] for name in COMPUTE),
        fft_flops_per_s=rates["fft"],
        complex_matmul_flops_per_s=rates["complex_matmul"],
        memory_bytes_per_s=rates["memory"],
    )


STRIDED = ((4, 32, 64, 64), (4, 32, 64, 16), (4, 64, 128, 128))
"""Fields ``(B, C, H, W)`` whose pieces ``measure_strided_copy`` copies."""
COPIES_TIMED = 50
"""Copies per timed sample (one takes microseconds)."""


def measure_strided_copy(repeats: int) -> float:
    """Seconds a run of a strided copy costs beyond its bytes (NOTE [Strided copies]): per
    field of ``STRIDED`` and split ``n`` of 2, 4, 8, a copy of ``1 / n`` of it narrowed along
    W against one narrowed along H (the same bytes in ``B C`` runs), CPU time of ``COPIES_TIMED``
    copies; the median."""
    torch.set_num_threads(1)
    per_run = []
    for shape in STRIDED:
        field = torch.randn(*shape)
        for n in (2, 4, 8):
            along_w, along_h = field[..., : shape[3] // n], field[:, :, : shape[2] // n]
            extra = contiguous_runs(along_w) - contiguous_runs(along_h)
            seconds = [
                _median_cpu_s(lambda t=t: [t.contiguous() for _ in range(COPIES_TIMED)], repeats)
                / COPIES_TIMED
                for t in (along_w, along_h)
            ]
            per_run.append((seconds[0] - seconds[1]) / extra)
    return statistics.median(per_run)


def measure_host(repeats: int) -> tuple[float, float]:
    """µs of CPU time per aten op of a ShardTensor and a plain UNet step at a 16² tile on 1
    rank (``benchmarks.host_overhead.time_variants``): ``(shardtensor, plain)``."""
    (result,) = on_ranks(1, time_variants, "unet", repeats, 2, 16, 64)
    return tuple(  # type: ignore[return-value]
        statistics.median(result["cpu"][v]) / sum(result["ops"][v].values()) * 1e6
        for v in ("shardtensor", "torch")
    )


# --------------------------------------------------------------------------- the machine
def calibrate(repeats: int) -> tuple[Machine, dict[str, str], list[dict], dict[str, float]]:
    """Measure and fit (NOTE [Calibrating the machine]): the machine, each fitted
    parameter's source, the collective points (the timed calls', then the halo all-to-alls')
    and the compute rates."""
    points = measure_collectives(repeats)
    network = fit_collectives(points)
    halos = measure_halo_all_to_alls(repeats)
    rates = measure_compute(repeats)
    host_us, plain_us = measure_host(repeats)
    strided_copy_s = measure_strided_copy(repeats)
    host = fit_collective_host(points + halos)
    exchanges = measure_communication_ops(repeats)
    machine = dataclasses.replace(
        at_rates(
            gloo_machine(
                Machine(),
                network["base_latency_s"],
                network["step_latency_s"],
                network["bytes_per_s"],
            ),
            rates,
        ),
        **host,
        host_us_per_op=host_us,
        plain_host_us_per_op=plain_us,
        **dispatch_prices(gloo_cpu(1, cores=1, memory_bytes=1)),
        strided_copy_s_per_run=strided_copy_s,
        host_overlaps_device=False,
        memory_gib=os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 4 / 2**30,
    )
    machine = dataclasses.replace(
        machine,
        host_us_per_communication_op=statistics.median(
            communication_op_us(machine, e) for e in exchanges
        ),
    )
    network_source = (
        "measured on this machine by benchmarks.calibrate: least squares over "
        f"{len(points)} timed calls (p2p ping-pong on 2 ranks, all_to_all_single, "
        "all_gather_into_tensor, all_reduce on 2 and 4 gloo ranks, 256 B-4 MiB), the "
        "Machine's own formulas, relative residuals"
    )
    sources = {
        name: network_source
        for name in (
            "base_latency_s",
            "nvlink_step_latency_s",
            "net_step_latency_s",
            "nvlink_bytes_per_s",
            "ib_bytes_per_s",
        )
    }
    sources |= {
        "tree_base_latency_s": "gloo's all-reduce is a ring: a tree never chosen",
        "ll_bandwidth_fraction": "gloo has one protocol: 1",
        "simple_latency_factor": "gloo has one protocol: 1",
        "gpus_per_node": "one host: every rank on one 'node'",
        "sustained_flops": "measured on this machine by benchmarks.calibrate: median of "
        f"{', '.join(COMPUTE)} forward+backward FLOPs (WorkCounter) per second, one thread",
        "fft_flops_per_s": "measured on this machine by benchmarks.calibrate: rfft2 + irfft2 "
        "of (1, 32, 128, 128), forward+backward FFT FLOPs (WorkCounter) per second, one thread",
        "complex_matmul_flops_per_s": "measured on this machine by benchmarks.calibrate: the "
        "FNO's spectral contraction (einsum of (1, 32, 24, 12) complex modes with a (32, 32, "
        "24, 12) weight), forward+backward complex matmul FLOPs (WorkCounter) per second",
        "host_us_per_collective": "measured on this machine by benchmarks.calibrate: least "
        "squares of every timed call's CPU time on 2 and 4 gloo ranks (256 B-4 MiB) and of "
        "halo all-to-alls on 2, 4 and 8 (faces of 256 B-64 KiB), per call + per ring step "
        "(an all-to-all: per call + per other rank of its group) + per byte received",
        "host_us_per_collective_step": "the same fit, per ring step",
        "host_us_per_all_to_all": "the same fit, per all-to-all",
        "host_us_per_all_to_all_peer": "the same fit, per other rank of an all-to-all's group",
        "host_s_per_byte_received": "the same fit, per byte the busiest rank receives",
        "memory_bytes_per_s": "measured on this machine by benchmarks.calibrate: "
        "torch.add of 64 MiB float32 arrays, 3 arrays' bytes per second, one thread",
        **{
            f"{family}_bytes_per_s": "measured on this machine by benchmarks.calibrate: "
            f"the {family} kernels of measure_flop_free_families (forward ops at (16384, 64) "
            "tokens and a (1, 32, 128, 128) field), their bytes (WorkCounter's "
            "flop_free_bytes_by_family) over their CPU seconds, one thread"
            for family in FLOP_FREE_FAMILIES
        },
        "host_us_per_op": "measured on this machine by benchmarks.calibrate with "
        "benchmarks.host_overhead: ShardTensor UNet step at 16², 1 rank, CPU s per aten op",
        "plain_host_us_per_op": "the same, plain torch's step",
        "host_us_per_communication_op": "measured on this machine by benchmarks.calibrate: "
        "a periodic halo exchange's forward and backward of a (1, 16, 32, 32) shard on 2 "
        "ranks (H split) and 2x2, CPU s between computations less its collectives' "
        "(collective_host_s) and its other ops' (plain_host_us_per_op), per op the "
        "communication modules dispatch; the median over the two",
        "strided_copy_s_per_run": "measured on this machine by benchmarks.calibrate: copies "
        "of W- against H-narrowed pieces of (4, 32-64, 64-128, 16-128) fields, CPU s per "
        "extra run, one thread, median",
        "host_overlaps_device": "a CPU launches and runs its kernels on one core",
        "memory_gib": "a quarter of this machine's RAM (4 ranks)",
    }
    return machine, sources, points + halos + exchanges, rates


def emit_calibration(machine: Machine, sources: dict, points: list[dict], rates: dict) -> None:
    """The ``collective``, ``compute`` and ``parameters`` records of one calibration."""
    for p in points:
        if "communication_ops" in p:
            emit("halo_exchange", **p, us_per_communication_op=communication_op_us(machine, p))
            continue
        charged = collective_host_s(machine, p["kind"], p["ranks"], 1, p["received"])
        if "pieces" in p:
            emit("halo", **p, charged_cpu_s=charged)
            continue
        predicted = predicted_collective_s(machine, p["kind"], p["ranks"], p["bytes"])
        emit(
            "collective",
            **p,
            predicted_s=predicted,
            predicted_over_measured=round(predicted / p["seconds"], 3),
            charged_cpu_s=charged,
        )
    emit("compute", **{k: round(v / 1e9, 3) for k, v in rates.items()}, unit="G per s")
    emit("parameters", **dataclasses.asdict(machine), sources=sources)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed batches per point")
    parser.add_argument("--save", help="write the fitted Machine and its sources to this file")
    args = parse_arguments(parser, argv)
    with rank_pools():
        machine, sources, points, rates = calibrate(args.repeats)
    emit_calibration(machine, sources, points, rates)
    if args.save:
        Path(args.save).write_text(
            json.dumps(
                {"machine": dataclasses.asdict(machine), "sources": sources, "points": points}
            )
        )
    timed = [p for p in points if "pieces" not in p and "communication_ops" not in p]
    ratios = [predicted_collective_s(machine, **_call(p)) / p["seconds"] for p in timed]
    emit_summary(
        [],
        args.check,
        base_latency_us=round(machine.base_latency_s * 1e6, 1),
        step_latency_us=round(machine.nvlink_step_latency_s * 1e6, 1),
        bandwidth_gb_per_s=round(machine.nvlink_bytes_per_s / 1e9, 3),
        sustained_gflops=round(machine.sustained_flops / 1e9, 2),
        fft_gflops=round(machine.fft_flops_per_s / 1e9, 2),
        memory_gb_per_s=round(machine.memory_bytes_per_s / 1e9, 2),
        **{
            f"{family}_gb_per_s": round(getattr(machine, f"{family}_bytes_per_s") / 1e9, 2)
            for family in FLOP_FREE_FAMILIES
        },
        host_us_per_op=round(machine.host_us_per_op, 1),
        plain_host_us_per_op=round(machine.plain_host_us_per_op, 1),
        host_us_per_communication_op=round(machine.host_us_per_communication_op, 1),
        host_us_per_collective=round(machine.host_us_per_collective, 1),
        host_us_per_collective_step=round(machine.host_us_per_collective_step, 1),
        host_us_per_all_to_all=round(machine.host_us_per_all_to_all, 1),
        host_us_per_all_to_all_peer=round(machine.host_us_per_all_to_all_peer, 1),
        host_us_per_mib_received=round(machine.host_s_per_byte_received * 2**20 * 1e6, 1),
        strided_copy_ns_per_run=round(machine.strided_copy_s_per_run * 1e9, 2),
        collective_fit_worst=round(max(ratios, key=lambda r: abs(r - 1)), 2),
    )


def _call(point: dict) -> dict:
    return {"kind": point["kind"], "ranks": point["ranks"], "nbytes": point["bytes"]}


if __name__ == "__main__":
    main()
