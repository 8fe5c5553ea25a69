"""The 3-D recipe's default mesh: its FNO on 8 ranks as a 2x2x2 block (D, H, W) against a
(D, H) pencil 4x2, bytes received per rank and step time.

The cfd3d recipe's model as ``+recipe=cfd3d`` composes it (``configs/recipe/cfd3d/model/
fno.yaml``), one training step (forward, mean-square loss, backward with ``domain_parallel``'s
gradient all-reduce) on a batch of ``--batch`` fields ``(3, N, N, N)``, ``N = --size`` (the
recipe's 32 by default), split evenly over the mesh's axes. Per mesh: the bytes each rank
receives in one step by kind and the collectives it issues by kind (``shardsci.testing.
count_traffic``, not the library's own counter; neither depends on the machine's load), then
``--rounds`` rounds of ``--steps`` timed steps after a warm-up, the meshes' order reversed
every round (``_common.interleaved_steps``), each step from a barrier; a step's time is the
slowest rank's, wall and CPU (``time.process_time``).

Goal (``--check``): the pencil receives at most ``PENCIL_BYTES_FACTOR`` times the block's bytes
per rank (the FFT along W is local on the pencil: its all-to-alls move less). Run
``python -m benchmarks.cfd3d_meshes [--size 32] [--batch 4] [--rounds 2] [--steps 2]
[--check]``; JSON lines on stdout.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks._common import (
    Goal,
    emit,
    emit_summary,
    interleaved_steps,
    on_ranks,
    parse_arguments,
    rank_pools,
    spread,
    timed_steps,
)
from shardsci import Shard, distribute_tensor
from shardsci.parallel import domain_parallel
from shardsci.recipes.cfd3d.learnability import recipe_model
from shardsci.testing import count_traffic, get_mesh

RANKS = 8
MESHES = {"block 2x2x2": (2, 2, 2), "pencil 4x2 (D, H)": (4, 2)}
PENCIL_BYTES_FACTOR = 1.0


def _rank_body(mesh_shape: tuple[int, ...], size: int, batch: int, steps: int) -> dict[str, Any]:
    names = ("d", "h", "w")[: len(mesh_shape)]
    mesh = get_mesh(mesh_shape, names)
    torch.manual_seed(0)
    model = domain_parallel(recipe_model("fno"), mesh, domain_axes=list(names))
    generator = torch.Generator().manual_seed(1)
    fields = [torch.randn(batch, 3, size, size, size, generator=generator) for _ in range(2)]
    placements = [Shard(2 + axis) for axis in range(len(mesh_shape))]
    x, y = (distribute_tensor(field, mesh, placements) for field in fields)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()

    step()  # warm-up: plans, caches and groups are made here
    with count_traffic() as traffic:
        step()
    walls, cpus = timed_steps(step, steps)
    return {
        "received": traffic.received,
        "by_kind": dict(traffic.received_by_kind),
        "calls_by_kind": dict(traffic.calls_by_kind),
        "wall": walls,
        "cpu": cpus,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=32, help="the field's side N")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    args = parse_arguments(parser, argv)
    traffic: dict[str, dict[str, Any]] = {}
    cpu: dict[str, list[float]] = {name: [] for name in MESHES}

    def run(name: str) -> list[float]:
        results = on_ranks(RANKS, _rank_body, MESHES[name], args.size, args.batch, args.steps)
        traffic[name] = {
            "received_per_rank": max(r["received"] for r in results),
            "received_by_kind": results[0]["by_kind"],
            "calls_by_kind": results[0]["calls_by_kind"],
        }
        cpu[name] += [max(r["cpu"][i] for r in results) for i in range(args.steps)]
        return [max(r["wall"][i] for r in results) for i in range(args.steps)]

    with rank_pools():
        wall = interleaved_steps(list(MESHES), args.rounds, run)
    for name, shape in MESHES.items():
        emit(
            "mesh",
            mesh=name,
            mesh_shape=list(shape),
            size=args.size,
            batch=args.batch,
            **traffic[name],
            step_wall_s=spread(wall[name]),
            step_cpu_s=spread(cpu[name]),
        )
    block, pencil = (traffic[name]["received_per_rank"] for name in MESHES)
    emit_summary(
        [
            Goal(
                f"the pencil receives at most {PENCIL_BYTES_FACTOR:g}x the block's bytes per rank",
                pencil <= PENCIL_BYTES_FACTOR * block,
            )
        ],
        args.check,
        pencil_over_block_bytes=round(pencil / block, 3) if block else None,
    )


if __name__ == "__main__":
    main()
