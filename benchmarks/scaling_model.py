"""Weak and strong scaling of a domain-parallel UNet step on 8-512 GPUs, projected with an
alpha-beta model fed with the communication measured on real runs.

Measured here (real gloo ranks, the collectives and messages torch runs counted by
``shardsci.testing.count_traffic``): one training step of ``UNet(width=32, depth=3,
padding_mode="circular")``, batch 1, on a 3x3 block decomposition (every rank has two
neighbours along each axis, as on any larger mesh), per rank: halo exchanges (rounds of
point-to-point messages posted together), their messages and bytes; statistics all-gathers
and all-reduces; the gradient all-reduces (those a step under ``no_sync()`` does not issue)
and their bytes. Halo bytes are faces, proportional to the tile's edge, so they are measured
at one tile size and scaled.
The step's convolution FLOPs come from ``torch.utils.flop_counter`` on the plain model.

Projected: ``Machine.gpus_per_node`` GPUs per node, 2-D blocks over (H, W); a step costs
``compute + halos + statistics + exposed gradient reduction``:
- compute: FLOPs / ``sustained_flops`` (an assumption, stated below);
- halos: every exchange is on the critical path (forward and backward), each costs one
  message latency plus its bytes over the per-GPU link (NVLink inside one node; from 16 GPUs on,
  some neighbour of every block is on another node, so InfiniBand);
- statistics all-gathers (ring) and all-reduces (the cheaper of ring and tree), and the
  gradient all-reduce's last bucket (the others overlap backward), all with NCCL's own
  latency model (``src/graph/tuning.cc``: base latency plus a per-step latency of the link).

The machine is ``shardsci.planning._machine.Machine`` (NOTE [One machine model]: the one
cost_model and ``parallel=auto`` use); its parameters are emitted in the ``parameters`` record. No goal is stated: the
projection is reported. Run ``python -m benchmarks.scaling_model [--tile 32]`` (≈1 min: the
measurement uses 9 ranks on small tiles).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from benchmarks._common import (
    emit,
    emit_summary,
    on_ranks,
    parse_arguments,
    rank_pools,
    step_traffic,
)
from shardsci import Shard, ShardTensor, distribute_tensor
from shardsci.models import UNet
from shardsci.parallel import domain_parallel
from shardsci.planning._machine import Machine, all_gather_s, all_reduce_s, halo_s
from shardsci.tensor._collectives import issued_as
from shardsci.testing import get_mesh

MEASURED_TILE = 32  # H and W per rank in the 3x3 measurement (default)
GPUS = (8, 16, 32, 64, 128, 256, 512)
WEAK_TILES = (512, 2048)  # H = W per GPU, batch 1
STRONG_FIELD = 8192  # H = W of the whole field, batch 1


# --------------------------------------------------------------------------- measurement
def measure_block(tile: int, backend: str) -> dict:
    """Rank body (9 ranks): one step on a 3x3 block of ``tile x tile`` shards, its halo
    exchanges issued as ``backend`` issues them (``issued_as``: messages on NCCL, where gloo
    sends one all-to-all): this rank's collectives and bytes received by kind
    (``p2p_rounds``: halo exchanges) under ``no_sync()``, and the gradient all-reduces: what
    the same step with gradient reduction issues beyond that."""
    with issued_as(backend):
        return _measure_block(tile)


def _measure_block(tile: int) -> dict:
    mesh = get_mesh((1, 3, 3), ("dp", "h", "w"))
    torch.manual_seed(0)
    model = domain_parallel(
        UNet(width=32, depth=3, padding_mode="circular"),
        mesh,
        dp_axis="dp",
        domain_axes=["h", "w"],
    )
    size = 3 * tile
    layout = {0: (tile,) * 3, 1: (tile,) * 3}
    x, y = (
        distribute_tensor(
            torch.randn(1, 1, size, size), mesh[("h", "w")], [Shard(2), Shard(3)], layout
        )
        for _ in range(2)
    )

    def step() -> None:
        model.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss = loss.full_tensor() if isinstance(loss, ShardTensor) else loss
        loss.backward()

    calls, received = step_traffic(step, model)
    return {"calls": dict(calls), "received": dict(received)}


def flops_per_pixel() -> float:
    """Convolution FLOPs of one training step per pixel of the field (batch 1)."""
    model = UNet(width=32, depth=3, padding_mode="circular")
    size = 64
    x, y = torch.randn(1, 1, size, size), torch.randn(1, 1, size, size)
    with FlopCounterMode(display=False) as counter:
        F.mse_loss(model(x), y).backward()
    return counter.get_total_flops() / size**2


# --------------------------------------------------------------------------- model
def step_s(machine: Machine, measured: dict, flops: float, ranks: int, tile: float) -> dict:
    """Seconds per step of each part on ``ranks`` GPUs with ``tile x tile`` pixels each, and
    the total if the statistics were combined by all-reduces instead."""
    calls, received = measured["calls"], measured["received"]
    halo_bytes = received.get("p2p", 0) * tile / measured["tile"]
    # Measured on 9 ranks: an all-gather receives 8 pieces; an all-reduce is counted at its
    # ring cost, 2 (9 - 1) / 9 of its buffer.
    gather_piece = received.get("all_gather", 0) / max(calls.get("all_gather", 1), 1) / 8
    reduce_bytes = received.get("all_reduce", 0) / max(calls.get("all_reduce", 1), 1) * 9 / 16
    gradient_bytes = measured["gradient_bytes"]
    parts = {
        "compute": flops * tile * tile / machine.sustained_flops,
        "halo": halo_s(machine, ranks, calls.get("p2p_rounds", 0), halo_bytes),
        "statistics": calls.get("all_gather", 0) * all_gather_s(machine, ranks, gather_piece)
        + calls.get("all_reduce", 0) * all_reduce_s(machine, ranks, reduce_bytes),
        "gradients": all_reduce_s(machine, ranks, gradient_bytes),
    }
    parts["total"] = sum(parts.values())
    # The alternative NOTE [Normalisation statistics across shards] weighs: two all-reduces
    # (the sum, then the squared deviations) in place of each statistics all-gather.
    alternative = 2 * calls.get("all_gather", 0) * all_reduce_s(machine, ranks, gather_piece)
    parts["total_statistics_by_all_reduce"] = (
        parts["total"] - calls.get("all_gather", 0) * all_gather_s(machine, ranks, gather_piece)
    ) + alternative
    return parts


def _grid(ranks: int) -> tuple[int, int]:
    rows = 2 ** math.ceil(math.log2(ranks) / 2)
    return rows, ranks // rows


def project(measured: dict, flops: float, machine: Machine) -> dict[str, float]:
    """Emit ``weak`` and ``strong`` records; return the efficiencies at 512 GPUs."""
    summary = {}
    for tile in WEAK_TILES:
        base = step_s(machine, measured, flops, 1, tile)["compute"]
        for ranks in GPUS:
            parts = step_s(machine, measured, flops, ranks, tile)
            efficiency = base / parts["total"]
            emit(
                "weak",
                gpus=ranks,
                tile=tile,
                field=[tile * n for n in _grid(ranks)],
                step_ms={k: round(v * 1e3, 3) for k, v in parts.items()},
                efficiency=round(efficiency, 3),
                efficiency_statistics_by_all_reduce=round(
                    base / parts["total_statistics_by_all_reduce"], 3
                ),
            )
        summary[f"weak_{tile}_efficiency_512"] = round(efficiency, 3)
    first = None
    for ranks in GPUS:
        rows, cols = _grid(ranks)
        tile = math.sqrt((STRONG_FIELD / rows) * (STRONG_FIELD / cols))
        parts = step_s(machine, measured, flops, ranks, tile)
        first = first or (ranks, parts["total"])
        efficiency = first[0] * first[1] / (ranks * parts["total"])
        emit(
            "strong",
            gpus=ranks,
            field=STRONG_FIELD,
            tile=[STRONG_FIELD // rows, STRONG_FIELD // cols],
            step_ms={k: round(v * 1e3, 3) for k, v in parts.items()},
            speedup_vs_8=round(first[1] / parts["total"], 2),
            efficiency_vs_8=round(efficiency, 3),
        )
    summary["strong_efficiency_512_vs_8"] = round(efficiency, 3)
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tile", type=int, default=MEASURED_TILE, help="H and W per rank when measuring"
    )
    args = parse_arguments(parser, argv)
    machine = Machine()
    with rank_pools():
        per_rank = on_ranks(9, measure_block, args.tile, machine.backend)
    worst = max(per_rank, key=lambda r: sum(r["received"].values()))
    measured = {
        "tile": args.tile,
        "calls": worst["calls"],
        "received": worst["received"],
        "gradient_bytes": sum(
            p.numel() * 4 for p in UNet(width=32, depth=3, padding_mode="circular").parameters()
        ),
    }
    flops = flops_per_pixel()
    emit("measured", mesh="3x3", **measured, flops_per_pixel=flops)
    emit("parameters", **asdict(machine))
    summary = project(measured, flops, machine)
    emit_summary([], args.check, **summary)


if __name__ == "__main__":
    main()
