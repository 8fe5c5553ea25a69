"""The CFD recipe: learn the next vorticity field of 2-D Navier-Stokes, domain-parallel.

Every rank runs ``run(cfg)``. The mesh (``cfg.mesh``) puts data parallelism on one axis (DDP
or FSDP2 over the ``dp`` group) and splits the fields' H (and W) over the others: each rank
reads only its slab of every sample from HDF5 and the plain ``models.UNet`` runs on
ShardTensors. Every ``eval_every`` steps: the held-out one-step relative L2 error, a rollout,
a PNG; every ``checkpoint_every`` steps a checkpoint that resumes on any mesh; at the end
``metrics.json`` in the run directory.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn

from recipes.cfd.data import CFDData
from recipes.cfd.evaluate import relative_l2, rollout_errors
from recipes.cfd.plots import save_comparison
from shardsci import ShardTensor
from shardsci.checkpoint import load_checkpoint, resolve_resume, save_checkpoint
from shardsci.distributed import device_for_local_rank, init_distributed
from shardsci.parallel import parallelize
from shardsci.training import (
    MetricLogger,
    ParallelConfig,
    ParallelLayout,
    Progress,
    ScheduleConfig,
    warmup_cosine,
)

__all__ = ["run"]


def run(cfg: DictConfig) -> dict[str, float]:
    """Train on this rank's part of the mesh; returns the final metrics (on every rank)."""
    env = init_distributed(timeout_s=cfg.launcher.timeout_s)
    metrics = _Run(cfg, device_for_local_rank(env)).train()
    # Only on success: a rank that failed must not wait in a collective, but exit, so that the
    # launcher stops the others.
    dist.barrier()
    dist.destroy_process_group()
    return metrics


class _Run:
    def __init__(self, cfg: DictConfig, device: torch.device):
        self.cfg = cfg
        self.train_cfg = cfg.train
        self.device = device
        self.layout = ParallelLayout.build(
            str(cfg.mesh),
            ParallelConfig(**OmegaConf.to_container(cfg.parallel, resolve=True)),
            device_type=device.type,
        )
        self.leader = dist.get_rank() == 0
        self.run_dir = Path(cfg.run_dir)
        if self.leader:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(self.train_cfg.seed)
        self.data = CFDData(cfg.data, self.layout, self.train_cfg, device)
        self.model = hydra.utils.instantiate(cfg.model, _convert_="all").to(device)
        self.trained = self._parallel(self.model)
        self.optimizer = hydra.utils.instantiate(cfg.optim)(self.trained.parameters())
        schedule = ScheduleConfig(**OmegaConf.to_container(self.train_cfg.schedule))
        self.scheduler = warmup_cosine(self.optimizer, schedule, self.train_cfg.steps)
        self.step = self._resume()
        self.logger = MetricLogger(
            cfg.logger, self.run_dir, OmegaConf.to_container(cfg, resolve=True), self.leader
        )

    # ------------------------------------------------------------------ setup
    def _parallel(self, model: nn.Module) -> nn.Module:
        if self.train_cfg.parallel not in ("ddp", "fsdp2"):
            raise ValueError(
                f"train.parallel must be 'ddp' or 'fsdp2', got {self.train_cfg.parallel!r}"
            )
        return parallelize(
            model,
            self.layout.mesh,
            dp_axis=self.layout.config.data_parallel,
            domain_axes=self.layout.domain_axes,
            dp_mode=self.train_cfg.parallel,
        )

    def _resume(self) -> int:
        path = resolve_resume(self.run_dir / "checkpoints", self.train_cfg.resume)
        if path is None:
            return 0
        extra = load_checkpoint(path, self.trained, self.optimizer)
        self.scheduler.load_state_dict(extra["scheduler"])
        if self.leader:
            print(f"resumed from {path} at step {extra['step']}", flush=True)
        return int(extra["step"])

    # ------------------------------------------------------------------ training
    def train(self) -> dict[str, float]:
        progress = Progress(
            self.train_cfg.steps,
            self.step,
            self.train_cfg.global_batch * self.data.cells_per_sample,
            enabled=self.leader,
        )
        if self.leader:
            progress.write(f"mesh: {self.layout.describe()}; run directory: {self.run_dir}")
        started = time.perf_counter()
        loss = math.nan
        while self.step < self.train_cfg.steps:
            loss = self._optimiser_step()
            self.step += 1
            cells_per_s = progress.step(loss)
            if self.step % self.train_cfg.log_every == 0:
                lr = self.scheduler.get_last_lr()[0]
                self.logger.log({"loss": loss, "lr": lr, "cells_per_s": cells_per_s}, self.step)
            if self.step % self.train_cfg.eval_every == 0 and self.step < self.train_cfg.steps:
                progress.write(self._describe(self._evaluate()))
            if self.step % self.train_cfg.checkpoint_every == 0:
                self._checkpoint()
        progress.close()
        metrics = self._evaluate()
        if self.leader:
            print(self._describe(metrics), flush=True)
        metrics["train_seconds"] = time.perf_counter() - started
        metrics["final_loss"] = loss
        if self.leader:
            (self.run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        self.logger.finish()
        return metrics

    def _optimiser_step(self) -> float:
        inputs, targets = self.data.train_batch(self.step)
        with self._autocast():
            prediction = self.trained(inputs)
        loss = F.mse_loss(prediction.float(), targets)
        if isinstance(loss, ShardTensor):
            loss = loss.full_tensor()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.train_cfg.grad_clip:
            nn.utils.clip_grad_norm_(self.trained.parameters(), self.train_cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        return self._dp_mean(loss.detach())

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.train_cfg.precision == "fp32":
            return contextlib.nullcontext()
        if self.train_cfg.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        raise ValueError(
            f"train.precision must be 'fp32' or 'bf16', got {self.train_cfg.precision!r}"
        )

    def _dp_mean(self, value: torch.Tensor) -> float:
        if self.layout.dp_group is not None:
            value = value.clone()
            dist.all_reduce(value, group=self.layout.dp_group)
            value /= self.layout.dp_size
        return float(value)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def _evaluate(self) -> dict[str, float]:
        self.trained.eval()
        inputs, targets = self.data.eval_batch()
        prediction = self.model(inputs)
        errors = relative_l2(self.data.denormalize(prediction), self.data.denormalize(targets))
        persistence = relative_l2(self.data.denormalize(inputs), self.data.denormalize(targets))
        start, truths = self.data.rollout_batch(self.train_cfg.rollout_steps)
        rollout = rollout_errors(self.model, start, truths, self.data.denormalize)
        self.trained.train()
        metrics = {
            "step": self.step,
            "eval_relative_l2": self._dp_sum_mean(errors),
            "persistence_relative_l2": self._dp_sum_mean(persistence),
            **{
                f"rollout_relative_l2_step{k + 1}": self._dp_sum_mean(e)
                for k, e in enumerate(rollout)
            },
        }
        self._plot(prediction, targets, float(errors[0]) if errors.numel() else math.nan)
        self.logger.log(metrics, self.step)
        return metrics

    def _dp_sum_mean(self, errors: torch.Tensor) -> float:
        """The mean over all data-parallel ranks' samples."""
        totals = torch.stack([errors.sum(), torch.tensor(float(errors.numel()))]).double()
        if self.layout.dp_group is not None:
            dist.all_reduce(totals, group=self.layout.dp_group)
        return float(totals[0] / totals[1])

    def _plot(self, prediction: torch.Tensor, targets: torch.Tensor, error: float) -> None:
        first_prediction = self.data.denormalize(prediction[:1])
        first_truth = self.data.denormalize(targets[:1])
        if isinstance(first_prediction, ShardTensor):
            first_prediction, first_truth = (
                first_prediction.full_tensor(),
                first_truth.full_tensor(),
            )
        if self.leader:
            save_comparison(
                self.run_dir / f"eval_step{self.step:06d}.png",
                first_prediction[0, 0],
                first_truth[0, 0],
                f"step {self.step}: held-out sample, relative L2 {error:.3g}",
            )

    @staticmethod
    def _describe(metrics: dict[str, float]) -> str:
        rollout = [v for k, v in metrics.items() if k.startswith("rollout")]
        return (
            f"step {metrics['step']}: held-out relative L2 {metrics['eval_relative_l2']:.4f} "
            f"(persistence {metrics['persistence_relative_l2']:.4f}), "
            f"rollout {' '.join(f'{v:.3f}' for v in rollout)}"
        )

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint(self) -> None:
        save_checkpoint(
            self.run_dir / "checkpoints",
            self.step,
            self.trained,
            self.optimizer,
            extra={"step": self.step, "scheduler": self.scheduler.state_dict()},
        )
