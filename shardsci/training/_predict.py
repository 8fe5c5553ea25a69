"""Predict with a trained model: roll it out from new initial fields, at any resolution it takes,
on any mesh, and write the prediction without any rank holding it whole.

NOTE [What a prediction reads from a checkpoint]
``shardsci-predict`` composes its config as training does (``+recipe``, ``model``, ``mesh``,
``parallel``) plus the ``predict`` group (``PredictConfig``). From the checkpoint it reads:
- the weights, loaded by ``load_checkpoint`` into the composed model, which ``check_checkpoint``
  first compares with the checkpoint's tensors (a checkpoint of another model is one line,
  before any rank starts); a checkpoint saved on any mesh, replicated or FSDP2, loads;
- ``extra["prediction"]``, the task's ``prediction_state`` that the trainer saves with every
  checkpoint: for a next-step recipe the normalisation of the training fields (the model's
  inputs and outputs are normalised fields) and the training data's attributes, so that the
  solver's truth at another resolution has the training data's physics and record interval
  (``NextStepProblem.prediction_data``).
A checkpoint saved before ``prediction_state`` existed has no such entry and is refused in one
line: its normalisation is unknown.

The recipe says how it predicts (``Recipe.predict_task``, ``Recipe.predict_check``); what is
the same for every recipe is here: the checks before any rank starts (``check_prediction``), and
on every rank the model, the rollout, the errors of every step against the truth and against
persistence (predicting no change) in ``metrics.json``, a PNG, and the output file.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from shardsci.checkpoint import (
    CheckpointError,
    check_checkpoint,
    latest_checkpoint,
    load_checkpoint,
)
from shardsci.data import GenerateMode, ShardedHDF5Writer
from shardsci.distributed import LaunchEnv
from shardsci.training._checks import check_component, check_launcher, plan_parallelism
from shardsci.training._data_parallel import dp_sample_mean
from shardsci.training._errors import ConfigError
from shardsci.training._forecast import relative_l2
from shardsci.training._parallelism import ParallelPlan
from shardsci.training._plots import save_rollout
from shardsci.training._recipes import Recipe, get_recipe
from shardsci.training._run import RunContext, start_run
from shardsci.training._schema import config_from, instantiate, plain
from shardsci.training._whole import whole_tensor

__all__ = [
    "PredictConfig",
    "PredictTask",
    "check_prediction",
    "describe_prediction",
    "predict_recipe",
    "resolve_checkpoint",
]

PREDICTION_DATASET = "prediction"
"""The dataset of the output file: ``(steps, B, C, *spatial)``."""

_PLOTTED_CELLS = 512
"""At most this many cells per side of a plane are gathered for the PNG (every k-th cell)."""


@dataclass
class PredictConfig:
    """The ``predict`` group of ``shardsci-predict`` (``configs/predict/default.yaml``).

    Attributes
    ----------
    checkpoint : str or None
        A checkpoint directory (``<run>/checkpoints/step_000600``), a run's checkpoint
        directory (its latest complete checkpoint) or a run directory (the same). Required.
    output : str or None
        The HDF5 file to write, ``prediction`` ``(steps, B, C, *spatial)`` in the data's
        units; it must not exist (a prediction never overwrites a file). Required.
    steps : int
        Autoregressive steps of the rollout.
    resolution : int or None
        Cells per side of the fields predicted on (zero-shot super-resolution above the
        training data's); None: the training data's.
    trajectories : int
        Initial fields B to predict from.
    start : int
        The snapshot of each trajectory the rollout starts from (0: the first recorded one).
    seed : int or None
        Seed of the initial fields; None: the training data's seed + 1 (its seed would draw
        the training trajectories' initial fields).
    data : str or None
        An HDF5 file of the initial fields and the truth (``(trajectory, time, [C,] *spatial)``,
        the dataset the recipe reads), read as it is if it is yours; None: shardsci's, generated
        under ``data/generated/`` with the training data's physics at ``resolution``.
    generate : GenerateMode
        As ``data.generate``: ``auto`` generates a missing or outdated file of ours under
        ``data/generated/``, ``never`` only reads, ``force`` regenerates a file of ours.
    """

    checkpoint: str | None = None
    output: str | None = None
    steps: int = 10
    resolution: int | None = None
    trajectories: int = 2
    start: int = 0
    seed: int | None = None
    data: str | None = None
    generate: GenerateMode = GenerateMode.auto

    def __post_init__(self) -> None:
        # ``config_from`` gives choices as the strings the composed Enum holds.
        self.generate = GenerateMode(self.generate)

    def check(self) -> None:
        """Raise ``ValueError`` naming the first setting out of range."""
        for name in ("checkpoint", "output"):
            if not getattr(self, name):
                raise ValueError(
                    f"predict.{name} is not set; shardsci-predict needs predict.checkpoint=<run "
                    f"directory or checkpoint> and predict.output=<new .h5 file>"
                )
        at_least = {"steps": 1, "trajectories": 1, "start": 0}
        for name, lowest in at_least.items():
            if getattr(self, name) < lowest:
                raise ValueError(
                    f"predict.{name}={getattr(self, name)}: expected an integer >= {lowest}"
                )
        if self.resolution is not None and self.resolution < 1:
            raise ValueError(f"predict.resolution={self.resolution}: expected a positive size")


class PredictTask(Protocol):
    """What a recipe gives the prediction (``Recipe.predict_task``), on every rank.

    The fields are this data-parallel replica's part of the batch of ``n_samples``
    trajectories: contiguous, ``batch_sizes[dp_rank]`` of them, in order.
    """

    n_samples: int
    """Trajectories B predicted, over all replicas."""
    batch_sizes: tuple[int, ...]
    """Trajectories of each data-parallel replica."""
    field: str
    """What the fields are (``"velocity"``), for the output's attributes."""
    dims: tuple[str, ...]
    """Dims of a batch of fields, ``("N", "C", *spatial)``."""
    attributes: Mapping[str, Any]
    """What the output file says about the data: resolution, record interval, truth file."""
    plane_name: str
    """What ``plane`` shows, for the PNG's title."""

    def initial(self) -> torch.Tensor:
        """The normalised initial fields ``(b, C, *spatial)``, as the model takes them."""

    def truth(self, step: int) -> torch.Tensor:
        """The solver's fields ``step`` records after the initial ones, in the data's units."""

    def denormalize(self, fields: torch.Tensor) -> torch.Tensor:
        """Normalised fields (the model's) in the data's units."""

    def plane(self, fields: torch.Tensor) -> torch.Tensor:
        """``(N, C, *spatial) -> (N, H, W)``: the 2-D view drawn in the PNG."""


# ---------------------------------------------------------------------------- before any rank
def check_prediction(
    cfg: DictConfig, recipe: Recipe, env: LaunchEnv, multirun: bool
) -> ParallelPlan:
    """Check everything the config of a prediction shows, before any rank starts (NOTE [Config
    errors before any rank starts]); return the run's plan. Resolves ``predict.checkpoint`` to
    one checkpoint directory in ``cfg``, so every rank loads the one checked here.

    Raises
    ------
    ConfigError
        The first problem, in one line: a recipe that cannot predict, a bad ``predict``
        setting, an output that exists, a missing or damaged checkpoint or one of another
        model, a resolution the model cannot take, a mesh the fields cannot be split over.
    """
    if recipe.predict_task is None:
        raise ConfigError(f"recipe {recipe.name!r} cannot predict: it has no predict_task")
    check_launcher(cfg, env, multirun)
    plan = plan_parallelism(cfg, recipe, env)
    check_component("model", cfg.model)
    try:
        config: PredictConfig = config_from(PredictConfig, cfg.predict)
        config.check()
        _check_output(Path(config.output))
        checkpoint = resolve_checkpoint(Path(config.checkpoint))
        with torch.device("meta"):
            model = instantiate(cfg.model)
        extra = check_checkpoint(checkpoint, model)
        state = extra.get("prediction")
        if not state:
            raise CheckpointError(
                f"checkpoint {checkpoint} holds no prediction state (the normalisation of the "
                f"model's fields): it was saved before shardsci-predict existed or by a task "
                f"without one (NOTE [What a prediction reads from a checkpoint]); train it again"
            )
        if recipe.predict_check is not None:
            recipe.predict_check(cfg, plan, state)
    except (TypeError, ValueError, CheckpointError) as error:
        raise ConfigError(str(error)) from error
    cfg.predict.checkpoint = str(checkpoint.resolve())
    return plan


def resolve_checkpoint(path: Path) -> Path:
    """The checkpoint ``path`` names: itself if it is one, else the latest complete one in it
    or in its ``checkpoints/`` (a run directory).

    Raises
    ------
    CheckpointError
        If there is nothing at ``path`` or no complete checkpoint.
    """
    if not path.exists():
        raise CheckpointError(
            f"predict.checkpoint={path} does not exist; expected a run directory, its "
            f"checkpoints/ or one checkpoint in it (step_<N>)"
        )
    for directory in (path, path / "checkpoints"):
        if directory.is_dir() and not (directory / ".metadata").exists():
            found = latest_checkpoint(directory)
            if found is not None:
                return found
    if (path / ".metadata").exists():
        return path
    raise CheckpointError(
        f"predict.checkpoint={path} holds no complete checkpoint; expected a run directory, "
        f"its checkpoints/ or one checkpoint in it (step_<N>)"
    )


def _check_output(path: Path) -> None:
    if os.path.lexists(path):
        raise ValueError(
            f"predict.output={path} exists; a prediction never overwrites a file: choose "
            f"another path or remove it"
        )
    if path.suffix not in (".h5", ".hdf5"):
        raise ValueError(f"predict.output={path}: expected an HDF5 file name (.h5 or .hdf5)")


# ---------------------------------------------------------------------------- on every rank
def predict_recipe(cfg: DictConfig, plan: ParallelPlan) -> dict[str, Any]:
    """Predict with ``cfg.recipe``'s model on this rank's part of the mesh of ``plan``
    (``cfg.predict.checkpoint`` resolved by ``check_prediction``); the metrics (on every
    rank), also written to ``metrics.json`` in the run directory."""
    recipe = get_recipe(cfg.recipe)
    config: PredictConfig = config_from(PredictConfig, cfg.predict)
    with start_run(cfg, plan) as run:
        started = time.perf_counter()
        model = instantiate(cfg.model).to(run.device)
        extra = load_checkpoint(config.checkpoint, model, None)
        task = recipe.load_predict_task()(cfg, run, extra["prediction"])
        data_seconds = time.perf_counter() - started
        return Prediction(run, cfg, config, model, task).roll_out(data_seconds)


class Prediction:
    """One rollout of ``model`` from ``task``'s initial fields, written step by step."""

    def __init__(
        self,
        run: RunContext,
        cfg: DictConfig,
        config: PredictConfig,
        model: nn.Module,
        task: PredictTask,
    ) -> None:
        self.run = run
        self.cfg = cfg
        self.config = config
        self.model = model.eval()
        self.task = task

    @torch.no_grad()
    def roll_out(self, data_seconds: float) -> dict[str, Any]:
        """Roll out, write, measure; the metrics."""
        run, task, config = self.run, self.task, self.config
        parallelism = run.parallelism
        baseline = _reset_peak_rss()
        started = time.perf_counter()
        state = task.initial()
        start = task.denormalize(state)
        shape = (config.steps, task.n_samples, *state.shape[1:])
        errors, persistence, per_sample, planes = [], [], [], []
        with ShardedHDF5Writer.create(
            config.output, PREDICTION_DATASET, shape, torch.float32, self._attributes(state),
            parallelism.mesh,
        ) as writer:  # fmt: skip
            for step in range(1, config.steps + 1):
                state = self.model(state)
                prediction = task.denormalize(state)
                writer.append(parallelism.on_whole_mesh(prediction, task.batch_sizes))
                truth = task.truth(step)
                error = relative_l2(prediction, truth)
                errors.append(dp_sample_mean(error, parallelism))
                persistence.append(dp_sample_mean(relative_l2(start, truth), parallelism))
                per_sample.append(error)
                planes.append((self._plane(prediction), self._plane(truth)))
        seconds = time.perf_counter() - started
        metrics = {
            "relative_l2": errors,
            "persistence_relative_l2": persistence,
            "relative_l2_per_trajectory": self._per_trajectory(per_sample),
            "seconds": {"data_and_model": data_seconds, "rollout_and_write": seconds},
            "memory": self._memory(baseline, shape, state.dtype),
            "output": str(Path(config.output).resolve()),
            "mesh": parallelism.describe(),
            "fields": list(shape[1:]),
            **{k: v for k, v in task.attributes.items() if k in ("resolution", "record_dt")},
        }
        if run.leader:
            self._report(metrics, planes)
        return metrics

    def _attributes(self, state: torch.Tensor) -> dict[str, Any]:
        """What the output file says it is (NOTE [What a prediction reads from a checkpoint])."""
        plan = self.run.parallelism.plan
        return {
            "recipe": str(self.cfg.recipe),
            "model": str(self.cfg.model._target_),
            "model_config": json.dumps(plain(self.cfg.model), sort_keys=True),
            "checkpoint": str(self.config.checkpoint),
            "mesh": "x".join(str(n) for n in plan.shape),
            "mesh_axes": plan.describe(),
            "field": self.task.field,
            "dims": ", ".join(("step", "trajectory", *self.task.dims[1:])),
            **dict(self.task.attributes),
        }

    def _plane(self, fields: torch.Tensor) -> torch.Tensor:
        """The first trajectory's plane, every k-th cell so that at most ``_PLOTTED_CELLS``
        per side are gathered (whole on every rank of the replica; empty on replicas without
        trajectories)."""
        plane = self.task.plane(fields[:1])
        stride = [max(1, -(-n // _PLOTTED_CELLS)) for n in plane.shape[1:]]
        return whole_tensor(plane[:, :: stride[0], :: stride[1]])

    def _per_trajectory(self, per_sample: list[torch.Tensor]) -> list[list[float]]:
        """``[trajectory][step]`` errors, gathered from the replicas (small)."""
        mine = torch.stack(per_sample, dim=1).tolist() if per_sample else []
        parallelism = self.run.parallelism
        if parallelism.dp_group is None:
            return mine
        gathered: list[Any] = [None] * parallelism.dp_size
        dist.all_gather_object(gathered, mine, group=parallelism.dp_group)
        return [row for part in gathered for row in part]

    def _memory(
        self, baseline_mib: float, shape: tuple[int, ...], dtype: torch.dtype
    ) -> dict[str, Any]:
        """Peak resident memory of every rank during the rollout, beside the field's size."""
        peak = _peak_rss_mib()
        peaks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, (baseline_mib, peak))
        field_mib = float(np.prod(shape[1:])) * torch.empty((), dtype=dtype).element_size()
        field_mib /= 2**20
        return {
            "peak_rss_mib_per_rank": [p for _, p in peaks],
            "rss_before_rollout_mib_per_rank": [b for b, _ in peaks],
            "one_step_of_fields_mib": field_mib,
            "one_step_of_fields_per_rank_mib": field_mib / self.run.parallelism.plan.world_size,
        }

    def _report(self, metrics: dict[str, Any], planes: list) -> None:
        run_dir = self.run.run_dir
        (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        predictions = torch.cat([p for p, _ in planes])
        truths = torch.cat([t for _, t in planes])
        if len(predictions):
            steps = len(planes)
            save_rollout(
                run_dir / "prediction.png",
                predictions,
                truths,
                {
                    "trajectory 0": metrics["relative_l2_per_trajectory"][0],
                    "mean": metrics["relative_l2"],
                    "persistence (mean)": metrics["persistence_relative_l2"],
                },
                f"{self.cfg.recipe}, {self.task.plane_name}, {tuple(metrics['fields'][2:])} "
                f"on mesh {metrics['mesh']}: relative L2 {metrics['relative_l2'][0]:.3g} after "
                f"1 step, {metrics['relative_l2'][-1]:.3g} after {steps}",
            )
        print(describe_prediction(metrics), flush=True)
        print(f"wrote {metrics['output']}; metrics and prediction.png in {run_dir}", flush=True)


def describe_prediction(metrics: Mapping[str, Any]) -> str:
    """One line about a prediction's errors by step, against persistence's."""
    steps = " ".join(
        f"{e:.3g}({p:.3g})"
        for e, p in zip(metrics["relative_l2"], metrics["persistence_relative_l2"])
    )
    return f"relative L2 by step (persistence): {steps}"


def _peak_rss_mib() -> float:
    """This process's peak resident memory (``VmHWM``) since it started or since the last
    ``_reset_peak_rss``, in MiB."""
    return _status_mib("VmHWM")


def _reset_peak_rss() -> float:
    """Restart the peak-RSS count where Linux allows it (``/proc/self/clear_refs``; elsewhere
    the peak counts from the start); the resident memory now, in MiB."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
    return _status_mib("VmRSS")


def _status_mib(field: str) -> float:
    """A memory figure of ``/proc/self/status`` in MiB; ``ru_maxrss`` where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
