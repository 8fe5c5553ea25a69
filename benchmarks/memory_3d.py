"""Memory that scales: the largest 3-D field that trains, and that predicts, within a per-rank
budget on 1, 2, 4 and 8 ranks, with each rank's peak memory against whole/N.

The cfd3d recipe's model as ``+recipe=cfd3d`` composes it (``--model fno``, the recipe's
default: FNO 3-D, 8 modes per dim, width 16; or ``--model unet``), on one ``(1, 3, N, N, N)``
float32 velocity field drawn by the recipe's ``random_velocity`` block by block (no rank holds
more than its block; the target is a second such field). Two steps, each in freshly started
rank processes, one thread per rank:

- **train**: the trainer's own ``training_step`` (forward, MSE loss, backward, the recipe's
  AdamW step, which creates the optimiser state), the model wrapped by ``domain_parallel``;
- **predict**: one forward pass under ``no_grad`` in eval mode, as ``shardsci-predict`` runs it.

Decompositions: 1 rank plain tensors; 2 ranks a slab (D split 2 ways); 4 a pencil (D and H,
2x2); 8 a 2x2x2 block (D, H, W), every split even when N is.

Memory is the **peak resident set size** of each rank process (``ru_maxrss``) minus its RSS
when the rank body starts (the interpreter and torch already imported), so it counts the model,
the fields, the activations, the gradients, the optimiser state and the allocator's retained
blocks on this CPU. ``whole/N`` is the 1-rank peak at the same N divided by the rank count
(the 1-rank reference is run at every N another rank count visits, over the budget or not).

Goals (``--check``), for each step kind: every rank count's result agrees with one process
(train: the loss and every parameter's gradient norm; predict: the output's norm, summed in
float64; ``max_rel_difference`` at most ``AGREEMENT``), and every rank's peak is at most
``GOAL_FACTOR`` x (whole/N) + the bytes of the parameters and of the optimiser state (AdamW's
two moments and step counts; none for predict), at every N measured.

The budget search: for each step kind and rank count, the sizes of ``--sizes`` in increasing
order until the first whose largest per-rank peak exceeds ``--budget-gib`` (detected from the
measured peak, nothing is made to crash); the largest N that fit is reported (``largest``
records; ``first_over`` null when every listed size fit).

Run ``python -m benchmarks.memory_3d [--budget-gib 0.5] [--sizes 32 48 64 ...] [--ranks 1 2 4 8]
[--steps train predict] [--model fno] [--check]``.
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from torch.distributed.tensor import Shard

import shardsci.train  # noqa: F401  registers the schemas, the resolvers and the recipes
from benchmarks._common import (
    Goal,
    emit,
    emit_summary,
    on_ranks,
    parse_arguments,
    rank_pools,
    restart_pools,
    rss_bytes,
)
from shardsci import ShardTensorSpec
from shardsci._commands import CONFIG_MODULE
from shardsci.parallel import domain_parallel
from shardsci.recipes.cfd3d.navier_stokes import SolverConfig, random_velocity
from shardsci.testing import get_mesh
from shardsci.training import Precision, instantiate, plain, training_step, whole_tensor

AGREEMENT = 1e-4  # float32: the loss, gradient and output norms, summed in another order
GOAL_FACTOR = 1.3  # per-rank peak <= GOAL_FACTOR * whole/N + parameters + optimiser state
DECOMPOSITIONS = {
    1: ("plain tensors", (), ()),
    2: ("slab (D)", (2,), ("domain_d",)),
    4: ("pencil 2x2 (D, H)", (2, 2), ("domain_d", "domain_h")),
    8: ("block 2x2x2 (D, H, W)", (2, 2, 2), ("domain_d", "domain_h", "domain_w")),
}
STEPS = ("train", "predict")


class _OneBatch:
    """The ``Task`` of one training step: the recipe's loss (MSE) on one ``(x, y)`` pair."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.inputs, self.targets = inputs, targets

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs, self.targets

    def losses(self, model, batch):
        inputs, targets = batch
        return {"velocity": F.mse_loss(model(inputs).float(), targets)}


def step_memory(n: int, step: str, model_config: dict, optim_config: dict) -> dict:
    """Rank body: one ``step`` ("train" or "predict") on an N³ field; peak RSS over the
    body's start, the step's wall and CPU seconds, what the agreement compares, and the
    parameters' and optimiser state's bytes."""
    start_rss = rss_bytes()
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = instantiate(OmegaConf.create(model_config))
    config = SolverConfig(resolution=n, precision="float32")
    layout = None
    if world > 1:
        _, shape, names = DECOMPOSITIONS[world]
        mesh = get_mesh(shape, names)
        placements = [Shard(2 + i) for i in range(len(shape))]
        layout = ShardTensorSpec.build(mesh, placements, (1, 3, n, n, n), torch.float32)
        if step == "train":
            model = domain_parallel(model, mesh, domain_axes=list(names))
    inputs, targets = (
        random_velocity(config, 1, torch.Generator().manual_seed(seed), layout) for seed in (0, 1)
    )
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    optimizer_bytes, compared = 0, []
    if step == "train":
        optimizer = instantiate(OmegaConf.create(optim_config))(model.parameters())
        terms = training_step(
            model,
            optimizer,
            _OneBatch(inputs, targets),
            0,
            Precision.fp32,
            None,
            torch.device("cpu"),
        )
        compared = [terms["velocity"].item()] + [p.grad.norm().item() for p in model.parameters()]
        optimizer_bytes = sum(
            t.numel() * t.element_size()
            for state in optimizer.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor)
        )
    else:
        model.eval()
        with torch.no_grad():
            # Summed in float64: a float32 norm of a 128³ field is off by about 2e-4
            # on one process alone, more than AGREEMENT.
            compared = [whole_tensor(model(inputs).double().norm()).item()]
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {
        "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - start_rss,
        "wall_s": wall,
        "cpu_s": cpu,
        "compared": compared,
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "optimizer_bytes": optimizer_bytes,
        "local_shape": list(inputs.to_local().shape if layout else inputs.shape),
    }


def recipe_configs(model: str) -> tuple[dict, dict]:
    """The model and optimiser configs of ``+recipe=cfd3d model=<model>``, as plain dicts."""
    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        cfg = compose("config", overrides=["+recipe=cfd3d", f"model={model}"])
    return plain(cfg.model), plain(cfg.optim)


def _relative_difference(one: list[float], many: list[dict]) -> float:
    return max(
        abs(a - b) / max(abs(a), 1e-30)
        for r in many
        for a, b in zip(one, r["compared"], strict=True)
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 48, 64, 96, 128, 160])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    parser.add_argument("--budget-gib", type=float, default=0.5)
    parser.add_argument("--model", choices=["fno", "unet"], default="fno")
    args = parse_arguments(parser, argv)
    if bad := sorted(set(args.ranks) - set(DECOMPOSITIONS)):
        parser.error(f"--ranks must be among {sorted(DECOMPOSITIONS)}, got {bad}")
    model_config, optim_config = recipe_configs(args.model)
    budget = args.budget_gib * 2**30
    runs: dict[tuple[str, int, int], list[dict]] = {}

    def measured(step: str, world: int, n: int) -> list[dict]:
        if (step, world, n) not in runs:
            restart_pools()  # fresh processes: ru_maxrss is a lifetime peak
            runs[step, world, n] = on_ranks(world, step_memory, n, step, model_config, optim_config)
        return runs[step, world, n]

    goals, largest = [], []
    with rank_pools():
        for step in args.steps:
            worst_ratio, worst_difference, within = 0.0, 0.0, True
            for world in sorted(args.ranks):
                fits, over = None, None
                for n in sorted(args.sizes):
                    per_rank = measured(step, world, n)
                    one = measured(step, 1, n)[0]
                    peak = max(r["peak_bytes"] for r in per_rank)
                    replicated = per_rank[0]["parameter_bytes"] + per_rank[0]["optimizer_bytes"]
                    ideal = one["peak_bytes"] / world
                    bound = GOAL_FACTOR * ideal + replicated
                    difference = _relative_difference(one["compared"], per_rank)
                    worst_difference = max(worst_difference, difference)
                    worst_ratio = max(worst_ratio, (peak - replicated) / ideal)
                    within = within and peak <= bound
                    emit(
                        "memory_3d",
                        step=step,
                        model=args.model,
                        size=n,
                        ranks=world,
                        decomposition=DECOMPOSITIONS[world][0],
                        local_shape=per_rank[0]["local_shape"],
                        memory_measure="peak RSS minus RSS at start, per rank process",
                        peak_bytes=[r["peak_bytes"] for r in per_rank],
                        whole_over_n_bytes=int(ideal),
                        parameter_bytes=per_rank[0]["parameter_bytes"],
                        optimizer_bytes=per_rank[0]["optimizer_bytes"],
                        bound_bytes=int(bound),
                        within_bound=peak <= bound,
                        ratio_to_whole_over_n=round(peak / ideal, 3),
                        goal_ratio=round((peak - replicated) / ideal, 3),
                        within_budget=peak <= budget,
                        compared=per_rank[0]["compared"][0],
                        max_rel_difference=difference,
                        wall_s=round(max(r["wall_s"] for r in per_rank), 2),
                        cpu_s=round(max(r["cpu_s"] for r in per_rank), 2),
                        load_average=round(os.getloadavg()[0], 1),
                    )
                    if peak > budget:
                        over = (n, peak)
                        break
                    fits = (n, peak)
                record = {
                    "step": step,
                    "ranks": world,
                    "largest_size": fits and fits[0],
                    "largest_peak_gib": fits and round(fits[1] / 2**30, 3),
                    "first_over": over and over[0],
                    "first_over_peak_gib": over and round(over[1] / 2**30, 3),
                }
                largest.append(record)
                emit("largest", budget_gib=args.budget_gib, model=args.model, **record)
            ranks = ", ".join(str(w) for w in sorted(args.ranks) if w > 1) or "no other"
            goals += [
                Goal(
                    f"{step}: {ranks} ranks agree with 1 rank to {AGREEMENT:g}",
                    worst_difference <= AGREEMENT,
                ),
                Goal(
                    f"{step}: per-rank peak at most {GOAL_FACTOR:g}x (whole/N) + parameters "
                    "and optimiser state at every N measured",
                    within,
                ),
            ]
            emit(
                "step_summary",
                step=step,
                max_rel_difference=worst_difference,
                goal_ratio=round(worst_ratio, 3),
            )
    emit_summary(
        goals,
        args.check,
        model=args.model,
        budget_gib=args.budget_gib,
        largest=largest,
    )


if __name__ == "__main__":
    main()
