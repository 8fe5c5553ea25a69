"""A dry run's plan for people (a text report) and for programs (``dry_run.json``)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shardsci.planning._plan import LayerPlan, RankClassPlan, RunPlan

__all__ = ["PLAN_FILE", "bytes_text", "format_plan", "write_plan"]

PLAN_FILE = "dry_run.json"
"""The dry run's plan, written as JSON in the run directory."""


def write_plan(plan: RunPlan, run_dir: Path, choice: Mapping[str, Any] | None = None) -> Path:
    """Write ``plan`` as JSON to ``run_dir/dry_run.json``, with parallel=auto's ranked
    candidates under ``"choice"`` when it chose (``Choice.as_dict``); returns the path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / PLAN_FILE
    written = plan.as_dict() if choice is None else {**plan.as_dict(), "choice": dict(choice)}
    path.write_text(json.dumps(written, indent=2) + "\n")
    return path


def bytes_text(n: float) -> str:
    """``1536 -> "1.50 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def format_plan(plan: RunPlan) -> str:
    """The report printed by a dry run."""
    lines = [
        f"dry run of recipe {plan.recipe} on mesh {plan.mesh} ({plan.world_size} ranks: "
        f"{plan.axes})",
        f"model {plan.model}, {plan.parameters:,} parameters; {plan.samples_per_replica} "
        f"sample(s) per data-parallel replica; {len(plan.classes)} rank class(es), "
        f"{plan.simulated_ranks} simulated in {plan.wall_s:.1f} s ({plan.cpu_s:.1f} s CPU)",
    ]
    for number, rank_class in enumerate(plan.classes, start=1):
        lines += ["", *_class_lines(number, rank_class)]
    reduction = plan.gradient_reduction
    if reduction is not None and reduction.ranks > 1:
        lines += [
            "",
            f"gradient reduction ({reduction.mode}; summed over the domain, averaged over "
            f"{reduction.replicas} replica(s); {reduction.ranks} ranks per group): "
            f"{bytes_text(reduction.gradient_bytes)} of gradients"
            + (
                f" in {reduction.buckets} bucket(s), {bytes_text(reduction.bucket_memory)} in "
                f"all, one grad_all_reduce each"
                if reduction.buckets
                else ""
            ),
        ]
    if plan.layers:
        lines += ["", *_layer_table(plan.layers, plan.classes[0] if plan.classes else None)]
        lines += ["", *_gather_lines(plan.layers)]
    for note in plan.notes:
        lines += [f"note: {note}"]
    if plan.problems:
        lines += ["", "PROBLEMS:"] + [f"  - {problem}" for problem in plan.problems]
    else:
        lines += ["", "no problems found"]
    return "\n".join(lines)


def _class_lines(number: int, plan: RankClassPlan) -> list[str]:
    memory = plan.memory
    examples = ", ".join(map(str, plan.members[:8])) + (", ..." if plan.ranks > 8 else "")
    lines = [
        f"rank class {number}: {plan.ranks} rank(s) like rank {plan.representative} "
        f"(coordinate {tuple(plan.coordinate)}; ranks {examples})",
        f"  memory: parameters {bytes_text(memory.parameters)}, gradients "
        f"{bytes_text(memory.gradients)}, optimiser {bytes_text(memory.optimizer)}, gradient "
        f"buckets {bytes_text(memory.grad_buckets)}, batch "
        f"{bytes_text(memory.batch)}, peak activations {bytes_text(memory.peak_activations)}; "
        f"peak {bytes_text(memory.peak)} in the {memory.peak_at}",
        "  collectives per step: "
        + (
            "; ".join(
                f"{kind} {figures.calls} calls, {bytes_text(figures.sent)} sent, "
                f"{bytes_text(figures.received)} received"
                for kind, figures in plan.collectives.items()
            )
            or "none"
        ),
    ]
    return lines


def _layer_table(layers: Sequence[LayerPlan], first: RankClassPlan | None) -> list[str]:
    header = (
        "layer",
        "type",
        "output",
        "placements",
        "shards",
        "local",
        "fwd comm",
        "bwd comm",
        "redistributions",
    )
    rows = [header]
    for layer in layers:
        local = (
            first.local_shapes.get(layer.name if layer.name != "(model)" else "") if first else None
        )
        rows.append(
            (
                layer.name,
                layer.kind,
                _shape(layer.shape),
                layer.placements,
                " ".join(f"d{dim}:{sizes}" for dim, sizes in layer.sizes.items()) or "-",
                _shape(local),
                _traffic(layer.forward),
                _traffic(layer.backward),
                "; ".join(layer.redistributions) or "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return [
        "per layer (local shapes and traffic of rank class 1; bytes sent):",
        *("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows),
    ]


def _gather_lines(layers: Sequence[LayerPlan]) -> list[str]:
    """Per layer, the gathers its ops made without being asked: the same on every rank, since
    the guard decides from global layouts (NOTE [Gathers an op was not asked to make])."""
    found = [(layer, text) for layer in layers for text in layer.gathers]
    if not found:
        return ["gathers: none (no op gathered a sharded tensor that it was not asked to)"]
    return [
        f"gathers: {len(found)} kind(s) of gather an op made without being asked; "
        f"shardsci.gather_policy('error') or SHARDSCI_GATHER=error refuses them:",
        *(f"  {layer.name} ({layer.kind}): {text}" for layer, text in found),
    ]


def _shape(shape: Sequence[int] | None) -> str:
    return "x".join(map(str, shape)) if shape else "-"


def _traffic(kinds: dict[str, list[int]]) -> str:
    return (
        " ".join(f"{kind}:{calls}/{bytes_text(sent)}" for kind, (calls, sent) in kinds.items())
        or "-"
    )
