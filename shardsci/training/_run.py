"""What every rank of a training run sets up first: process group, mesh, run directory, seed."""

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
from shardsci.training._layout import ParallelConfig, ParallelLayout
from shardsci.training._schema import config_from

__all__ = ["RunContext", "start_run"]


@dataclass(frozen=True)
class RunContext:
    """This rank's place in a run.

    Attributes
    ----------
    env : LaunchEnv
        Rank, world size, launcher.
    layout : ParallelLayout
        The mesh and the roles of its axes.
    run_dir : Path
        One directory for every rank of the run (created by the leader).
    """

    env: LaunchEnv
    layout: ParallelLayout
    run_dir: Path

    @property
    def device(self) -> torch.device:
        return self.layout.device

    @property
    def leader(self) -> bool:
        """True on exactly one rank (global rank 0): it writes files and prints."""
        return self.env.rank == 0


@contextlib.contextmanager
def start_run(cfg: DictConfig) -> Iterator[RunContext]:
    """Join the run's process group and build its mesh (``cfg.mesh``, ``cfg.parallel``).

    Seeds torch with ``cfg.train.seed``. On a normal exit every rank waits for the others and
    leaves the process group; on an exception it leaves at once, so that the launcher sees the
    failure and stops the other ranks instead of this one waiting in a collective. A
    collective that timed out becomes a ``CollectiveTimeout`` naming the collective and the
    ranks that stopped participating (NOTE [A rank that stops participating]).
    """
    env = init_distributed(timeout_s=cfg.launcher.timeout_s)
    device = device_for_local_rank(env)
    parallel = config_from(ParallelConfig, cfg.parallel)
    layout = ParallelLayout.build(str(cfg.mesh), parallel, device_type=device.type)
    context = RunContext(env, layout, Path(cfg.run_dir))
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
