"""Write, and reuse, HDF5 files of 3-D forced-turbulence trajectories for the cfd3d recipe.

File layout
-----------
``velocity``
    ``(B, T, 3, N, N, N)`` float32, snapshot ``t`` of trajectory ``b`` at time
    ``(warmup_steps + t * record_every) * dt``, the three velocity components (u_x, u_y, u_z)
    as channels. Contiguous: it is written block by block at byte offsets
    (:class:`~shardsci.data.ShardedHDF5Writer`), and ``ShardedHDF5Field`` reads any hyperslab
    of it (NOTES.md: contiguous reads of a slab are as fast as chunked ones).
attributes
    Every field of :class:`~recipes.cfd3d.navier_stokes.SolverConfig` and of
    :class:`DatasetConfig` that determines the data, plus ``record_dt``, ``domain_length``,
    ``solver_version``, ``created_by`` (NOTE [Whose data file is it] in
    ``shardsci/data/_files.py``) and ``created_at``; the dataset's ``complete`` is true once
    every snapshot is written.

Split
-----
Trajectories ``[0, n_train)`` are for training and ``[n_train, n_train + n_test)`` are held
out. Trajectory ``i`` is drawn from the same seeded stream whatever the split sizes and the
batching.

Several ranks
-------------
``generate_dataset(path, config, mesh, placements)`` integrates each batch of trajectories as
ShardTensors of shape ``(B, 3, N, N, N)`` laid out by ``placements`` (sharding D, H and W,
dims 2, 3, 4) over ``mesh``: the initial fields are drawn block by block, the solver runs on
shardsci's distributed FFT and every rank writes its own block of every snapshot. No rank
holds a whole field; the file is the one a single process writes (up to round-off in the
solver's sums).

Usage
-----
``python -m shardsci.recipes.cfd3d.generate --out data/generated/ns3d_32.h5``: writes the file
if it is missing or an outdated one of ours (``--force``: also an up-to-date one); never over
a file shardsci did not write.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

from shardsci import ShardTensorSpec
from shardsci.data import (
    GenerateMode,
    ShardedHDF5Writer,
    generation_reason,
    on_first_rank,
    replace_if_ours,
    temporary_beside,
)
from shardsci.recipes._generator_command import run_generator
from shardsci.recipes.cfd3d.navier_stokes import (
    DOMAIN_LENGTH,
    SOLVER_VERSION,
    NavierStokes3d,
    SolverConfig,
    UnstableTimeStepError,
    random_velocity,
)

logger = logging.getLogger(__name__)

DATASET_NAME = "velocity"
CREATED_BY = "shardsci recipes.cfd3d.generate"
SPATIAL_DIMS = (2, 3, 4)
"""The dims D, H, W of a batch of velocity fields ``(B, 3, N, N, N)``: the ones a mesh shards."""

Attribute = int | float | str


def _dataset_solver() -> SolverConfig:
    return SolverConfig(precision="float32")


@dataclass(frozen=True)
class DatasetConfig:
    """Which trajectories a dataset file holds and how they are computed.

    The defaults: 32³ band-forced turbulence (Re_λ ≈ 25, k_max η = 1.2), 6 trajectories × 16
    snapshots 0.04 time units apart after a spin-up of 0.3 (about one large-eddy turnover),
    integrated in float32 (the file stores float32, and the flow is chaotic: a float64 run is
    another sample of the same statistics at twice the cost). Consecutive snapshots differ by
    14-21% in relative L2 norm (17% on average, 20% at the first pair and 16% at the last: the
    spun-up flow still settles a little), the energy stays within 0.53-0.60 and the CFL number
    below 0.52. Generating them takes ≈ 60 s of CPU in one thread (measured on 2026-11-27;
    3.5 min of wall time at a load average of 11 on the 2 shared cores).
    """

    solver: SolverConfig = field(default_factory=_dataset_solver)
    """Physics, discretisation and seed of the trajectories."""
    n_train: int = 4
    """Training trajectories, stored first."""
    n_test: int = 2
    """Held-out trajectories, stored after the training ones."""
    n_snapshots: int = 16
    """Snapshots T recorded per trajectory."""
    record_every: int = 16
    """Solver steps between snapshots; the record interval is ``record_every * solver.dt``."""
    warmup_steps: int = 120
    """Solver steps run from the random initial field before the first snapshot: the initial
    field has the stationary energy and dissipation but random phases; 0.3 time units (about
    one large-eddy turnover) let the cascade build its correlations."""
    batch_size: int = 6
    """Trajectories integrated together. Each needs ≈ 25 N³ × 8 bytes in float64 (400 MB at
    128³, 3.4 GB at 256³: shard it over ranks). Not part of the file's identity."""
    device: str = "cpu"
    """Torch device the solver runs on in a single process. Not part of the file's identity."""

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
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """Shape ``(B, T, 3, N, N, N)`` of the ``velocity`` dataset."""
        n = self.solver.resolution
        return (self.n_trajectories, self.n_snapshots, 3, n, n, n)


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


def generate_dataset(
    path: str | os.PathLike[str],
    config: DatasetConfig,
    mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
) -> Path:
    """Integrate the trajectories of ``config`` and write them to ``path``, replacing a file
    of ours there, never a file of the user's (``DataError``).

    Collective over ``mesh`` when given: the fields are sharded as ``placements`` (one per
    mesh axis, ``Shard`` of dims 2, 3, 4 or ``Replicate``) and every rank writes its own
    blocks. The file is written under a temporary name in the same directory and renamed into
    place only once complete, so an interrupted run never leaves a partial file at ``path``.

    Returns
    -------
    Path
        ``path``.
    """
    path = Path(path)
    placements = _checked_placements(mesh, placements)
    temporary = on_first_rank(lambda: temporary_beside(path), mesh)
    attributes = {
        **dataset_attributes(config),
        "created_by": CREATED_BY,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        with ShardedHDF5Writer.create(
            temporary, DATASET_NAME, config.shape, torch.float32, attributes, mesh
        ) as writer:
            _write_trajectories(writer, config, mesh, placements)
        on_first_rank(lambda: replace_if_ours(temporary, path, CREATED_BY), mesh)
    except BaseException:
        if _is_first_rank(mesh):
            temporary.unlink(missing_ok=True)
        raise
    return path


def ensure_dataset(
    path: str | os.PathLike[str],
    config: DatasetConfig,
    mode: GenerateMode = GenerateMode.auto,
    anywhere: bool = True,
    mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
) -> Path:
    """Return ``path``, generating it first if ``mode`` allows and it is missing or an
    outdated file of ours (NOTE [Whose data file is it]); ``anywhere=False`` generates only
    under ``data/generated/``. Collective over ``mesh`` when given (the first rank decides,
    every rank generates).

    Raises
    ------
    DataError
        If the file may not be generated and cannot be read as it is (on every rank).
    """
    path = Path(path)

    def reason() -> str | None:
        return generation_reason(
            path, mode, CREATED_BY, lambda stored: outdated_reason(stored, config), anywhere
        )

    why = on_first_rank(reason, mesh)
    if why is None:
        logger.info("reusing %s", path)
        return path
    logger.info("generating %s: %s", path, why)
    return generate_dataset(path, config, mesh, placements)


def outdated_reason(stored: Mapping[str, Any], config: DatasetConfig) -> str | None:
    """Why a file of ours with attributes ``stored`` holds other data than ``config``, or None
    if it holds the data of ``config``."""
    for name, value in dataset_attributes(config).items():
        if name not in stored:
            return f"attribute {name!r} missing"
        if stored[name] != value:
            return f"attribute {name!r} is {stored[name]!r}, expected {value!r}"
    return None


def _write_trajectories(
    writer: ShardedHDF5Writer,
    config: DatasetConfig,
    mesh: DeviceMesh | None,
    placements: tuple[Placement, ...] | None,
) -> None:
    """Integrate the trajectories ``config.batch_size`` at a time, writing each snapshot."""
    solver = NavierStokes3d(config.solver)
    generator = torch.Generator().manual_seed(config.solver.seed)
    n = config.solver.resolution
    started = time.perf_counter()
    for start in range(0, config.n_trajectories, config.batch_size):
        stop = min(start + config.batch_size, config.n_trajectories)
        layout = None
        if mesh is not None:
            shape = (stop - start, 3, n, n, n)
            layout = ShardTensorSpec.build(mesh, placements, shape, config.solver.torch_dtype)
        velocity = random_velocity(config.solver, stop - start, generator, layout)
        if layout is None:
            velocity = velocity.to(config.device)
        velocity = solver.advance(velocity, config.warmup_steps)
        snapshots = solver.snapshots(velocity, config.n_snapshots, config.record_every)
        for index, snapshot in enumerate(snapshots):
            writer.write(snapshot, (slice(start, stop), index))
        elapsed = time.perf_counter() - started
        logger.info("trajectories %d/%d done, %.1f s", stop, config.n_trajectories, elapsed)


def _checked_placements(
    mesh: DeviceMesh | None, placements: Sequence[Placement] | None
) -> tuple[Placement, ...] | None:
    if mesh is None:
        if placements is not None:
            raise ValueError("placements were given without a mesh")
        return None
    placements = tuple(placements or [Replicate()] * mesh.ndim)
    bad = [
        p
        for p in placements
        if not (isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim in SPATIAL_DIMS))
    ]
    if len(placements) != mesh.ndim or bad:
        raise ValueError(
            f"placements {placements} for a {mesh.ndim}-D mesh: expected one per mesh axis, "
            f"each Shard(2), Shard(3), Shard(4) (D, H, W of (B, 3, N, N, N)) or Replicate()"
        )
    return placements


def _is_first_rank(mesh: DeviceMesh | None) -> bool:
    return mesh is None or all(c == 0 for c in (mesh.get_coordinate() or [1]))


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point; ``argv`` defaults to ``sys.argv[1:]``."""
    run_generator(
        argv,
        description="Generate (or reuse, when up to date) a 3-D forced-turbulence velocity dataset.",
        default_out=Path("data/generated/ns3d_32.h5"),
        default=DatasetConfig(),
        ensure=ensure_dataset,
        errors=(UnstableTimeStepError,),
    )


if __name__ == "__main__":
    main()
