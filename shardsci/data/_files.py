"""The user's data is theirs: files are checked against what a run reads, and never modified.

NOTE [Whose data file is it]
A run reads the HDF5 file at its ``data.path``. shardsci writes a data file only when the user
asked for generated data, and never over a file it did not write:

- A file is *ours* when its ``created_by`` attribute names a shardsci generator; every other
  file is the user's, whatever its name or place.
- ``data.generate=auto`` (default) generates a missing file, or regenerates an outdated one of
  ours, only under ``data/generated/`` (relative to the working directory: the place for data
  shardsci made, see ``data/README.md``). Anywhere else a missing file is an error, not a
  generation, and an outdated file of ours is an error naming the difference.
- ``data.generate=never`` only reads: a missing or outdated file is an error.
- ``data.generate=force`` (re)generates wherever the path points, if no file is there or the
  file there is ours.
- A user's file is read as it is, after ``check_hdf5`` validated it against the recipe's
  ``HDF5Schema`` (dataset name, rank, dtype, attributes); any mismatch is one ``DataError``
  naming it. Nothing here opens a file for writing, and generators write a temporary file
  (``temporary_beside``) that replaces the target only if the target is missing or ours
  (``replace_if_ours``).

NOTE [A data file's metadata is read once per process]
A run asks about its data file several times: the launcher's checks (is the file ours, is it
outdated, does it follow the schema), rank 0's preparation, every rank's reader. Each question
is answered from ``read_metadata``, which opens the file once per process and keeps what it
found (the attributes, every dataset's shape and dtype) under the file's identity and version:
its resolved path, device, inode, size, and modification and change times. Ranks forked by
``train.py`` inherit the launcher's entry and open the file only to read data; a file replaced in
between (generated into a temporary file and renamed over the target: a new inode) is read
again. An edit in place that keeps the size, within one tick of the file system's clock after
this process read the file, would go unseen here; shardsci never edits a data file in place.
The entries live in one of shardsci's bounded caches (``clear_caches`` empties it);
``tests/test_planned_once.py`` counts the openings per process of a real run.
"""

from __future__ import annotations

import enum
import glob
import os
import socket
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from shardsci.tensor._caches import BoundedCache

__all__ = [
    "CREATED_BY",
    "GENERATED_DIR",
    "DataError",
    "DatasetSpec",
    "GenerateMode",
    "HDF5Contents",
    "HDF5Metadata",
    "HDF5Schema",
    "check_hdf5",
    "generation_reason",
    "in_generated_dir",
    "is_ours",
    "read_attributes",
    "read_metadata",
    "replace_if_ours",
    "temporary_beside",
]

CREATED_BY = "created_by"
"""The attribute naming the shardsci generator that wrote a file (NOTE [Whose data file is
it])."""

GENERATED_DIR = Path("data") / "generated"
"""Where ``data.generate=auto`` may write, relative to the working directory."""


class DataError(ValueError):
    """A data file is missing, unreadable, or not what the run expects; the message names the
    file and the mismatch."""


class GenerateMode(enum.Enum):
    """When a run may write its data file (``data.generate``; NOTE [Whose data file is it])."""

    auto = "auto"
    """Generate a missing file, or regenerate an outdated one of ours, under data/generated/."""
    never = "never"
    """Only read: a missing or outdated file is an error."""
    force = "force"
    """(Re)generate at the path, unless a file that is not ours is there."""


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset a run reads.

    Attributes
    ----------
    name : str
        The dataset's path in the file.
    dims : tuple of str or int
        Per dim, a name (every dataset naming it must have the same size along it) or the
        exact size.
    dtypes : tuple of str
        Accepted numpy dtypes, e.g. ``("float32", "float64")``.
    """

    name: str
    dims: tuple[str | int, ...]
    dtypes: tuple[str, ...]

    def describe(self) -> str:
        dims = ", ".join(str(d) for d in self.dims)
        return f"{self.name!r} ({dims}) {'/'.join(self.dtypes)}"


@dataclass(frozen=True)
class HDF5Schema:
    """What a run reads from an HDF5 file (documented in ``data/README.md``).

    Attributes
    ----------
    datasets : tuple of DatasetSpec
    attributes : mapping
        Required file attributes and their kinds: ``int``, ``float`` or ``str``.
    min_sizes : mapping
        Smallest size of a named dim (1 for the others).
    """

    datasets: tuple[DatasetSpec, ...]
    attributes: Mapping[str, type] = field(default_factory=dict)
    min_sizes: Mapping[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        datasets = "; ".join(spec.describe() for spec in self.datasets)
        attributes = ", ".join(f"{k} ({t.__name__})" for k, t in self.attributes.items())
        return f"datasets {datasets}" + (f"; attributes {attributes}" if attributes else "")


@dataclass(frozen=True)
class HDF5Contents:
    """What ``check_hdf5`` found: every dataset's shape and dtype, the size of every named
    dim, the file's attributes."""

    shapes: Mapping[str, tuple[int, ...]]
    dtypes: Mapping[str, str]
    sizes: Mapping[str, int]
    attributes: Mapping[str, Any]


@dataclass(frozen=True)
class HDF5Metadata:
    """What an HDF5 file holds, without its data.

    Attributes
    ----------
    shapes : mapping
        Every dataset's path in the file -> its shape.
    dtypes : mapping
        Every dataset's path -> its numpy dtype's name.
    attributes : mapping
        The file's attributes, as Python scalars and strings.
    """

    shapes: Mapping[str, tuple[int, ...]]
    dtypes: Mapping[str, str]
    attributes: Mapping[str, Any]


_METADATA: BoundedCache[tuple, HDF5Metadata] = BoundedCache("HDF5 file metadata", maxsize=64)


def read_metadata(path: str | os.PathLike[str]) -> HDF5Metadata:
    """The metadata of the HDF5 file at ``path``, read once per process and version of the
    file (NOTE [A data file's metadata is read once per process]); ``DataError`` if it cannot be
    read as HDF5 (missing, truncated, not HDF5)."""
    path = Path(path)
    if not path.is_file():
        problem = "is not a file" if path.exists() else "does not exist"
        raise DataError(f"data file {path} {problem}")
    stat = path.stat()
    version = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    key = (str(path.resolve()), *version)
    return _METADATA.get_or_make(key, lambda: _read_metadata(path))


def _read_metadata(path: Path) -> HDF5Metadata:
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}

    def visit(name: str, item: Any) -> None:
        if isinstance(item, h5py.Dataset):
            shapes[name], dtypes[name] = tuple(item.shape), np.dtype(item.dtype).name

    try:
        with h5py.File(path, "r") as file:
            attributes = {name: _plain(value) for name, value in file.attrs.items()}
            file.visititems(visit)
    except OSError as error:
        raise DataError(f"data file {path} cannot be read as HDF5 ({_reason(error)})") from None
    return HDF5Metadata(shapes, dtypes, attributes)


def read_attributes(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The file attributes of the HDF5 file at ``path`` (``read_metadata``); ``DataError`` if it
    cannot be read as HDF5 (missing, truncated, not HDF5)."""
    return dict(read_metadata(path).attributes)


def check_hdf5(path: str | os.PathLike[str], schema: HDF5Schema) -> HDF5Contents:
    """Validate the HDF5 file at ``path`` against ``schema``, reading metadata only.

    Raises
    ------
    DataError
        Naming the file and the first mismatch: not readable as HDF5 (missing, truncated,
        another format), a dataset missing or of another rank, dtype, size (a fixed one, one
        shared with another dataset, or below its minimum), a required attribute missing or
        of another kind.
    """
    path = Path(path)
    metadata = read_metadata(path)
    attributes = metadata.attributes
    expected = f"expected {schema.describe()} (see data/README.md)"
    found = {
        spec.name: (metadata.shapes[name], metadata.dtypes[name])
        for spec in schema.datasets
        if (name := spec.name.lstrip("/")) in metadata.shapes
    }
    sizes: dict[str, int] = {}
    for spec in schema.datasets:
        if spec.name not in found:
            raise DataError(f"data file {path} has no dataset {spec.name!r}; {expected}")
        shape, dtype = found[spec.name]
        where = f"data file {path}: dataset {spec.name!r} of shape {shape}"
        if len(shape) != len(spec.dims):
            raise DataError(f"{where} has {len(shape)} dims; {expected}")
        if dtype not in spec.dtypes:
            raise DataError(f"{where} has dtype {dtype}; {expected}")
        for dim, size in zip(spec.dims, shape):
            if isinstance(dim, int) and size != dim:
                raise DataError(f"{where} should have {dim} where it has {size}; {expected}")
            if isinstance(dim, str) and sizes.setdefault(dim, size) != size:
                raise DataError(
                    f"{where} has {size} along {dim}, but another dataset has {sizes[dim]}"
                )
    for dim, lowest in schema.min_sizes.items():
        if sizes.get(dim, lowest) < lowest:
            raise DataError(
                f"data file {path} has {sizes[dim]} {dim}(s), expected at least {lowest}"
            )
    for name, kind in schema.attributes.items():
        if name not in attributes:
            raise DataError(f"data file {path} lacks the attribute {name!r}; {expected}")
        if not _is_kind(attributes[name], kind):
            raise DataError(
                f"data file {path}: attribute {name!r} is {attributes[name]!r}, expected "
                f"{kind.__name__}"
            )
    shapes = {name: shape for name, (shape, _) in found.items()}
    dtypes = {name: dtype for name, (_, dtype) in found.items()}
    return HDF5Contents(shapes, dtypes, sizes, dict(attributes))


def is_ours(attributes: Mapping[str, Any], generator: str) -> bool:
    """Whether a file with these attributes was written by ``generator``."""
    return attributes.get(CREATED_BY) == generator


def in_generated_dir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` lies under ``data/generated/`` of the working directory."""
    return Path(path).resolve().is_relative_to(GENERATED_DIR.resolve())


def generation_reason(
    path: str | os.PathLike[str],
    mode: GenerateMode,
    generator: str,
    outdated: Callable[[Mapping[str, Any]], str | None],
    anywhere: bool = False,
) -> str | None:
    """Why the file at ``path`` must be (re)generated first, or None to read it as it is.

    Parameters
    ----------
    path : path
        ``data.path``.
    mode : GenerateMode
    generator : str
        The ``created_by`` value of files this recipe's generator writes.
    outdated : callable
        ``outdated(attributes)`` of a file of ours: why it holds other data than the config
        asks for, or None.
    anywhere : bool
        Let ``auto`` generate outside ``data/generated/`` too (a command whose user named the
        output file).

    Raises
    ------
    DataError
        When the run may neither generate nor read the file (NOTE [Whose data file is it]).
    """
    path = Path(path)
    may_generate = mode is GenerateMode.force or (
        mode is GenerateMode.auto and (anywhere or in_generated_dir(path))
    )
    if not path.exists():
        if may_generate:
            return "no file yet"
        hint = (
            "data.generate=never reads only"
            if mode is GenerateMode.never
            else f"data is generated only under {GENERATED_DIR}/ (or with data.generate=force)"
        )
        raise DataError(f"data file {path} does not exist; {hint}")
    attributes = read_attributes(path)
    if not is_ours(attributes, generator):
        if mode is GenerateMode.force:
            raise DataError(
                f"data.generate=force would overwrite {path}, which shardsci did not write (its "
                f"{CREATED_BY!r} attribute is {attributes.get(CREATED_BY)!r}); move it or choose "
                f"another data.path"
            )
        return None
    if mode is GenerateMode.force:
        return "data.generate=force"
    reason = outdated(attributes)
    if reason is None:
        return None
    if may_generate:
        return reason
    raise DataError(
        f"data file {path} was generated with other settings than data.dataset: {reason}; "
        f"match data.dataset to it, or regenerate it with data.generate=force"
    )


def temporary_beside(path: Path) -> Path:
    """A new name for a file being written to replace ``path`` once complete
    (``replace_if_ours``): hidden, in ``path``'s directory (so that the rename is atomic), and
    naming this host and process, ``.<name>.<host>.<pid>.<random>.tmp``.

    A writer killed by ``SIGKILL`` cannot remove its temporary; the leftovers of writers on
    this host that no longer run are removed here, before the next write. Another host's are
    left alone (their processes cannot be asked about from here)."""
    prefix = f".{path.name}.{socket.gethostname()}."
    for leftover in path.parent.glob(f"{glob.escape(prefix)}*.tmp"):
        pid = leftover.name[len(prefix) :].split(".")[0]
        if pid.isdigit() and not _running(int(pid)):
            leftover.unlink(missing_ok=True)
    return path.with_name(f"{prefix}{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def replace_if_ours(temporary: Path, path: Path, generator: str) -> None:
    """Move the finished file ``temporary`` onto ``path``, unless a file not written by
    ``generator`` is there (then ``DataError``; ``temporary`` is left for the caller)."""
    if path.exists() and not is_ours(read_attributes(path), generator):
        raise DataError(f"refusing to overwrite {path}: shardsci did not write it")
    os.replace(temporary, path)


def _is_kind(value: Any, kind: type) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _plain(value: Any) -> Any:
    """An attribute as a Python scalar (h5py gives numpy scalars and bytes)."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, np.generic):
        return value.item()
    return value


def _reason(error: OSError) -> str:
    """The useful part of h5py's message, e.g. ``truncated file: eof = 800, ...``."""
    text = str(error)
    return text.split("(", 1)[1].rstrip(")") if "(" in text else text
