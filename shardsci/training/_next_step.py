"""Next-step prediction of a gridded field, the same for every recipe that learns one.

A recipe that learns to advance a field by one record (2-D vorticity, a 3-D velocity) says what
its data is (a ``TrajectorySource``) and how to look at a sample (a 2-D ``plane`` of it for the
pictures); a ``NextStepProblem`` makes the rest: the training ``Task`` (batches of this rank's
slab, the mean squared error, of one step or of a ``train.rollout`` of several: NOTE [Unrolled
training], the held-out evaluation and its PNG), the dry run's task on random
fields, the checks before any rank starts, the data preparation, and the prediction's task and
check (``shardsci-predict``: ``_next_step_prediction.py``).

The evaluation: the one-step relative L2 error over the held-out pairs (``eval.samples`` of them
spread evenly over the held-out trajectories and times; every pair by default) beside
persistence's (predicting no change), a rollout of ``eval.rollout_steps`` from the middle
snapshot of each held-out trajectory, and a PNG of the first held-out trajectory's rollout:
prediction, truth and error on the plane, and the error at every step against persistence.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from shardsci.data import read_attributes
from shardsci.training._checks import check_model_input
from shardsci.training._data_parallel import dp_sample_mean
from shardsci.training._fields import CHANNELS, NextStepFields, RandomFields
from shardsci.training._forecast import describe_forecast, relative_l2, rollout
from shardsci.training._next_step_prediction import (
    NextStepPrediction,
    decided_prediction_data,
    generate_prediction_data,
    prediction_data,
)
from shardsci.training._parallelism import ParallelPlan
from shardsci.training._plots import save_rollout
from shardsci.training._run import RunContext
from shardsci.training._trajectories import TrajectorySource
from shardsci.training._unrolled import RolloutConfig, unrolled_loss
from shardsci.training._whole import whole_tensor

__all__ = ["NextStepEvalConfig", "NextStepProblem", "NextStepTask"]

Plane = Callable[[torch.Tensor], torch.Tensor]
"""``(N, C, *spatial) -> (N, H, W)``: the 2-D view of samples drawn in the pictures."""


@dataclass
class NextStepEvalConfig:
    """The ``eval`` group of a next-step recipe (``configs/eval/<recipe>.yaml``): what each
    evaluation (every ``train.eval_every`` steps, and at the end) measures on the held-out
    trajectories.

    Attributes
    ----------
    samples : int or None
        Held-out (t, t + 1) pairs for the one-step error, spread evenly over the held-out
        trajectories and times; None: every pair (the default, so the error is the mean over
        all held-out trajectories and times).
    rollout_steps : int
        Autoregressive steps of the rollout, from the middle snapshot of each held-out
        trajectory (or the latest start that leaves this many steps).
    """

    samples: int | None = None
    rollout_steps: int = 10


@dataclass(frozen=True)
class NextStepProblem:
    """Learn to advance the field of ``source`` by one record.

    Attributes
    ----------
    source : TrajectorySource
        The data: its dataset, dims and generator.
    plane : callable
        ``(N, C, *spatial) -> (N, H, W)``, the view of samples the pictures show (the field
        itself in 2-D, a mid-plane of one component in 3-D); indexing only, so a sharded field
        gives a sharded plane.
    plane_name : str
        What the plane shows, for titles.
    """

    source: TrajectorySource
    plane: Plane
    plane_name: str

    @property
    def field_dims(self) -> tuple[str, ...]:
        """Dims of a batch of samples: ``("N", "C", *spatial)``."""
        return ("N", CHANNELS, *(d for d in self.source.dims[2:] if d != CHANNELS))

    def task(self, cfg: DictConfig, run: RunContext) -> NextStepTask:
        """The task on this rank's part of the run's data file (``Recipe.task``)."""
        stored = self.source.read(Path(cfg.data.path))
        data = NextStepFields(
            run,
            cfg.data.path,
            self.source.dataset,
            self.source.dims,
            train=range(stored.n_train),
            test=range(stored.n_train, stored.n_train + stored.n_test),
            global_batch=cfg.train.global_batch,
            seed=cfg.train.seed,
            eval_samples=cfg.eval.samples,
            unrolled=cfg.train.rollout.steps,
        )
        return NextStepTask(self, data, run, cfg.eval.rollout_steps, _rollout(cfg))

    def random_task(self, cfg: DictConfig, run: RunContext) -> NextStepTask:
        """The task on random fields of the data's shapes and layouts (``Recipe.dry_run_task``)."""
        config = self.source.config(cfg.data.dataset)
        sample_shape = self.source.of_config(Path(cfg.data.path), config).sample_shape
        data = RandomFields(
            run,
            sample_shape,
            self.field_dims,
            int(cfg.train.global_batch),
            unrolled=cfg.train.rollout.steps,
        )
        return NextStepTask(self, data, run, cfg.eval.rollout_steps, _rollout(cfg))

    def check(self, cfg: DictConfig, plan: ParallelPlan) -> None:
        """Raise ``ValueError`` naming the first setting of ``cfg`` that cannot run on ``plan``
        (``Recipe.check``): the data file (a user's against the schema, or whether it may be
        generated), the mesh against the field's cells, the batch against the training pairs,
        the training rollout and the evaluation against the trajectories, the model against the
        field's shape."""
        data = self.source.inspect(cfg.data)[0]
        plan.check_fits(data.spatial_sizes, data.describe())
        unrolled = cfg.train.rollout.steps
        if unrolled >= data.n_snapshots:
            raise ValueError(
                f"train.rollout.steps={unrolled}: expected 1 to {data.n_snapshots - 1} (the "
                f"data has {data.n_snapshots} snapshots per trajectory)"
            )
        samples = data.training_samples(unrolled)
        if cfg.train.global_batch > samples:
            what = "training pairs" if unrolled == 1 else f"training {unrolled}-step rollouts"
            raise ValueError(
                f"train.global_batch={cfg.train.global_batch} exceeds the {samples} {what} of "
                f"the data ({data.describe()}); expected at most {samples}"
            )
        if cfg.eval.samples is not None and cfg.eval.samples < 1:
            raise ValueError(f"eval.samples={cfg.eval.samples}: expected an integer >= 1 or null")
        if not 1 <= cfg.eval.rollout_steps < data.n_snapshots:
            raise ValueError(
                f"eval.rollout_steps={cfg.eval.rollout_steps}: expected 1 to "
                f"{data.n_snapshots - 1} (the data has {data.n_snapshots} snapshots per "
                f"trajectory)"
            )
        check_model_input(cfg.model, data.sample_shape)

    def prepare(self, cfg: DictConfig) -> None:
        """Generate the run's data file if it must (``Recipe.prepare``: on rank 0 only)."""
        self.source.prepare(cfg)

    def predict_check(self, cfg: DictConfig, plan: ParallelPlan, state: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` naming what keeps ``cfg``'s prediction from running on
        ``plan`` (``Recipe.predict_check``): the truth's file (generated at the asked
        resolution, or the user's), the trajectories against the data-parallel replicas, the
        mesh against the fields' cells, the model against their shape."""
        data = prediction_data(self.source, cfg, state)
        plan.check_fits(data.spatial_sizes, data.describe())
        trajectories = cfg.predict.trajectories
        if trajectories < plan.dp_size:
            raise ValueError(
                f"predict.trajectories={trajectories} leaves data-parallel replicas of mesh "
                f"{plan.describe()} without fields; expected at least {plan.dp_size}"
            )
        check_model_input(cfg.model, data.sample_shape)

    def predict_task(
        self, cfg: DictConfig, run: RunContext, state: Mapping[str, Any]
    ) -> NextStepPrediction:
        """The prediction's task on every rank (``Recipe.predict_task``), its truth generated
        first if it must be (NOTE [The truth at another resolution])."""
        data = decided_prediction_data(self.source, cfg, run, state)
        generate_prediction_data(self.source, run, data, self.field_dims)
        return NextStepPrediction(
            self.source, cfg, run, state, data, self.field_dims, self.plane, self.plane_name
        )


class NextStepTask:
    """Predict the field one record ahead (see ``Task``): batches, the mean squared error of
    the prediction (of one step, or of a rollout of ``training.steps``: NOTE [Unrolled
    training]), the held-out evaluation, and what a prediction needs besides the weights.
    """

    def __init__(
        self,
        problem: NextStepProblem,
        data: NextStepFields | RandomFields,
        run: RunContext,
        rollout_steps: int,
        training: RolloutConfig,
    ) -> None:
        self.problem = problem
        self.data = data
        self.run = run
        self.rollout_steps = rollout_steps
        self.training = training
        self.cells_per_sample = data.cells_per_sample

    def batch(self, step: int) -> tuple[torch.Tensor, ...]:
        """The fields at t, t + 1, ..., t + ``training.steps`` of this rank's samples."""
        return self.data.train_batch(step)

    def losses(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
        start, *truths = batch
        loss = unrolled_loss(
            model, start, truths, lambda p, t: F.mse_loss(p.float(), t), self.training.gradient
        )
        return {self.problem.source.dataset: loss}

    def evaluate(self, model: nn.Module, step: int) -> dict[str, float]:
        data, parallelism = self.data, self.run.parallelism
        advance = _held_out_advance(model)
        inputs, targets = data.eval_batch()
        errors = relative_l2(data.denormalize(advance(inputs)), data.denormalize(targets))
        persistence = relative_l2(data.denormalize(inputs), data.denormalize(targets))
        start, truths = data.rollout_batch(self.rollout_steps)
        states = rollout(advance, start, len(truths))
        physical = [(data.denormalize(s), data.denormalize(t)) for s, t in zip(states, truths)]
        rollout_errors = [relative_l2(s, t) for s, t in physical]
        rollout_mean = [dp_sample_mean(e, parallelism) for e in rollout_errors]
        held_still = [
            dp_sample_mean(relative_l2(data.denormalize(start), t), parallelism)
            for _, t in physical
        ]
        self._plot(physical, rollout_errors, rollout_mean, held_still, step)
        return {
            "eval_relative_l2": dp_sample_mean(errors, parallelism),
            "persistence_relative_l2": dp_sample_mean(persistence, parallelism),
            **{f"rollout_relative_l2_step{k + 1}": e for k, e in enumerate(rollout_mean)},
            f"persistence_rollout_relative_l2_step{len(truths)}": held_still[-1],
        }

    def describe(self, metrics: Mapping[str, Any]) -> str:
        return describe_forecast(metrics)

    def prediction_state(self) -> dict[str, Any]:
        """What a prediction from this task's model needs besides the weights, saved with
        every checkpoint (``Task.prediction_state``): the normalisation of the fields and the
        attributes of the training data (its physics, for the solver's truth at another
        resolution)."""
        data = self.data
        if not isinstance(data, NextStepFields):
            return {}
        attributes = {
            name: value
            for name, value in read_attributes(data.path).items()
            if isinstance(value, (str, int, float, bool))
        }
        return {**data.normalization.state(), "data_attributes": attributes}

    def _plot(
        self,
        physical: list[tuple[torch.Tensor, torch.Tensor]],
        rollout_errors: list[torch.Tensor],
        rollout_mean: list[float],
        held_still: list[float],
        step: int,
    ) -> None:
        """The rollout of the first held-out trajectory (this run's first PNG shows it)."""
        plane = self.problem.plane
        fields = [(whole_tensor(plane(s[:1])), whole_tensor(plane(t[:1]))) for s, t in physical]
        if not self.run.leader or not fields:
            return
        steps = len(fields)
        sample = [float(e[0]) for e in rollout_errors]
        save_rollout(
            self.run.run_dir / f"eval_step{step:06d}.png",
            torch.cat([s for s, _ in fields]),
            torch.cat([t for _, t in fields]),
            {
                "this trajectory": sample,
                "held-out mean": rollout_mean,
                "persistence (held-out mean)": held_still,
            },
            f"training step {step}: a {steps}-step rollout of held-out trajectory "
            f"{self.data.test_trajectories[0]}, {self.problem.plane_name} (relative L2 "
            f"{sample[0]:.3g} after 1 step, {sample[-1]:.3g} after {steps})",
        )


def _held_out_advance(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``model`` on held-out fields ``(N, C, *spatial)``, except where this data-parallel
    replica holds none of them (``N = 0`` on every rank of the replica, when there are fewer
    held-out samples than replicas): there it runs nothing and returns the empty fields, as
    kernels such as MKL's FFT reject an empty batch (NOTE [A rank with an empty shard computes
    nothing])."""
    return lambda fields: fields if fields.shape[0] == 0 else model(fields)


def _rollout(cfg: DictConfig) -> RolloutConfig:
    """``cfg.train.rollout`` as its dataclass."""
    return RolloutConfig(cfg.train.rollout.steps, cfg.train.rollout.gradient)
