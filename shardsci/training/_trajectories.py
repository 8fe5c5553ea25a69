"""A recipe's file of trajectories ``(trajectory, time, [C,] *spatial)``: what it holds, whether
it must be generated first, and its generation on one rank.

A next-step recipe (2-D vorticity, a 3-D velocity) names its dataset, the dataset's dims and
its generator in a ``TrajectorySource``; the rest is the same for every such recipe. The file is
the user's or ours (NOTE [Whose data file is it] in ``shardsci/data/_files.py``). A file of the
user's is read as it is if it follows the source's ``schema`` (``data/README.md``): its shape and
``n_train``/``n_test`` attributes say what the run trains and evaluates on, and the
``data.dataset`` settings (which say how to generate data) do not apply to it. A file of ours
must hold the data ``data.dataset`` describes.
"""

from __future__ import annotations

import dataclasses
import logging
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from shardsci.data import DataError, DatasetSpec, HDF5Schema, check_hdf5, generation_reason
from shardsci.training._fields import CHANNELS
from shardsci.training._schema import config_from

__all__ = ["Trajectories", "TrajectorySource"]

logger = logging.getLogger(__name__)

_INDEX_DIMS = ("trajectory", "time")


@dataclass(frozen=True)
class Trajectories:
    """What a data file holds: trajectories ``[0, n_train)`` train, the next ``n_test`` are
    held out; each has ``n_snapshots`` samples of ``sample_sizes``.

    Attributes
    ----------
    path : Path
    n_train, n_test, n_snapshots : int
    sample_sizes : mapping
        The dims of one sample and their sizes, in order: ``{"H": 64, "W": 64}``, or
        ``{"C": 3, "D": 32, "H": 32, "W": 32}``.
    """

    path: Path
    n_train: int
    n_test: int
    n_snapshots: int
    sample_sizes: Mapping[str, int]

    @property
    def spatial_sizes(self) -> dict[str, int]:
        """The spatial dims of a sample and their sizes (the channels left out)."""
        return {dim: size for dim, size in self.sample_sizes.items() if dim != CHANNELS}

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """``(C, *spatial)`` of one sample as a model sees it: one channel for a scalar field."""
        return (self.sample_sizes.get(CHANNELS, 1), *self.spatial_sizes.values())

    def training_samples(self, unrolled: int = 1) -> int:
        """Training samples of ``unrolled`` records after their input (1: (t, t + 1) pairs)."""
        return self.n_train * (self.n_snapshots - unrolled)

    def describe(self) -> str:
        """``32 training and 8 held-out trajectories of 20 snapshots of 64x64``."""
        cells = "x".join(str(n) for n in self.spatial_sizes.values())
        channels = self.sample_sizes.get(CHANNELS)
        fields = f"{channels} channels of {cells}" if channels else cells
        return (
            f"{self.n_train} training and {self.n_test} held-out trajectories of "
            f"{self.n_snapshots} snapshots of {fields}"
        )


@dataclass(frozen=True)
class TrajectorySource:
    """A recipe's dataset of trajectories and how shardsci generates it.

    Attributes
    ----------
    dataset : str
        The dataset's path in the file, e.g. ``"vorticity"``.
    dims : tuple of str
        Its dims: ``("trajectory", "time", [C,] *spatial)``.
    created_by : str
        The ``created_by`` attribute of the files the generator writes.
    config_type : type
        The generator's dataset config (``data.dataset``); it has ``n_train``, ``n_test``,
        ``n_snapshots`` and ``shape`` (the dataset's).
    generate : callable
        ``generate(path, config)``: write the file of ``config`` at ``path``, in one process.
    outdated : callable
        ``outdated(attributes, config)``: why a file of ours with these attributes holds other
        data than ``config``, or None.
    channels : int or None
        The size of the channel dim, when ``dims`` has one.
    generates_on_mesh : bool
        Whether ``generate(path, config, mesh, placements)`` also runs collectively over a
        DeviceMesh, each rank integrating and writing its own blocks of the fields
        ``(B, [C,] *spatial)`` placed by ``placements``.
    """

    dataset: str
    dims: tuple[str, ...]
    created_by: str
    config_type: type
    generate: Callable[[Path, Any], Any]
    outdated: Callable[[Mapping[str, Any], Any], str | None]
    channels: int | None = None
    generates_on_mesh: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "dims", tuple(self.dims))
        if self.dims[:2] != _INDEX_DIMS or (CHANNELS in self.dims) != (self.channels is not None):
            raise ValueError(
                f"TrajectorySource dims {self.dims} (channels={self.channels}): expected "
                f"{_INDEX_DIMS} first, and the channel dim {CHANNELS!r} with its size or neither"
            )

    @property
    def schema(self) -> HDF5Schema:
        """What a training run reads from a file (``data/README.md``)."""
        return HDF5Schema(
            datasets=(self._dataset_spec,),
            attributes={"n_train": int, "n_test": int},
            min_sizes={"trajectory": 2, "time": 2},
        )

    @property
    def prediction_schema(self) -> HDF5Schema:
        """What a prediction reads from a file: the dataset only (no split)."""
        return HDF5Schema(datasets=(self._dataset_spec,), min_sizes={"time": 2})

    @property
    def _dataset_spec(self) -> DatasetSpec:
        dims = tuple(self.channels if d == CHANNELS else d for d in self.dims)
        return DatasetSpec(self.dataset, dims, ("float32", "float64"))

    def config_of_attributes(self, attributes: Mapping[str, Any]) -> Any:
        """The dataset config of a file of ours from its attributes (the fields of the config
        and of its nested configs that the file records; the others take their defaults)."""
        return _dataclass_of(self.config_type, attributes)

    def config(self, node: DictConfig | Mapping[str, Any]) -> Any:
        """The generator's dataset config of a ``data.dataset`` node; ``ValueError`` naming a
        setting out of range."""
        try:
            return config_from(self.config_type, node)
        except (TypeError, ValueError) as error:
            raise ValueError(f"data.dataset: {error}") from error

    def of_config(self, path: Path, config: Any) -> Trajectories:
        """What the file of ``config`` at ``path`` will hold once generated."""
        sizes = dict(zip(self.dims[2:], config.shape[2:]))
        return Trajectories(path, config.n_train, config.n_test, config.n_snapshots, sizes)

    def inspect(self, data: DictConfig) -> tuple[Trajectories, str | None]:
        """What a run with the ``data`` config will read, and why its file must be generated
        first (None: it is read as it is). Reads metadata only, writes nothing.

        Raises
        ------
        DataError
            If the file may neither be generated nor read (missing, not ours and not following
            ``schema``, ours but outdated where the run may not regenerate it).
        """
        config = self.config(data.dataset)
        path = Path(data.path)
        reason = generation_reason(
            path, data.generate, self.created_by, lambda stored: self.outdated(stored, config)
        )
        if reason is not None:
            return self.of_config(path, config), reason
        return self.read(path), None

    def read(self, path: Path) -> Trajectories:
        """The trajectories of the file at ``path``, validated against ``schema``."""
        contents = check_hdf5(path, self.schema)
        n_train, n_test = contents.attributes["n_train"], contents.attributes["n_test"]
        count = contents.sizes["trajectory"]
        if n_train < 1 or n_test < 1 or n_train + n_test != count:
            raise DataError(
                f"data file {path}: attributes n_train={n_train} and n_test={n_test} must be "
                f">= 1 and add up to the {count} trajectories of dataset {self.dataset!r}"
            )
        shape = contents.shapes[self.dataset]
        return Trajectories(
            path, n_train, n_test, contents.sizes["time"], dict(zip(self.dims[2:], shape[2:]))
        )

    def prepare(self, cfg: DictConfig) -> None:
        """Generate the run's data file if it must (``Recipe.prepare``: on one rank only)."""
        trajectories, reason = self.inspect(cfg.data)
        if reason is not None:
            logger.info("generating %s: %s", trajectories.path, reason)
            self.generate(trajectories.path, self.config(cfg.data.dataset))


def _dataclass_of(kind: type, attributes: Mapping[str, Any]) -> Any:
    hints = typing.get_type_hints(kind)
    values = {}
    for field in dataclasses.fields(kind):
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            values[field.name] = _dataclass_of(hint, attributes)
        elif field.name in attributes:
            values[field.name] = attributes[field.name]
    return kind(**values)
