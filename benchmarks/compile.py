"""Eager against compiled training steps of the zoo's models, at 1 and 2 ranks.

Per model and world size, one training step (forward, a mean-square loss, backward, AdamW) is
timed three ways side by side (variants interleaved in every round, order alternating, each
step started from a barrier, a step's time the slowest rank's):

- ``eager``: the model as written (plain tensors at 1 rank, ShardTensors at 2);
- ``regions``: ``shardsci.compiling.compile_regions(model)``: the modules that compute on each
  shard alone run compiled by inductor on the local shards (at 1 rank, on plain tensors, it
  runs the model as written);
- ``torch_compile``: ``torch.compile(model)``: one compiled graph per frame at 1 rank; at 2
  ranks traced through ShardTensors (NOTE [torch.compile and ShardTensor]; records made before
  2026-11-30 ran ShardTensor ops eagerly here).

Models (``--models``): the UNet, FNO, ViT and Transolver on a ``(4, 1, 128, 128)`` field (2
ranks: H split 64/64, then 72/56), the last three with the CFD recipe's settings
(``configs/recipe/cfd/model/``); the MeshGraphNet on a 2000-node mesh (METIS, then RCB parts).
Step times (wall, and CPU: ``time.process_time`` of the slowest rank, which other processes
on a shared machine disturb far less) are reported as median, quartiles, min and max
(``_common.spread``), the ratios to eager as the ratio of medians and the spread of the
per-round wall-time ratios.

Besides the times: compile time (first steps), compiled frames, graph breaks
(``torch._dynamo.explain``), compiled regions, recompilations when only the shard sizes change
(2 ranks: a second layout of the same global problem after the timed steps) and the largest
difference from the eager result. No goal is stated: the ratios are reported. Run ``python -m
benchmarks.compile [--models unet fno] [--worlds 1 2] [--rounds 5] [--size 128] [--backend
inductor]`` (``--size``: H = W of the field models' input; ``--backend eager`` traces with
dynamo but compiles nothing, for a quick run); JSON lines on stdout, fields in README.md.
Compile times are dominated by inductor's C++ compiler on a CPU.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch._dynamo.testing
import torch.distributed as dist
from scipy.spatial import Delaunay
from torch import nn

from benchmarks._common import (
    emit,
    emit_summary,
    interleaved_steps,
    parse_arguments,
    rank_pools,
    spread,
)
from shardsci import Shard, ShardTensor
from shardsci.compiling import compile_regions, region_summary
from shardsci.graph import GraphPartition, partition_nodes
from shardsci.models import FNO, MeshGraphNet, Transolver, UNet, ViT
from shardsci.testing import get_mesh, run_on_ranks

VARIANTS = ("eager", "regions", "torch_compile")
ROUNDS = 5
RANK_TIMEOUT_S = 3600.0  # inductor compiles C++ for minutes on a busy 2-core machine


@dataclass(frozen=True)
class Case:
    """A zoo model and its inputs: ``inputs(world, variant, size)`` gives the arguments of
    one step on this rank (``variant`` 1 is another split of the same global problem; ``size``
    the H = W of a field, which a mesh's inputs ignore)."""

    describe: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int, int, int], tuple]


# --------------------------------------------------------------------------- the cases
def _field_inputs(world: int, variant: int, size: int) -> tuple:
    whole = torch.randn(4, 1, size, size, generator=torch.Generator().manual_seed(0))
    if world == 1:
        return (whole,)
    half, shift = size // 2, size // 16
    sizes = [(half, size - half), (half + shift, size - half - shift)][variant]
    start = sum(sizes[: dist.get_rank()])
    local = whole[:, :, start : start + sizes[dist.get_rank()]].contiguous()
    return (ShardTensor.from_local(local, get_mesh((world,)), [Shard(2)], {0: sizes}),)


def _mesh_graph(points: int) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.rand(points, 2, generator=torch.Generator().manual_seed(0))
    triangles = torch.as_tensor(Delaunay(positions.numpy()).simplices)
    pairs = torch.cat([triangles[:, [0, 1]], triangles[:, [1, 2]], triangles[:, [2, 0]]])
    pairs = torch.unique(torch.cat([pairs, pairs.flip(1)]), dim=0)
    return positions, pairs.t().contiguous()


def _meshgraphnet_inputs(world: int, variant: int, size: int) -> tuple:
    positions, edge_index = _mesh_graph(2000)
    generator = torch.Generator().manual_seed(1)
    nodes = torch.randn(positions.shape[0], 4, 3, generator=generator)
    edges = torch.randn(edge_index.shape[1], 4, 3, generator=generator)
    if world == 1:
        return nodes, edges, edge_index
    method = ("metis", "rcb")[variant]
    parts = partition_nodes(edge_index, len(positions), world, method=method, coordinates=positions)
    partition = GraphPartition.build(edge_index, parts, world)
    mesh, rank = get_mesh((world,)), dist.get_rank()
    node_start = sum(partition.node_sizes[:rank])
    edge_start = sum(partition.edge_sizes[:rank])
    node_rows = slice(node_start, node_start + partition.node_sizes[rank])
    edge_rows = slice(edge_start, edge_start + partition.edge_sizes[rank])
    return (
        ShardTensor.from_local(
            nodes[partition.node_order][node_rows].contiguous(),
            mesh,
            [Shard(0)],
            {0: partition.node_sizes},
        ),
        ShardTensor.from_local(
            edges[partition.edge_order][edge_rows].contiguous(),
            mesh,
            [Shard(0)],
            {0: partition.edge_sizes},
        ),
        ShardTensor.from_local(
            partition.edge_index[:, edge_rows].contiguous(),
            mesh,
            [Shard(1)],
            {0: partition.edge_sizes},
        ),
    )


CASES = {
    "unet": Case(
        "UNet(width=16, depth=3, norm_groups=4, circular), input (4, 1, 128, 128)",
        lambda: UNet(width=16, depth=3, norm_groups=4, padding_mode="circular", residual=True),
        _field_inputs,
    ),
    "meshgraphnet": Case(
        "MeshGraphNet(hidden=64, processor_blocks=6), 2000-node Delaunay mesh, batch 4",
        lambda: MeshGraphNet(node_in=3, edge_in=3, node_out=3, hidden=64, processor_blocks=6),
        _meshgraphnet_inputs,
    ),
    "fno": Case(
        "FNO(modes=(12, 12), width=32, layers=4, periodic), input (4, 1, 128, 128)",
        lambda: FNO(modes=(12, 12), width=32, coordinates="periodic", residual=True),
        _field_inputs,
    ),
    "vit": Case(
        "ViT(patch_size=4, width=128, depth=4, heads=4), input (4, 1, 128, 128)",
        lambda: ViT(patch_size=4, width=128, depth=4, heads=4, residual=True),
        _field_inputs,
    ),
    "transolver": Case(
        "Transolver(width=64, layers=4, heads=4, slices=32), input (4, 1, 128, 128)",
        lambda: Transolver(width=64, layers=4, heads=4, slices=32, residual=True),
        _field_inputs,
    ),
}


# --------------------------------------------------------------------------- rank bodies
def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, ShardTensor) else t


class _Variant:
    """One way of running the case's model, with its own copy and optimiser."""

    def __init__(self, name: str, model: nn.Module, backend: str) -> None:
        self.counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
        self.model = copy.deepcopy(model)
        if name == "regions":
            compile_regions(self.model, backend=self.counter)
        self.run = (
            torch.compile(self.model, backend=self.counter)
            if name == "torch_compile"
            else self.model
        )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.cpu_s: list[float] = []

    def step(self, args: tuple) -> torch.Tensor:
        out = self.run(*args)
        loss = _whole((out * out).mean())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return out.detach()

    def timed_step(self, args: tuple) -> list[float]:
        """Wall seconds of one step from a barrier; its CPU seconds go to ``cpu_s``."""
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        self.step(args)
        self.cpu_s.append(time.process_time() - cpu_start)
        return [time.perf_counter() - start]


def time_variants(case_name: str, rounds: int, size: int, backend: str) -> dict:
    """Rank body: per variant, compile time, step times, frames, recompilations, agreement."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    world = dist.get_world_size()
    case = CASES[case_name]
    model = case.build()
    args = case.inputs(world, 0, size)
    variants = {name: _Variant(name, model, backend) for name in VARIANTS}
    result: dict = {name: {} for name in VARIANTS}
    outputs = {}
    for name, variant in variants.items():
        dist.barrier()
        start = time.perf_counter()
        for _ in range(2):  # the first call of a region decides whether it is local
            out = variant.step(args)
        result[name]["first_two_steps_s"] = time.perf_counter() - start
        outputs[name] = _whole(out)
    steps = interleaved_steps(list(VARIANTS), rounds, lambda name: variants[name].timed_step(args))
    for name in VARIANTS:
        result[name]["step_s"] = steps[name]
        result[name]["cpu_s"] = variants[name].cpu_s
    other = case.inputs(world, 1, size) if world > 1 else args
    for name, variant in variants.items():
        frames = variant.counter.frame_count
        variant.step(other)
        result[name]["frames"] = frames
        result[name]["recompilations_new_shard_sizes"] = variant.counter.frame_count - frames
        scale = outputs["eager"].abs().max().item()
        result[name]["max_rel_diff_from_eager"] = (
            outputs[name] - outputs["eager"]
        ).abs().max().item() / scale
    summary = region_summary(variants["regions"].model)
    result["regions"]["compiled_regions"] = sum(s == "region" for s in summary.values())
    explained = torch._dynamo.explain(copy.deepcopy(model))(*args)
    result["torch_compile"]["graphs"] = explained.graph_count
    result["torch_compile"]["graph_breaks"] = explained.graph_break_count
    return result


# --------------------------------------------------------------------------- reporting
def report(case_name: str, world: int, args: argparse.Namespace) -> dict[str, float]:
    per_rank = run_on_ranks(
        world,
        time_variants,
        case_name,
        args.rounds,
        args.size,
        args.backend,
        timeout_s=RANK_TIMEOUT_S,
    )
    first = per_rank[0]
    steps, cpu = (
        {
            name: [max(times) for times in zip(*(r[name][key] for r in per_rank))]
            for name in VARIANTS
        }
        for key in ("step_s", "cpu_s")
    )
    median = {name: statistics.median(times) for name, times in steps.items()}
    cpu_median = {name: statistics.median(times) for name, times in cpu.items()}
    ratios = {
        f"ratio_{name}_to_eager": round(median[name] / median["eager"], 3) for name in VARIANTS[1:]
    } | {
        f"ratio_{name}_to_eager_cpu": round(cpu_median[name] / cpu_median["eager"], 3)
        for name in VARIANTS[1:]
    }
    emit(
        "compile",
        model=case_name,
        describe=CASES[case_name].describe,
        field_size=args.size,
        backend=args.backend,
        world_size=world,
        steps_timed=len(steps["eager"]),
        **{f"{name}_step_s": spread(steps[name]) for name in VARIANTS},
        **{f"{name}_cpu_s": spread(cpu[name]) for name in VARIANTS},
        **{
            f"{name}_first_two_steps_s": round(
                max(r[name]["first_two_steps_s"] for r in per_rank), 2
            )
            for name in VARIANTS
        },
        **ratios,
        **{
            f"ratio_{name}_to_eager_per_round": spread(
                [t / e for t, e in zip(steps[name], steps["eager"])], digits=3
            )
            for name in VARIANTS[1:]
        },
        regions_frames=first["regions"]["frames"],
        compiled_regions=first["regions"]["compiled_regions"],
        torch_compile_frames=first["torch_compile"]["frames"],
        torch_compile_graphs=first["torch_compile"]["graphs"],
        torch_compile_graph_breaks=first["torch_compile"]["graph_breaks"],
        recompilations_new_shard_sizes={
            name: max(r[name]["recompilations_new_shard_sizes"] for r in per_rank)
            for name in VARIANTS[1:]
        },
        max_rel_diff_from_eager={
            name: max(r[name]["max_rel_diff_from_eager"] for r in per_rank) for name in VARIANTS[1:]
        },
    )
    return {f"{case_name}_{world}_{key}": value for key, value in ratios.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--worlds", nargs="+", type=int, default=[1, 2], choices=[1, 2])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--size", type=int, default=128, help="H = W of a field model's input")
    parser.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    args = parse_arguments(parser, argv)
    summary: dict[str, object] = {}
    with rank_pools():
        for case_name in args.models:
            for world in args.worlds:
                summary.update(report(case_name, world, args))
    emit_summary(
        [],
        args.check,
        **summary,
        rounds=args.rounds,
    )


if __name__ == "__main__":
    main()
