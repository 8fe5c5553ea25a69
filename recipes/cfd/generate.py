"""Write, and reuse, HDF5 files of Navier–Stokes vorticity trajectories for the CFD recipe.

File contents
-------------
``vorticity``
    ``(B, T, N, N)`` float32, snapshot ``t`` of trajectory ``b`` at time
    ``(warmup_steps + t * record_every) * dt``. Chunked ``(1, 1, min(N, 128), min(N, 128))`` and
    uncompressed, so a rank reading a block of one snapshot reads at most one chunk's worth of
    rows and columns beyond it, without decompression (see NOTES.md on gzip).
attributes
    Every field of :class:`~recipes.cfd.navier_stokes.SolverConfig` and of
    :class:`DatasetConfig` that determines the data, plus ``record_dt``, ``domain_length``,
    ``solver_version``, ``created_by`` (which marks the file as shardsci's: NOTE [Whose data
    file is it] in ``shardsci/data/_files.py``) and ``created_at``. ``data/README.md`` gives
    the schema a file of the user's own must follow.

Split
-----
One file holds both splits: trajectories ``[0, n_train)`` are for training and
``[n_train, n_train + n_test)`` are held out (attributes ``n_train`` and ``n_test``; see
:func:`trajectory_split`). Trajectory ``i`` is drawn from the same seeded stream whatever the
split sizes, so growing ``n_test`` keeps the training trajectories' initial conditions.

Usage
-----
``python -m shardsci.recipes.cfd.generate --out data/generated/ns_128.h5 --resolution 128``:
writes the file if it is missing or an outdated one of ours (``--force``: also an up-to-date
one); never over a file shardsci did not write (``recipes/_generator_command.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import h5py
import torch

from shardsci.data import GenerateMode, generation_reason, replace_if_ours, temporary_beside
from shardsci.recipes._generator_command import run_generator
from shardsci.recipes.cfd.navier_stokes import (
    DOMAIN_LENGTH,
    SOLVER_VERSION,
    NavierStokes2d,
    SolverConfig,
    UnstableTimeStepError,
    random_vorticity,
)

logger = logging.getLogger(__name__)

DATASET_NAME = "vorticity"
CHUNK_SIDE = 128
CREATED_BY = "shardsci recipes.cfd.generate"

Attribute = int | float | str


@dataclass(frozen=True)
class DatasetConfig:
    """Which trajectories a dataset file holds and how they are computed.

    The defaults (FNO forcing, ν = 1e-3, 128², 40 trajectories × 20 snapshots 0.5 time units
    apart) generate in ≈20 s on two CPU cores. Consecutive snapshots differ by 26% (first) to
    5% (last) in relative L2 norm: a one-step map that is neither the identity nor chaotic. Over
    the 9.5 time units the flow speeds up to a CFL number of 0.8 at the default dt.
    """

    solver: SolverConfig = field(default_factory=SolverConfig)
    """Physics, discretisation and seed of the trajectories."""
    n_train: int = 32
    """Training trajectories, stored first."""
    n_test: int = 8
    """Held-out trajectories, stored after the training ones."""
    n_snapshots: int = 20
    """Snapshots T recorded per trajectory, the initial field included."""
    record_every: int = 20
    """Solver steps between snapshots; the record interval is ``record_every * solver.dt``."""
    warmup_steps: int = 0
    """Solver steps run from the random initial field before the first snapshot."""
    batch_size: int = 8
    """Trajectories integrated together. Each needs ≈ 20 N² × 8 bytes in float64 (170 MB at
    1024², 2.7 GB at 4096²). Not part of the file's identity."""
    device: str = "cpu"
    """Torch device the solver runs on. Not part of the file's identity."""

    def __post_init__(self) -> None:
        minimum = {
            "n_train": (self.n_train, 1),
            "n_test": (self.n_test, 0),
            "n_snapshots": (self.n_snapshots, 2),
            "record_every": (self.record_every, 1),
            "warmup_steps": (self.warmup_steps, 0),
            "batch_size": (self.batch_size, 1),
        }
        for name, (value, lowest) in minimum.items():
            if value < lowest:
                raise ValueError(f"DatasetConfig.{name} must be >= {lowest}, got {value!r}")

    @property
    def n_trajectories(self) -> int:
        """Trajectories B in the file, training and held-out."""
        return self.n_train + self.n_test

    @property
    def record_dt(self) -> float:
        """Time between consecutive snapshots, in time units."""
        return self.record_every * self.solver.dt

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Shape ``(B, T, N, N)`` of the ``vorticity`` dataset."""
        n = self.solver.resolution
        return (self.n_trajectories, self.n_snapshots, n, n)


def dataset_attributes(config: DatasetConfig) -> dict[str, Attribute]:
    """The attributes that identify the data of ``config``: equal attributes, equal data.

    All solver fields but ``max_cfl`` (a guard that refuses data, never changes it), the
    dataset fields but ``batch_size`` and ``device``, and derived provenance.
    """
    solver = dataclasses.asdict(config.solver)
    del solver["max_cfl"]
    dataset = {
        name: getattr(config, name)
        for name in ("n_train", "n_test", "n_snapshots", "record_every", "warmup_steps")
    }
    return {
        **solver,
        **dataset,
        "record_dt": config.record_dt,
        "domain_length": DOMAIN_LENGTH,
        "solver_version": SOLVER_VERSION,
    }


def generate_dataset(path: str | os.PathLike[str], config: DatasetConfig) -> Path:
    """Integrate the trajectories of ``config`` and write them to ``path``, replacing a file
    of ours there, never a file of the user's (``DataError``).

    The file is written under a temporary name in the same directory and renamed into place
    only once complete, so an interrupted or killed run never leaves a partial file at
    ``path`` (a previous file there stays intact); a killed run's temporary is removed by the
    next write (``temporary_beside``).

    Returns
    -------
    Path
        ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_beside(path)
    try:
        with h5py.File(temporary, "x") as file:
            _write_dataset(file, config)
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        replace_if_ours(temporary, path, CREATED_BY)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


def ensure_dataset(
    path: str | os.PathLike[str],
    config: DatasetConfig,
    mode: GenerateMode = GenerateMode.auto,
    anywhere: bool = True,
) -> Path:
    """Return ``path``, generating it first if ``mode`` allows and it is missing or an
    outdated file of ours (NOTE [Whose data file is it]); ``anywhere=False`` generates only
    under ``data/generated/``.

    Under several ranks call this on one rank only (then synchronise): concurrent generators
    would each write the whole file.

    Raises
    ------
    DataError
        If the file may not be generated and cannot be read as it is.
    """
    path = Path(path)
    reason = generation_reason(
        path, mode, CREATED_BY, lambda stored: outdated_reason(stored, config), anywhere
    )
    if reason is None:
        logger.info("reusing %s", path)
        return path
    logger.info("generating %s: %s", path, reason)
    return generate_dataset(path, config)


def outdated_reason(stored: dict[str, Attribute], config: DatasetConfig) -> str | None:
    """Why a file of ours with attributes ``stored`` holds other data than ``config``, or None
    if it holds the data of ``config``."""
    for name, value in dataset_attributes(config).items():
        if name not in stored:
            return f"attribute {name!r} missing"
        if stored[name] != value:
            return f"attribute {name!r} is {stored[name]!r}, expected {value!r}"
    return None


def _write_dataset(file: h5py.File, config: DatasetConfig) -> None:
    """Create the ``vorticity`` dataset and its attributes in ``file``, then fill it."""
    n = config.solver.resolution
    side = min(n, CHUNK_SIDE)
    dataset = file.create_dataset(
        DATASET_NAME, shape=config.shape, dtype="float32", chunks=(1, 1, side, side)
    )
    file.attrs.update(dataset_attributes(config))
    file.attrs["created_by"] = CREATED_BY
    file.attrs["created_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    _write_trajectories(dataset, config)


def _write_trajectories(dataset: h5py.Dataset, config: DatasetConfig) -> None:
    """Integrate the trajectories ``config.batch_size`` at a time, writing each snapshot."""
    solver = NavierStokes2d(config.solver, config.device)
    generator = torch.Generator().manual_seed(config.solver.seed)
    started = time.perf_counter()
    for start in range(0, config.n_trajectories, config.batch_size):
        stop = min(start + config.batch_size, config.n_trajectories)
        omega = random_vorticity(config.solver, stop - start, generator).to(config.device)
        omega = solver.advance(omega, config.warmup_steps)
        snapshots = solver.snapshots(omega, config.n_snapshots, config.record_every)
        for index, snapshot in enumerate(snapshots):
            dataset[start:stop, index] = snapshot.to(torch.float32).cpu().numpy()
        elapsed = time.perf_counter() - started
        logger.info("trajectories %d/%d done, %.1f s", stop, config.n_trajectories, elapsed)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point; ``argv`` defaults to ``sys.argv[1:]``."""
    run_generator(
        argv,
        description="Generate (or reuse, when up to date) a Navier–Stokes vorticity dataset.",
        default_out=Path("data/generated/ns_128.h5"),
        default=DatasetConfig(),
        ensure=ensure_dataset,
        errors=(UnstableTimeStepError,),
    )


if __name__ == "__main__":
    main()
