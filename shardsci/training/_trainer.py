"""The training loop every recipe shares; the recipe supplies a ``Task``.

A recipe knows its data, its loss and how to judge a model; everything else is here:
data-parallel wrapping (``parallelize``), the optimiser and its schedule, mixed precision,
the step loop's bookkeeping (logging, periodic evaluation, checkpoints that carry the
scheduler and the task's ``prediction_state`` and resume on any mesh, a final checkpoint),
``metrics.json`` at the end.
"""

from __future__ import annotations

import enum
import json
import math
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn

from shardsci.checkpoint import load_checkpoint, resolve_resume, save_checkpoint
from shardsci.training._data_parallel import DataParallelMode, parallelize
from shardsci.training._errors import NonFiniteLoss
from shardsci.training._loggers import MetricLogger
from shardsci.training._precision import Precision
from shardsci.training._progress import Progress
from shardsci.training._run import RunContext
from shardsci.training._schedule import ScheduleConfig, warmup_cosine
from shardsci.training._schema import instantiate, plain
from shardsci.training._signals import STOP_SIGNALS, StopRequests, exit_status
from shardsci.training._step import Task, prediction_state, training_step
from shardsci.training._unrolled import RolloutConfig

__all__ = ["NonFinite", "TrainConfig", "Trainer"]


class NonFinite(enum.Enum):
    """What a step whose loss is NaN or infinite does (``train.nonfinite``)."""

    stop = "stop"
    """Stop the run with an error naming the step and the field."""
    skip = "skip"
    """Skip the update (the step still counts), with a warning naming the step and the field."""


@dataclass
class TrainConfig:
    """The training loop (the ``train`` config group).

    Attributes
    ----------
    steps : int
        Optimiser steps in the run.
    global_batch : int
        Samples per step over all data-parallel ranks (must divide by the data-parallel size).
    precision : Precision
        ``fp32`` or ``bf16`` (autocast of the forward pass).
    grad_clip : float or None
        Clip the global gradient norm to this value.
    seed : int
        Seeds parameter initialisation and the data order.
    dp_mode : DataParallelMode
        How the replicas along the data-parallel axis share the model: ``ddp`` (replicated
        parameters) or ``fsdp2`` (sharded). Was ``train.parallel``.
    log_every, eval_every : int
        Steps between metric logs and between evaluations.
    checkpoint_every : int
        Steps between checkpoints (0: none but the final one); the final state is always
        saved.
    resume : str
        ``"auto"`` (the latest complete checkpoint in the run directory, if any), ``"never"``, or
        a checkpoint path.
    nonfinite : NonFinite
        A step whose loss is NaN or infinite: ``stop`` the run, or ``skip`` its update.
    schedule : ScheduleConfig
        The learning-rate schedule.
    rollout : RolloutConfig
        Training on k-step rollouts instead of one-step pairs (NOTE [Unrolled training]).
    compile : bool
        ``torch.compile`` the model (in place), traced through ShardTensors (NOTE
        [torch.compile and ShardTensor] says which models compile). Off by default.
    compile_backend : str
        The ``torch.compile`` backend with ``compile``: ``inductor`` (generated kernels) or
        ``aot_eager`` (AOTAutograd's graphs run op by op, no code generation), or any name
        ``torch.compiler.list_backends(exclude_tags=())`` gives.
    """

    steps: int = 300
    global_batch: int = 16
    precision: Precision = Precision.fp32
    grad_clip: float | None = 1.0
    seed: int = 0
    dp_mode: DataParallelMode = DataParallelMode.ddp
    log_every: int = 10
    eval_every: int = 100
    checkpoint_every: int = 100
    resume: str = "auto"
    nonfinite: NonFinite = NonFinite.stop
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    compile: bool = False
    compile_backend: str = "inductor"

    def check(self) -> None:
        """Raise ``ValueError`` naming the first setting out of range."""
        at_least = {
            "steps": (self.steps, 0),
            "global_batch": (self.global_batch, 1),
            "log_every": (self.log_every, 1),
            "eval_every": (self.eval_every, 1),
            "checkpoint_every": (self.checkpoint_every, 0),
            "schedule.warmup_steps": (self.schedule.warmup_steps, 0),
        }
        for name, (value, lowest) in at_least.items():
            if value < lowest:
                raise ValueError(f"train.{name}={value}: expected an integer >= {lowest}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"train.grad_clip={self.grad_clip}: expected a positive norm or null")
        if not 0 <= self.schedule.min_ratio <= 1:
            raise ValueError(
                f"train.schedule.min_ratio={self.schedule.min_ratio}: expected 0 <= min_ratio <= 1"
            )
        self.rollout.check()
        if self.compile:  # listing the backends imports dynamo's: only when asked to compile
            backends = torch.compiler.list_backends(exclude_tags=())
            if self.compile_backend not in backends:
                raise ValueError(
                    f"train.compile_backend={self.compile_backend}: expected one of {backends}"
                )


class Trainer:
    """Trains ``model`` on ``task`` with the run's ``train``, ``optim`` and ``logger`` configs.

    Parameters
    ----------
    run : RunContext
    cfg : DictConfig
        The composed run config.
    model : nn.Module
        On ``run.device``, not wrapped.
    task : Task
    """

    def __init__(self, run: RunContext, cfg: DictConfig, model: nn.Module, task: Task):
        self.run = run
        self.config: TrainConfig = OmegaConf.to_object(cfg.train)
        self.task = task
        self.model = model
        self.trained = parallelize(model, run.parallelism, self.config.dp_mode)
        if self.config.compile:
            self.trained.compile(backend=self.config.compile_backend)  # compiles at first call
        self.optimizer = instantiate(cfg.optim)(self.trained.parameters())
        self.scheduler = warmup_cosine(self.optimizer, self.config.schedule, self.config.steps)
        self.checkpoints = run.run_dir / "checkpoints"
        self.prediction = prediction_state(task)
        self.step = self._resume()
        self._saved_step = self.step
        self.logger = MetricLogger(
            OmegaConf.to_object(cfg.logger), run.run_dir, plain(cfg), run.leader
        )

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, float]:
        """Train to ``train.steps``; the final metrics (on every rank), also in
        ``metrics.json``. A stop signal ends the run after an agreed step, with a checkpoint
        of it, by ``SystemExit(128 + signum)`` (NOTE [Stopping a run on a signal])."""
        config, run = self.config, self.run
        progress = Progress(
            config.steps,
            self.step,
            config.global_batch * self.task.cells_per_sample,
            enabled=run.leader,
        )
        progress.write(f"mesh: {run.parallelism.describe()}; run directory: {run.run_dir}")
        started = time.perf_counter()
        loss = math.nan
        with StopRequests() as requests:
            while self.step < config.steps:
                loss, stop = self._optimiser_step(requests)
                self.step += 1
                cells_per_s = progress.step(loss)
                if self.step % config.log_every == 0:
                    lr = self.scheduler.get_last_lr()[0]
                    metrics = {"loss": loss, "lr": lr, "cells_per_s": cells_per_s}
                    self.logger.log(metrics, self.step)
                if stop is not None:
                    progress.close()
                    self._stop(stop)
                if self.step % config.eval_every == 0 and self.step < config.steps:
                    progress.write(self.task.describe(self._evaluate()))
                if config.checkpoint_every and self.step % config.checkpoint_every == 0:
                    self._save()
        progress.close()
        if self._saved_step != self.step:
            self._save()
        metrics = self._evaluate()
        metrics["train_seconds"] = time.perf_counter() - started
        metrics["final_loss"] = loss
        if run.leader:
            print(self.task.describe(metrics), flush=True)
            (run.run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        self.logger.finish()
        return metrics

    def _optimiser_step(self, requests: StopRequests) -> tuple[float, signal.Signals | None]:
        """One step (``training_step``); the loss averaged over data-parallel replicas, and the
        stop signal all ranks agreed on (None: go on)."""
        agreed: dict[str, Any] = {}

        def decide(terms: Mapping[str, torch.Tensor]) -> bool:
            values = self._agree([*terms.values()], requests.pending())
            agreed["means"] = dict(zip(terms, values[: len(terms)].tolist()))
            counts = values[len(terms) :].tolist()
            agreed["stop"] = next((s for s, n in zip(STOP_SIGNALS, counts) if n > 0), None)
            return self._finite(agreed["means"])

        config = self.config
        training_step(
            self.trained,
            self.optimizer,
            self.task,
            self.step,
            config.precision,
            config.grad_clip,
            self.run.device,
            decide,
        )
        self.scheduler.step()
        return sum(agreed["means"].values()), agreed["stop"]

    def _finite(self, means: Mapping[str, float]) -> bool:
        """Whether the step's loss terms (equal on every rank) are finite; if not, stop the
        run or skip the update (``train.nonfinite``), naming the step and the fields."""
        bad = {name: value for name, value in means.items() if not math.isfinite(value)}
        if not bad:
            return True
        fields = ", ".join(f"{name!r} is {value}" for name, value in bad.items())
        what = f"step {self.step + 1}: the loss of field {fields}"
        if self.config.nonfinite is NonFinite.stop:
            raise NonFiniteLoss(
                f"{what}; stopped (train.nonfinite=stop). Lower optim.lr, check the data, or "
                f"set train.nonfinite=skip to skip such steps"
            )
        self.optimizer.zero_grad(set_to_none=True)
        if self.run.leader:
            print(f"{what}; update skipped (train.nonfinite=skip)", flush=True)
        return False

    def _agree(self, terms: list[torch.Tensor], pending: list[float]) -> torch.Tensor:
        """One all-reduce over every rank: the loss terms averaged over data-parallel
        replicas, and per stop signal the number of ranks that received it.

        Every rank of a replica holds the same (whole) loss terms, so their sum over the world
        divided by the world size is the mean over replicas.
        """
        device = self.run.parallelism.device
        means = torch.stack([t.detach().to(device, torch.float64) for t in terms])
        counts = torch.tensor(pending, dtype=torch.float64, device=device)
        values = torch.cat([means / dist.get_world_size(), counts])
        dist.all_reduce(values)
        return values.cpu()

    def _stop(self, signum: signal.Signals) -> None:
        """Save the state of this step on every rank and leave with ``128 + signum``."""
        self._save()
        if self.run.leader:
            print(
                f"stopped by {signum.name} after step {self.step}; checkpoint saved in "
                f"{self.checkpoints}",
                flush=True,
            )
        raise SystemExit(exit_status(signum))

    @torch.no_grad()
    def _evaluate(self) -> dict[str, float]:
        self.trained.eval()
        metrics = {"step": self.step, **self.task.evaluate(self.model, self.step)}
        self.trained.train()
        self.logger.log(metrics, self.step)
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def _save(self) -> None:
        save_checkpoint(
            self.checkpoints,
            self.step,
            self.trained,
            self.optimizer,
            extra={
                "step": self.step,
                "scheduler": self.scheduler.state_dict(),
                "prediction": self.prediction,
            },
        )
        self._saved_step = self.step

    def _resume(self) -> int:
        path = resolve_resume(self.checkpoints, self.config.resume)
        if path is None:
            return 0
        extra = load_checkpoint(path, self.trained, self.optimizer)
        self.scheduler.load_state_dict(extra["scheduler"])
        if self.run.leader:
            print(f"resumed from {path} at step {extra['step']}", flush=True)
        return int(extra["step"])
