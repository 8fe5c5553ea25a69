"""The dry run steps with the trainer's step (NOTE [One training step]).

On 2 data-parallel gloo ranks, one ``Trainer._optimiser_step`` and one step as the dry run
simulates it (``planned_step``), from the same parameters on the same batches, must leave the
same parameters bit for bit. The step clips gradients hard, so a step that forgot to clip, scaled
its loss, or skipped the gradient reduction would differ.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

import shardsci.planning._dry_run as dry_run
from shardsci.distributed import detect_launch_env
from shardsci.testing import run_on_ranks
from shardsci.training import (
    ParallelConfig,
    Parallelism,
    ParallelPlan,
    RunConfig,
    RunContext,
    StopRequests,
    Trainer,
    _trainer,
    instantiate,
    parallelize,
    training_step,
)

CPU = torch.device("cpu")


class _Regression:
    """A ``Task``: this replica's rows of a fixed random linear regression batch."""

    cells_per_sample = 1

    def __init__(self, rank: int) -> None:
        generator = torch.Generator().manual_seed(7)
        inputs = torch.randn(2, 4, 3, generator=generator, dtype=torch.float64)
        self.inputs, self.targets = inputs[rank], inputs[rank].flip(1) * 3

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs, self.targets

    def losses(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        inputs, targets = batch
        return {"y": F.mse_loss(model(inputs), targets)}

    def evaluate(self, model: nn.Module, step: int) -> dict[str, float]:
        return {}

    def describe(self, metrics: Mapping[str, Any]) -> str:
        return ""


def _both_steps(run_dir: str) -> list[list[torch.Tensor]]:
    """Parameters before any step, after the trainer's step and after the dry run's."""
    cfg = OmegaConf.structured(RunConfig)
    cfg.merge_with(
        {
            "run_dir": run_dir, "mesh": "2", "logger": {"kind": "none"},
            "optim": {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 0.1},
            "train": {"steps": 1, "grad_clip": 1e-3, "schedule": {"warmup_steps": 0}},
        }
    )  # fmt: skip
    parallelism = Parallelism.build(ParallelPlan.of("2", ParallelConfig(), ("H",)), "cpu")
    run = RunContext(detect_launch_env(), parallelism, Path(run_dir), CPU)
    task = _Regression(parallelism.dp_rank)
    models = []
    for _ in range(3):
        torch.manual_seed(0)
        models.append(nn.Linear(3, 3).double())
    trainer = Trainer(run, cfg, models[1], task)
    with StopRequests() as requests:
        trainer._optimiser_step(requests)
    planned = parallelize(models[2], parallelism, trainer.config.dp_mode)
    optimizer = instantiate(cfg.optim)(planned.parameters())
    dry_run.planned_step(planned, optimizer, task, trainer.config, CPU)()
    return [[p.detach().clone() for p in model.parameters()] for model in models]


def test_the_dry_run_takes_the_trainers_step(tmp_path: Path) -> None:
    assert dry_run.training_step is _trainer.training_step is training_step
    for start, trained, planned in run_on_ranks(2, _both_steps, str(tmp_path)):
        for before, a, b in zip(start, trained, planned):
            assert torch.equal(a, b)
            assert not torch.equal(a, before)
