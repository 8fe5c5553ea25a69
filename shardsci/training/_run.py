"""What every rank of a run sets up first: process group, the run's mesh from its plan, run
directory, seed; and the data preparation that one rank does while the others wait."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from shardsci.distributed import (
    LaunchEnv,
    device_for_local_rank,
    explain_timeout,
    init_distributed,
    is_collective_timeout,
)
from shardsci.training._parallelism import Parallelism, ParallelPlan
from shardsci.training._recipes import Recipe

__all__ = ["RunContext", "prepare_data", "start_run"]


@dataclass(frozen=True)
class RunContext:
    """This rank's place in a run.

    Attributes
    ----------
    env : LaunchEnv
        Rank, world size, launcher.
    parallelism : Parallelism
        The run's DeviceMesh and what its axes do (NOTE [A run is planned once]).
    run_dir : Path
        One directory for every rank of the run (created by the leader).
    device : torch.device
        Where this rank's model and batches live (its GPU, the CPU, or ``meta`` in a dry run).
    """

    env: LaunchEnv
    parallelism: Parallelism
    run_dir: Path
    device: torch.device

    @property
    def leader(self) -> bool:
        """True on exactly one rank (global rank 0): it writes files and prints."""
        return self.env.rank == 0


@contextlib.contextmanager
def start_run(cfg: DictConfig, plan: ParallelPlan) -> Iterator[RunContext]:
    """Join the run's process group and build the mesh of ``plan`` (NOTE [A run is planned
    once]).

    Seeds torch with ``cfg.train.seed``. On a normal exit every rank waits for the others and
    leaves the process group; on an exception it leaves at once, so that the launcher sees the
    failure and stops the other ranks instead of this one waiting in a collective. A
    collective that timed out becomes a ``CollectiveTimeout`` naming the collective and the
    ranks that stopped participating (NOTE [A rank that stops participating]).
    """
    env = init_distributed(timeout_s=cfg.launcher.timeout_s)
    device = device_for_local_rank(env)
    parallelism = Parallelism.build(plan, device_type=device.type)
    context = RunContext(env, parallelism, Path(cfg.run_dir), device)
    if context.leader:
        context.run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.train.seed)
    try:
        yield context
    except RuntimeError as error:
        if is_collective_timeout(error):
            raise explain_timeout(error, cfg.launcher.timeout_s) from error
        raise
    dist.barrier()
    dist.destroy_process_group()


def prepare_data(recipe: Recipe, cfg: DictConfig) -> None:
    """Run the recipe's data preparation (``Recipe.prepare``: generating a missing file, say)
    on global rank 0 while every other rank waits for it; nothing without one."""
    prepare = recipe.load_prepare()
    if prepare is None:
        return
    if dist.get_rank() == 0:
        prepare(cfg)
    dist.barrier()
