"""Host time of one training step of every zoo model: plain torch eager against ShardTensor
eager, at a tile so small that the kernels cost almost nothing.

Per model and world size (``--worlds``, 1 and 2 ranks), every rank runs two variants side by
side in one process:

- ``torch``: the zoo model on plain tensors of one rank's size (a ``(1, 1, 16, 16)`` field, or
  a graph of ``--nodes`` nodes; the FNO at 24², the least its 12 modes take), no communication: the host cost of the model as written;
- ``shardtensor``: the same model under ``domain_parallel`` on a ``(1, P)`` mesh ``(dp,
  domain)``, fed ShardTensors of ``P`` such tiles (H split evenly), or of a ``P``-part graph
  partition (METIS) of ``P`` times as many nodes.

One step is forward, a mean-square loss, backward (gradients reduced as in training), no
optimiser. Each variant makes one warm-up step, then ``--rounds`` rounds of ``--steps`` steps,
the variants' order reversed every round (``_common.interleaved_steps``), each step from a
barrier; a step's time is the slowest rank's. Figures: median, quartiles, min and max of wall
time (``_common.spread``) and of the slowest rank's CPU time (``time.process_time``, which other
processes on a shared machine disturb less).

Ops per step: the aten ops each variant's step dispatches, counted by a ``TorchDispatchMode``
in one untimed step (a mode sees the ops called on ShardTensors and the ops the library runs
on local shards outside a ShardTensor's ``__torch_dispatch__``: function handlers' halos and
redistributions; not those an aten handler runs inside it; collectives are counted among
them). Host time added per op:
``(shardtensor - torch) / shardtensor ops`` (``added_us_per_plain_op``: over the plain step's
ops), and each variant's step over its own ops (``us_per_op``), medians of wall time;
``benchmarks.cost_model`` reads its host term from these.

Ops per path (``paths``): in one more untimed step of the ShardTensor variant, the aten ops
on ShardTensors by the dispatch path they took (NOTE [Dispatch paths] in
``shardsci.tensor._dispatch``: ``handler``, ``fast``, ``propagation``), nested ones included
(``ops``), the outermost ones (``outermost``: not dispatched from inside another op) and the
host time per outermost op (``us_per_op``, inclusive of the ops it runs; one step, rank 0).

Compiled (``--compiled BACKEND``, ``aot_eager`` or ``inductor``): after the eager record, the
same two steps with the model ``torch.compile``'d, traced through ShardTensors (NOTE
[torch.compile and ShardTensor]; the two compiled variants are timed together, apart from the
eager ones): ``torch_compiled`` against
``shardtensor_compiled``, two untimed steps first (compilation), then interleaved as above,
and the frames compiled before and during the timed steps (none during: no recompilation),
the graph breaks dynamo met while compiling (``torch._dynamo.utils.counters``, with their
first reasons) and the largest difference of the second untimed step's output and gradients
from an eager step of the same variant on the same data (relative to the eager values'
largest magnitude; float32).
``aot_eager`` runs AOTAutograd's graphs op by op (no generated code): its ratio measures what
tracing removes from the host path, not inductor's fused kernels, the goal's backend.

Issue 21 item 1 states the goals ``ShardTensor eager at most 1.5x plain eager`` and ``compiled
ShardTensor at most 1.2x compiled plain torch``; they are reported as goals (``GOAL_RATIO``,
``COMPILED_GOAL_RATIO``) and the first is not met today. Run ``python -m
benchmarks.host_overhead [--models unet fno vit transolver meshgraphnet] [--worlds 1 2]
[--rounds 5] [--steps 2] [--tile 16] [--nodes 64] [--compiled aot_eager] [--check]``; JSON
lines on stdout, fields in README.md.
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable

import torch
import torch._dynamo.testing
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

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
from benchmarks.compile import CASES, RANK_TIMEOUT_S, _mesh_graph
from shardsci import Shard, ShardTensor
from shardsci.graph import GraphPartition, partition_nodes
from shardsci.parallel import domain_parallel
from shardsci.tensor._dispatch import tally_paths
from shardsci.testing import get_mesh, run_on_ranks

GOAL_RATIO = 1.5  # issue 21: ShardTensor eager at most this times plain eager's step
COMPILED_GOAL_RATIO = 1.2  # issue 21: compiled ShardTensor at most this times compiled torch
VARIANTS = ("torch", "shardtensor")
GRAPH_BATCH = 1
# The FNO's 12 modes per dim need 24 points along each (``FNO._check_input``).
MIN_TILE = {"fno": 24}


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active, by overload name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


# --------------------------------------------------------------------------- inputs
def _field(world: int, tile: int, sharded: bool, mesh) -> tuple:
    """``(1, 1, P tile, tile)`` (H split evenly) as ShardTensors, or one rank's tile."""
    rows = tile * (world if sharded else 1)
    whole = torch.randn(1, 1, rows, tile, generator=torch.Generator().manual_seed(0))
    if not sharded:
        return (whole,)
    rank = dist.get_rank()
    local = whole[:, :, rank * tile : (rank + 1) * tile].contiguous()
    return (ShardTensor.from_local(local, mesh, [Shard(2)], {0: (tile,) * world}),)


def _graph(world: int, nodes: int, sharded: bool, mesh) -> tuple:
    """A Delaunay mesh of ``P nodes`` points partitioned by METIS into ShardTensors, or a
    plain one of ``nodes`` points: ``(node features, edge features, edge index)``."""
    points = nodes * (world if sharded else 1)
    positions, edge_index = _mesh_graph(points)
    generator = torch.Generator().manual_seed(1)
    node_features = torch.randn(points, GRAPH_BATCH, 3, generator=generator)
    edge_features = torch.randn(edge_index.shape[1], GRAPH_BATCH, 3, generator=generator)
    if not sharded:
        return node_features, edge_features, edge_index
    parts = partition_nodes(edge_index, points, world, method="metis", coordinates=positions)
    partition = GraphPartition.build(edge_index, parts, world)
    rank = dist.get_rank()
    node_start, edge_start = (sum(s[:rank]) for s in (partition.node_sizes, partition.edge_sizes))
    node_rows = slice(node_start, node_start + partition.node_sizes[rank])
    edge_rows = slice(edge_start, edge_start + partition.edge_sizes[rank])

    def shard(t: torch.Tensor, dim: int, sizes) -> ShardTensor:
        return ShardTensor.from_local(t.contiguous(), mesh, [Shard(dim)], {0: sizes})

    return (
        shard(node_features[partition.node_order][node_rows], 0, partition.node_sizes),
        shard(edge_features[partition.edge_order][edge_rows], 0, partition.edge_sizes),
        shard(partition.edge_index[:, edge_rows], 1, partition.edge_sizes),
    )


class TrainingStep:
    """This rank's training step of a zoo model (``benchmarks.compile.CASES``): a call makes
    one step and returns its output, detached; ``model`` then holds the step's gradients."""

    def __init__(self, model: nn.Module, run: Callable[..., torch.Tensor], args: tuple) -> None:
        self.model, self.run, self.args = model, run, args

    def step(self) -> torch.Tensor:
        self.model.zero_grad(set_to_none=True)
        out = self.run(*self.args)
        loss = (out * out).mean()
        if isinstance(loss, ShardTensor):
            loss = loss.full_tensor()
        loss.backward()
        return out.detach()

    __call__ = step


def training_step(
    name: str, sharded: bool, tile: int, nodes: int, compiled: nn.Module | None = None
) -> TrainingStep:
    """This rank's step of the zoo model ``name``; with ``compiled`` (a
    ``CompileCounterWithBackend``), of the model ``torch.compile``'d by it."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    model: nn.Module = CASES[name].build()
    mesh = None
    if sharded:
        full = get_mesh((1, world), ("dp", "domain"))
        model = domain_parallel(model, full, dp_axis="dp", domain_axes=["domain"])
        mesh = full["domain"]
    run = model if compiled is None else torch.compile(model, backend=compiled)
    if name == "meshgraphnet":
        args = _graph(world, nodes, sharded, mesh)
    else:
        args = _field(world, max(tile, MIN_TILE.get(name, 0)), sharded, mesh)
    return TrainingStep(model, run, args)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, ShardTensor) else t


def _values(step: TrainingStep, out: torch.Tensor) -> dict[str, torch.Tensor]:
    """A step's output and its model's gradients, whole."""
    return {"out": _whole(out)} | {
        name: _whole(p.grad) for name, p in step.model.named_parameters() if p.grad is not None
    }


def _largest_difference(found: dict, reference: dict) -> float:
    """The largest difference of a step's ``_values`` from ``reference``'s (an eager step of
    the same model on the same data), each relative to the reference's largest magnitude."""
    if found.keys() != reference.keys():
        return float("inf")  # a gradient missing on one side
    return max(
        ((found[k] - reference[k]).abs().max() / reference[k].abs().max().clamp_min(1e-30)).item()
        for k in reference
    )


# --------------------------------------------------------------------------- rank body
def time_variants(name: str, rounds: int, steps: int, tile: int, nodes: int) -> dict:
    """Rank body: per variant, every timed step's (wall, CPU) seconds and one step's ops."""
    torch.set_num_threads(1)
    runs = {v: training_step(name, v == "shardtensor", tile, nodes) for v in VARIANTS}
    ops = {}
    for variant, step in runs.items():
        step()  # warm-up: caches, first-call planning
        with _OpCounter() as counter:
            step()
        ops[variant] = counter.ops
    with tally_paths() as tally:
        runs["shardtensor"]()
    paths = {
        path: {
            "ops": tally.ops[path],
            "outermost": tally.outermost[path],
            "us_per_op": round(tally.seconds[path] / max(tally.outermost[path], 1) * 1e6, 1),
        }
        for path in sorted(tally.ops)
    }
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    wall = interleaved_steps(list(VARIANTS), rounds, lambda v: _timed(runs[v], steps, cpu[v]))
    return {"wall": wall, "cpu": cpu, "ops": {v: dict(c) for v, c in ops.items()}, "paths": paths}


def _timed(step: Callable[[], None], steps: int, cpu: list[float]) -> list[float]:
    """Wall seconds of ``steps`` steps (``timed_steps``); their CPU seconds go to ``cpu``."""
    walls, cpus = timed_steps(step, steps)
    cpu += cpus
    return walls


def time_compiled(name: str, rounds: int, steps: int, tile: int, nodes: int, backend: str) -> dict:
    """Rank body: both variants ``torch.compile``'d with ``backend`` and traced through
    ShardTensors; per variant every timed step's (wall, CPU) seconds, the frames compiled and
    graph breaks met by the two untimed steps, the frames compiled during the timed ones, and
    how far the second untimed step's output and gradients are from an eager step's."""
    torch.set_num_threads(1)
    reference = {}
    for v in VARIANTS:
        eager = training_step(name, v == "shardtensor", tile, nodes)
        reference[v] = _values(eager, eager())
    counters = {v: torch._dynamo.testing.CompileCounterWithBackend(backend) for v in VARIANTS}
    runs = {
        v: training_step(name, v == "shardtensor", tile, nodes, compiled=counters[v])
        for v in VARIANTS
    }
    breaks: dict[str, Counter[str]] = {}
    difference = {}
    for v, step in runs.items():
        torch._dynamo.utils.counters["graph_break"].clear()
        step()  # compiles
        out = step()  # a step after the first, which some guards (grads set) differ from
        breaks[v] = Counter(torch._dynamo.utils.counters["graph_break"])
        difference[v] = _largest_difference(_values(step, out), reference[v])
    frames = {v: counters[v].frame_count for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    wall = interleaved_steps(list(VARIANTS), rounds, lambda v: _timed(runs[v], steps, cpu[v]))
    recompiled = {v: counters[v].frame_count - frames[v] for v in VARIANTS}
    return {
        "wall": wall,
        "cpu": cpu,
        "frames": frames,
        "recompiled": recompiled,
        "graph_breaks": {v: sum(b.values()) for v, b in breaks.items()},
        "break_reasons": {v: sorted(b)[:3] for v, b in breaks.items()},
        "difference": difference,
    }


# --------------------------------------------------------------------------- reporting
def report(name: str, world: int, args: argparse.Namespace) -> dict[str, float]:
    """Emit one ``host_overhead`` record; return its ratio and µs per op."""
    per_rank = on_ranks(world, time_variants, name, args.rounds, args.steps, args.tile, args.nodes)
    wall = {v: [max(s) for s in zip(*(r["wall"][v] for r in per_rank))] for v in VARIANTS}
    cpu = {v: [max(s) for s in zip(*(r["cpu"][v] for r in per_rank))] for v in VARIANTS}
    ops = {v: sum(per_rank[0]["ops"][v].values()) for v in VARIANTS}
    collectives = sum(
        n for op, n in per_rank[0]["ops"]["shardtensor"].items() if op.startswith("c10d")
    )
    median = {v: spread(wall[v])["median"] for v in VARIANTS}
    ratio = median["shardtensor"] / median["torch"]
    added_us = (median["shardtensor"] - median["torch"]) / ops["shardtensor"] * 1e6
    # The spread of the ratio: per round, the ratio of that round's steps.
    ratios = sorted(s / t for s, t in zip(wall["shardtensor"], wall["torch"]))
    emit(
        "host_overhead",
        model=name,
        description=CASES[name].describe.split(",")[0],
        ranks=world,
        per_rank=f"{args.nodes} nodes"
        if name == "meshgraphnet"
        else f"{max(args.tile, MIN_TILE.get(name, 0))}²",
        wall_s={v: spread(wall[v], 5) for v in VARIANTS},
        cpu_s={v: spread(cpu[v], 5) for v in VARIANTS},
        ops_per_step=ops,
        collectives_per_step=collectives,
        ratio=round(ratio, 2),
        ratio_spread=spread(ratios, 2),
        added_us_per_op=round(added_us, 1),
        added_us_per_plain_op=round(added_us * ops["shardtensor"] / ops["torch"], 1),
        us_per_op={v: round(median[v] / ops[v] * 1e6, 1) for v in VARIANTS},
        paths=per_rank[0]["paths"],
    )
    return {
        "ratio": round(ratio, 2),
        "paths": per_rank[0]["paths"],
        "added_us_per_op": round(added_us, 1),
        "ops": ops,
        "step_s": median,
    }


def report_compiled(name: str, world: int, args: argparse.Namespace) -> dict[str, float]:
    """Emit one ``host_overhead_compiled`` record; return its ratio and step medians."""
    per_rank = run_on_ranks(
        world,
        time_compiled,
        *(name, args.rounds, args.steps, args.tile, args.nodes, args.compiled),
        timeout_s=RANK_TIMEOUT_S,  # compiling takes minutes on a busy machine
    )
    wall = {v: [max(s) for s in zip(*(r["wall"][v] for r in per_rank))] for v in VARIANTS}
    cpu = {v: [max(s) for s in zip(*(r["cpu"][v] for r in per_rank))] for v in VARIANTS}
    median = {v: spread(wall[v])["median"] for v in VARIANTS}
    ratio = median["shardtensor"] / median["torch"]
    emit(
        "host_overhead_compiled",
        model=name,
        ranks=world,
        backend=args.compiled,
        wall_s={v: spread(wall[v], 5) for v in VARIANTS},
        cpu_s={v: spread(cpu[v], 5) for v in VARIANTS},
        ratio=round(ratio, 2),
        ratio_spread=spread(sorted(s / t for s, t in zip(wall["shardtensor"], wall["torch"])), 2),
        cpu_ratio=round(spread(cpu["shardtensor"])["median"] / spread(cpu["torch"])["median"], 2),
        frames=per_rank[0]["frames"],
        graph_breaks={v: max(r["graph_breaks"][v] for r in per_rank) for v in VARIANTS},
        break_reasons=per_rank[0]["break_reasons"],
        recompiled_while_timed={v: max(r["recompiled"][v] for r in per_rank) for v in VARIANTS},
        max_rel_diff_from_eager={
            v: float(f"{max(r['difference'][v] for r in per_rank):.2e}") for v in VARIANTS
        },
    )
    return {"ratio": round(ratio, 2), "step_s": median}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = list(CASES)
    parser.add_argument("--models", nargs="+", default=names, choices=names)
    parser.add_argument("--worlds", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per variant per round")
    parser.add_argument("--tile", type=int, default=16, help="H = W per rank of a field")
    parser.add_argument("--nodes", type=int, default=64, help="graph nodes per rank")
    parser.add_argument(
        "--compiled",
        choices=["aot_eager", "inductor"],
        help="also time both steps torch.compile'd with this backend, traced through ShardTensors",
    )
    args = parse_arguments(parser, argv)
    summary: dict[str, dict] = {}
    goals = []
    with rank_pools():
        for name in args.models:
            for world in args.worlds:
                result = report(name, world, args)
                summary[f"{name}_{world}"] = result
                goals.append(
                    Goal(
                        f"{name} on {world} rank(s): ShardTensor step at most {GOAL_RATIO}x "
                        "plain torch's",
                        result["ratio"] <= GOAL_RATIO,
                    )
                )
                if args.compiled:
                    result = report_compiled(name, world, args)
                    summary[f"{name}_{world}_compiled"] = result
                    goals.append(
                        Goal(
                            f"{name} on {world} rank(s), {args.compiled}: compiled ShardTensor "
                            f"step at most {COMPILED_GOAL_RATIO}x compiled plain torch's",
                            result["ratio"] <= COMPILED_GOAL_RATIO,
                        )
                    )
    emit_summary(
        goals,
        args.check,
        **summary,
    )


if __name__ == "__main__":
    main()
