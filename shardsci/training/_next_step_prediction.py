"""A next-step model's prediction: initial fields and the solver's truth at the asked resolution,
from the training data's physics (NOTE [What a prediction reads from a checkpoint] in
``_predict.py``), read in each rank's block.

NOTE [The truth at another resolution]
A next-step model advances its fields by one record interval of its training data. The truth
it is compared with at resolution N is the training data's configuration (rebuilt from the
attributes the checkpoint keeps) at N cells per side: the time step scaled by N_train / N (the
same CFL number, as refining the grid needs) and the steps per record and of the spin-up scaled
by N / N_train (the same record interval and spin-up time), initial fields drawn from another
seed (``predict.seed``; the training seed would draw the training trajectories). A resolution
at which those step counts are not integers is refused. The file goes to
``data/generated/<dataset>_predict_<N>.h5`` (regenerated when another prediction asks for other
data there), or is the user's ``predict.data``, read as it is.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig

from shardsci.data import (
    GENERATED_DIR,
    DataError,
    check_hdf5,
    generation_reason,
    is_ours,
    on_first_rank,
)
from shardsci.training._fields import CHANNELS, Normalization, prepared, trajectory_field
from shardsci.training._predict import PredictConfig
from shardsci.training._run import RunContext
from shardsci.training._schema import config_from
from shardsci.training._trajectories import TrajectorySource

__all__ = [
    "NextStepPrediction",
    "PredictionData",
    "at_resolution",
    "decided_prediction_data",
    "generate_prediction_data",
    "prediction_data",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PredictionData:
    """The file of initial fields and truth a prediction reads.

    Attributes
    ----------
    path : Path
    config : dataclass or None
        The dataset config it is generated from (None: a file of the user's, read as it is).
    reason : str or None
        Why it must be generated first (None: it is read as it is).
    sample_sizes : mapping
        The dims of one sample and their sizes (``{"C": 3, "D": 64, ...}``).
    record_dt : float or None
        Time between snapshots, when the file says.
    """

    path: Path
    config: Any
    reason: str | None
    sample_sizes: Mapping[str, int]
    record_dt: float | None

    @property
    def spatial_sizes(self) -> dict[str, int]:
        return {dim: n for dim, n in self.sample_sizes.items() if dim != CHANNELS}

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """``(C, *spatial)`` as the model takes it."""
        return (self.sample_sizes.get(CHANNELS, 1), *self.spatial_sizes.values())

    def describe(self) -> str:
        cells = "x".join(str(n) for n in self.spatial_sizes.values())
        return f"the prediction's fields of {cells} ({self.path})"


def at_resolution(
    config: Any, resolution: int, seed: int, trajectories: int, snapshots: int
) -> Any:
    """The dataset config ``config`` at ``resolution`` cells per side (NOTE [The truth at
    another resolution]), with ``trajectories`` trajectories of ``snapshots`` snapshots drawn
    from ``seed``.

    Raises
    ------
    ValueError
        If the record interval or the spin-up cannot be kept at that resolution, or the
        solver refuses the configuration.
    """
    solver, base = config.solver, config.solver.resolution
    scale = Fraction(resolution, base)
    record_every, warmup = config.record_every * scale, config.warmup_steps * scale
    if record_every.denominator != 1 or warmup.denominator != 1:
        raise ValueError(
            f"predict.resolution={resolution}: the training data ({base} per side) records "
            f"every {config.record_every} steps after {config.warmup_steps}; at the same CFL "
            f"number the time step is {base}/{resolution} of its, and those counts times "
            f"{resolution}/{base} are not integers; choose a resolution that makes them integers"
        )
    dt = solver.dt if scale == 1 else solver.dt * base / resolution
    return dataclasses.replace(
        config,
        solver=dataclasses.replace(solver, resolution=resolution, dt=dt, seed=seed),
        n_train=trajectories,
        n_test=0,
        n_snapshots=snapshots,
        record_every=int(record_every),
        warmup_steps=int(warmup),
    )


def prediction_data(
    source: TrajectorySource, cfg: DictConfig, state: Mapping[str, Any]
) -> PredictionData:
    """The file a prediction of ``cfg`` reads, with the checkpoint's ``state``; reads metadata
    only, writes nothing.

    Raises
    ------
    ValueError
        (``DataError`` among them) If the file may neither be read nor generated, or cannot
        hold the prediction's trajectories and steps.
    """
    predict: PredictConfig = config_from(PredictConfig, cfg.predict)
    trained = _training_config(source, state)
    snapshots = predict.start + predict.steps + 1
    if trained is None and predict.data is None:
        raise DataError(
            "the checkpoint's model was trained on a file of yours, whose physics shardsci "
            "cannot generate: give predict.data=<file of initial fields and truth>"
        )
    wanted = None
    if trained is not None:
        resolution = predict.resolution or trained.solver.resolution
        seed = trained.solver.seed + 1 if predict.seed is None else predict.seed
        wanted = at_resolution(trained, resolution, seed, predict.trajectories, snapshots)
    default = GENERATED_DIR / f"{source.dataset}_predict_{_resolution_of(wanted)}.h5"
    path = Path(predict.data) if predict.data else default
    reason = None
    if wanted is not None or not path.exists():
        reason = generation_reason(
            path,
            predict.generate,
            source.created_by,
            lambda stored: source.outdated(stored, wanted),
        )
    if reason is not None:
        sizes = dict(zip(source.dims[2:], wanted.shape[2:]))
        return PredictionData(path, wanted, reason, sizes, wanted.record_dt)
    contents = check_hdf5(path, source.prediction_schema)
    sizes = dict(zip(source.dims[2:], contents.shapes[source.dataset][2:]))
    found = PredictionData(path, None, None, sizes, contents.attributes.get("record_dt"))
    _check_file(found, contents.sizes, predict, snapshots)
    return found


def _resolution_of(config: Any) -> str:
    return "user" if config is None else str(config.solver.resolution)


def _training_config(source: TrajectorySource, state: Mapping[str, Any]) -> Any:
    """The dataset config of the checkpoint's training data, if shardsci generated it."""
    attributes = state.get("data_attributes", {})
    if not is_ours(attributes, source.created_by):
        return None
    trained = source.config_of_attributes(attributes)
    mismatch = source.outdated(attributes, trained)
    if mismatch is not None:
        raise DataError(
            f"the checkpoint's training data was written by another version of "
            f"{source.created_by} ({mismatch}); predict with predict.data=<file of yours>"
        )
    return trained


def _check_file(
    data: PredictionData, sizes: Mapping[str, int], predict: PredictConfig, snapshots: int
) -> None:
    if sizes["trajectory"] < predict.trajectories or sizes["time"] < snapshots:
        raise DataError(
            f"data file {data.path} has {sizes['trajectory']} trajectories of {sizes['time']} "
            f"snapshots; predict.trajectories={predict.trajectories} from snapshot "
            f"predict.start={predict.start} over predict.steps={predict.steps} need "
            f"{predict.trajectories} of {snapshots}"
        )
    cells = set(data.spatial_sizes.values())
    if predict.resolution is not None and cells != {predict.resolution}:
        raise DataError(
            f"data file {data.path} holds fields of {data.describe()}, not "
            f"predict.resolution={predict.resolution} per side; leave predict.resolution unset"
        )


class NextStepPrediction:
    """The ``PredictTask`` of a next-step model: this replica's trajectories of the
    prediction's file, normalised as the model was trained, in this rank's block.

    Parameters
    ----------
    source : TrajectorySource
    cfg : DictConfig
    run : RunContext
    state : mapping
        The checkpoint's ``prediction_state``: ``mean``, ``std``.
    data : PredictionData
        The file, generated already.
    dims : sequence of str
        Dims of a batch of fields, ``("N", "C", *spatial)``.
    plane : callable
        ``(N, C, *spatial) -> (N, H, W)`` for the PNG; ``plane_name`` says what it shows.
    """

    def __init__(
        self,
        source: TrajectorySource,
        cfg: DictConfig,
        run: RunContext,
        state: Mapping[str, Any],
        data: PredictionData,
        dims: Sequence[str],
        plane: Any,
        plane_name: str,
    ) -> None:
        predict: PredictConfig = config_from(PredictConfig, cfg.predict)
        parallelism = run.parallelism
        self.run = run
        self.field = source.dataset
        self.dims = tuple(dims)
        self.plane = plane
        self.plane_name = plane_name
        self.start = predict.start
        self.n_samples = predict.trajectories
        split = np.array_split(np.arange(self.n_samples), parallelism.dp_size)
        self.batch_sizes = tuple(len(part) for part in split)
        self.trajectories = split[parallelism.dp_rank]
        self.reader = trajectory_field(run, data.path, source.dataset, source.dims)
        self.has_channels = CHANNELS in source.dims
        self.sharded = parallelism.domain_mesh is not None
        spatial = len(data.spatial_sizes)
        self.normalization = Normalization(state["mean"], state["std"], spatial)
        self.attributes = {
            "resolution": list(data.spatial_sizes.values()),
            "truth_file": str(data.path.resolve()),
            "trajectories": f"0-{self.n_samples - 1} of the truth file",
            "start_snapshot": self.start,
            **({"record_dt": float(data.record_dt)} if data.record_dt is not None else {}),
        }

    def initial(self) -> torch.Tensor:
        return self._read(0, self.normalization)

    def truth(self, step: int) -> torch.Tensor:
        return self._read(step, None)

    def denormalize(self, fields: torch.Tensor) -> torch.Tensor:
        return self.normalization.denormalize(fields)

    def _read(self, step: int, normalization: Normalization | None) -> torch.Tensor:
        """This replica's trajectories ``step`` snapshots after the start, ``(b, C, *spatial)``."""
        indices = [(int(b), self.start + step) for b in self.trajectories]
        samples = self.reader.read(indices)
        return prepared(samples, normalization, self.has_channels, self.sharded, self.run.device)


def generate_prediction_data(
    source: TrajectorySource, run: RunContext, data: PredictionData, dims: Sequence[str]
) -> None:
    """Write ``data``'s file if it must be: on the whole mesh, each rank its blocks, when the
    source's generator runs on a mesh; else on global rank 0 while the others wait."""
    if data.reason is None:
        return
    parallelism = run.parallelism
    if run.leader:
        logger.info("generating %s: %s", data.path, data.reason)
        print(f"generating {data.path}: {data.reason}", flush=True)
    if source.generates_on_mesh and parallelism.plan.world_size > 1:
        mesh = parallelism.mesh
        source.generate(data.path, data.config, mesh, parallelism.mesh_placements(dims))
        return
    if dist.get_rank() == 0:
        source.generate(data.path, data.config)
    dist.barrier()


def decided_prediction_data(
    source: TrajectorySource, cfg: DictConfig, run: RunContext, state: Mapping[str, Any]
) -> PredictionData:
    """``prediction_data`` decided on the first rank and given to all, so that every rank
    agrees whether to generate (collectively) even while the first one writes the file."""
    return on_first_rank(lambda: prediction_data(source, cfg, state), run.parallelism.mesh)
