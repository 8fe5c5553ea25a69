"""One HDF5 dataset written by many ranks, each writing only its own block.

NOTE [Writing one HDF5 file from many ranks]
h5py here has no MPI driver, so parallel HDF5 (the ``mpio`` driver) is not available, and
HDF5 without it allows one writer per file: each process's library caches the file's metadata
and writes it back, so two processes with the file open for writing corrupt it. So only the
first rank of the mesh opens the file through HDF5, and no rank writes data through HDF5:

1. The first rank creates the file with h5py (mode ``"x"``: an existing path is refused): one
   *contiguous* dataset whose space is allocated at creation and never filled
   (``H5D_ALLOC_TIME_EARLY``, ``H5D_FILL_TIME_NEVER``: the file is extended, sparse, nothing
   is written), and the attributes. It closes the file and every rank learns the byte offset
   of the data (:func:`on_first_rank`), or the first rank's error.
2. Each rank writes the bytes of its block at their offsets with ``os.pwrite``, one write per
   run that is contiguous in both the file and the block (the block's extent along its last
   partial dim times the whole trailing dims). HDF5 never touches the raw data of a contiguous
   dataset after allocating it, so plain ``h5py`` opens the file and reads the whole array.
3. Closing is collective: every rank flushes its writes (``fsync``), then the first rank
   records ``complete = True`` (and ``steps_written``) in the dataset's attributes.

Why not per-rank part files joined by a virtual dataset: one file is what a user copies,
shares and reads with any HDF5 tool; it is the same bytes as a single-process write of the same
array (same creation, same data); and opening a virtual dataset of thousands of part files is
slow. The costs: the dataset is uncompressed and its shape is fixed at creation, so a rollout
preallocates its steps and fills them with :meth:`ShardedHDF5Writer.append` (``steps_written``
says how many are there; unwritten ones read as zeros), and every writing rank needs the file
system the first rank created the file on (as any one-file output does).

A block is written once: along mesh axes that do not shard the tensor (``Replicate``) only the
rank at coordinate 0 writes; a ``Partial`` tensor is reduced first (an all-reduce of the local
block; nothing is gathered). No rank ever holds more than its own block.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import h5py
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard

from shardsci.tensor._api import ShardTensor, redistribute
from shardsci.tensor._collectives import axis_group
from shardsci.tensor._redistribute import target_spec
from shardsci.tensor._spec import mesh_coordinate

__all__ = ["ShardedHDF5Writer", "on_first_rank", "write_sharded_hdf5"]

T = TypeVar("T")
Index = int | slice
Attribute = str | int | float | bool | Sequence[int] | Sequence[float] | Sequence[str] | np.ndarray

_NUMPY_DTYPES = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
)


def on_first_rank(fn: Callable[[], T], mesh: DeviceMesh | None) -> T:
    """Run ``fn`` on the first rank of ``mesh`` only; every rank of the mesh returns its result
    or raises its exception (same type, same message), so no rank is left waiting.

    Collective over the mesh (one object broadcast); ``mesh=None`` just calls ``fn``. The
    result must be picklable; an exception type that cannot be rebuilt from its message
    arrives as ``RuntimeError``.
    """
    if mesh is None:
        return fn()
    group = axis_group(mesh, tuple(range(mesh.ndim)))
    message: list[Any] = [None]
    if group.index == 0:
        try:
            message[0] = ("ok", fn())
        except Exception as error:  # every rank raises it below
            message[0] = ("error", type(error), str(error))
    dist.broadcast_object_list(message, src=group.global_ranks[0], group=group.group)
    outcome = message[0]
    if outcome[0] == "ok":
        return outcome[1]
    _, kind, text = outcome
    try:
        raised = kind(text)
    except Exception:
        raised = RuntimeError(f"{kind.__name__}: {text}")
    raise raised


class ShardedHDF5Writer:
    """One dataset of a new HDF5 file, written block by block from ShardTensors (NOTE [Writing
    one HDF5 file from many ranks]).

    Create it with :meth:`create` (collective over ``mesh``), write fields with :meth:`write`
    or :meth:`append` (each rank writes its own block; no communication), and :meth:`close`
    (collective) when done; as a context manager it closes on success only, so a failed run
    leaves ``complete = False``.

    Examples
    --------
    A rollout written step by step on every rank of ``mesh``, no rank holding a whole field:

    >>> with ShardedHDF5Writer.create(  # doctest: +SKIP
    ...     "prediction.h5", "velocity", (steps, *field.shape), torch.float32,
    ...     {"model": "fno3d", "resolution": 256}, mesh,
    ... ) as writer:
    ...     for _ in range(steps):
    ...         field = model(field)
    ...         writer.append(field)
    """

    def __init__(
        self,
        path: Path,
        dataset: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        offset: int,
        mesh: DeviceMesh | None,
    ) -> None:
        self.path = path
        self.dataset = dataset
        self.shape = shape
        self.dtype = dtype
        self.mesh = mesh
        self.steps_written = 0
        self._offset = offset
        self._itemsize = torch.empty((), dtype=dtype).element_size()
        self._fd: int | None = None
        self._closed = False

    # ------------------------------------------------------------------ creation
    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        dataset: str,
        shape: Sequence[int],
        dtype: torch.dtype,
        attributes: Mapping[str, Attribute] | None = None,
        mesh: DeviceMesh | None = None,
    ) -> ShardedHDF5Writer:
        """Create the file at ``path`` with one dataset of ``shape`` and ``dtype``.

        Collective over ``mesh`` (``None``: this process alone). Nothing is created if any
        argument is bad or a file (or anything else) exists at ``path``: every rank raises the
        same one-line error. Missing parent directories are created.

        Parameters
        ----------
        path : path
            The new file.
        dataset : str
            The dataset's path inside it, e.g. ``"prediction"``.
        shape : sequence of int
            Its whole shape, e.g. ``(steps, B, C, *spatial)``.
        dtype : torch.dtype
            Element type stored (fields are converted to it); one numpy has.
        attributes : mapping, optional
            File attributes that say what the data is (model, checkpoint, resolution, the mesh
            it was written from, ...): str, int, float, bool or sequences of them. The writer
            adds only ``complete`` and ``steps_written``, to the dataset; so a file written
            from any mesh is, byte for byte, the one a single process writes with the same
            attributes.
        mesh : DeviceMesh, optional
            The ranks that write; ``None`` for a single process.
        """
        path = Path(path)
        shape = _checked_shape(shape)
        if dtype not in _NUMPY_DTYPES:
            raise TypeError(
                f"cannot store {dtype} in HDF5 through numpy; expected one of "
                f"{', '.join(str(d).removeprefix('torch.') for d in _NUMPY_DTYPES)}"
            )
        file_attributes = _checked_attributes(attributes or {})

        def make() -> int:
            return _create_file(path, dataset, shape, _numpy_dtype(dtype), file_attributes)

        offset = on_first_rank(make, mesh)
        return cls(path, dataset, shape, dtype, offset, mesh)

    # ------------------------------------------------------------------ writes
    def write(self, field: torch.Tensor, index: Sequence[Index] | Index = ()) -> None:
        """Write ``field`` into ``dataset[index]``; each rank writes only its own block.

        Not collective, unless ``field`` has a ``Partial`` placement (it is reduced first).

        Parameters
        ----------
        field : Tensor
            A ShardTensor on the writer's mesh, or a plain tensor (whole, held by every rank
            alike: only the first rank writes it). Its shape must be the selection's.
        index : int, slice or sequence of them
            Selection on the leading dims (unit-step slices); an int drops its dim, the dims
            after the index are whole. ``()``: the whole dataset.
        """
        self._check_open()
        offsets, extents = self._selection(index)
        selection_shape = tuple(e for e, i in zip(extents, self._padded(index)) if i is not None)
        if tuple(field.shape) != selection_shape:
            raise ValueError(
                f"a field of shape {tuple(field.shape)} cannot fill {self.dataset}[{index!r}] of "
                f"shape {selection_shape} (dataset shape {self.shape})"
            )
        local, local_offsets = self._local_block(field)
        if local is None:
            return
        block = list(local_offsets)
        block_extents = list(local.shape)
        for dim, kept in enumerate(self._padded(index)):
            if kept is None:
                block.insert(dim, 0)
                block_extents.insert(dim, 1)
        block = [o + b for o, b in zip(offsets, block)]
        array = local.detach().to(device="cpu", dtype=self.dtype).contiguous().numpy()
        self._write_block(array.reshape(block_extents), block)

    def append(self, field: torch.Tensor) -> None:
        """Write ``field`` as the next step, ``dataset[steps_written]``."""
        if self.steps_written >= self.shape[0]:
            raise IndexError(
                f"{self.path}: all {self.shape[0]} steps of {self.dataset} are written; the "
                f"dataset's shape is fixed at creation"
            )
        self.write(field, (self.steps_written,))
        self.steps_written += 1

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        """Flush every rank's writes, then mark the dataset complete. Collective."""
        if self._closed:
            return
        self._release()
        steps = self.steps_written

        def mark_complete() -> None:
            with h5py.File(self.path, "r+") as file:
                file[self.dataset].attrs["complete"] = True
                file[self.dataset].attrs["steps_written"] = steps

        on_first_rank(mark_complete, self.mesh)

    def __enter__(self) -> ShardedHDF5Writer:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
        else:  # a collective close could wait for ranks that failed elsewhere
            self._release()

    def _release(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.path}: this writer is closed")

    # ------------------------------------------------------------------ layout
    def _padded(self, index: Sequence[Index] | Index) -> list[slice | None]:
        """Per dataset dim: the slice selected (``None`` where an int drops the dim)."""
        entries = list(index) if isinstance(index, (tuple, list)) else [index]
        if len(entries) > len(self.shape):
            raise IndexError(f"{len(entries)} indices for the {len(self.shape)}-D {self.dataset}")
        padded: list[slice | None] = []
        for dim, entry in enumerate(entries):
            size = self.shape[dim]
            if isinstance(entry, int):
                if not -size <= entry < size:
                    raise IndexError(f"index {entry} out of range for dim {dim} of size {size}")
                padded.append(None)
            elif isinstance(entry, slice):
                start, stop, step = entry.indices(size)
                if step != 1:
                    raise ValueError(f"slices must have step 1, got {entry} for dim {dim}")
                padded.append(slice(start, max(start, stop)))
            else:
                raise TypeError(f"index entries must be int or slice, got {entry!r}")
        return padded + [slice(0, size) for size in self.shape[len(entries) :]]

    def _selection(self, index: Sequence[Index] | Index) -> tuple[list[int], list[int]]:
        """Offsets and extents of ``dataset[index]`` along every dataset dim."""
        entries = list(index) if isinstance(index, (tuple, list)) else [index]
        offsets, extents = [], []
        for dim, kept in enumerate(self._padded(index)):
            if kept is None:
                offsets.append(entries[dim] % self.shape[dim])
                extents.append(1)
            else:
                offsets.append(kept.start)
                extents.append(kept.stop - kept.start)
        return offsets, extents

    def _local_block(self, field: torch.Tensor) -> tuple[torch.Tensor | None, tuple[int, ...]]:
        """This rank's block of ``field`` and its offsets, or ``None`` if another rank
        writes it (or it is empty)."""
        if not isinstance(field, ShardTensor):
            first = (
                self.mesh is None or axis_group(self.mesh, tuple(range(self.mesh.ndim))).index == 0
            )
            return (field if first and field.numel() else None), (0,) * field.ndim
        spec = field.spec
        if self.mesh is None or spec.mesh != self.mesh:
            raise ValueError(f"the field is on mesh {spec.mesh}; this writer's mesh is {self.mesh}")
        if spec.partial:
            placements = [Replicate() if isinstance(p, Partial) else p for p in spec.placements]
            field = redistribute(field, target_spec(spec, placements))
            spec = field.spec
        coordinate = mesh_coordinate(spec.mesh)
        writes = all(
            coordinate[axis] == 0
            for axis, placement in enumerate(spec.placements)
            if not isinstance(placement, Shard)
        )
        local = field.to_local()
        if not writes or local.numel() == 0:
            return None, ()
        return local, spec.local_offsets()

    # ------------------------------------------------------------------ bytes
    def _write_block(self, array: np.ndarray, offsets: Sequence[int]) -> None:
        """``array`` (the block, dataset-shaped) at ``offsets``, in contiguous runs."""
        shape, extents = self.shape, array.shape
        if not shape:
            shape, extents, offsets = (1,), (1,), (0,)
        # The runs span the trailing dims the block covers whole, plus the last partial one.
        last = len(shape) - 1
        while last > 0 and extents[last] == shape[last]:
            last -= 1
        run = math.prod(extents[last:])
        strides = np.cumprod((1, *shape[::-1]))[::-1][1:]  # elements, C order
        outer = np.indices(extents[:last]).reshape(last, -1).T if last else np.zeros((1, 0), int)
        starts = (outer + np.asarray(offsets[:last], dtype=np.int64)) @ strides[:last]
        starts = starts + offsets[last] * strides[last]
        data = memoryview(array.reshape(-1).view(np.uint8))
        run_bytes = run * self._itemsize
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY)
        for k, start in enumerate(starts.tolist()):
            _pwrite_all(
                self._fd,
                data[k * run_bytes : (k + 1) * run_bytes],
                self._offset + start * self._itemsize,
            )


def write_sharded_hdf5(
    path: str | os.PathLike[str],
    dataset: str,
    field: torch.Tensor,
    attributes: Mapping[str, Attribute] | None = None,
) -> Path:
    """Write the whole ``field`` (a ShardTensor, or a plain tensor for one process) to a new
    HDF5 file, each rank writing its own block. Collective over the field's mesh.

    Returns
    -------
    Path
        ``path``.
    """
    mesh = field.spec.mesh if isinstance(field, ShardTensor) else None
    with ShardedHDF5Writer.create(path, dataset, field.shape, field.dtype, attributes, mesh) as w:
        w.write(field)
    return Path(path)


# ---------------------------------------------------------------------------- helpers
def _create_file(
    path: Path,
    dataset: str,
    shape: tuple[int, ...],
    dtype: np.dtype,
    attributes: Mapping[str, Any],
) -> int:
    """Create the file (refusing an existing path) and return the data's byte offset."""
    if os.path.lexists(path):
        raise FileExistsError(
            f"refusing to write {path}: it exists; choose another output path or remove it"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    creation = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    creation.set_layout(h5py.h5d.CONTIGUOUS)
    creation.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    creation.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    creation.set_obj_track_times(False)  # no timestamps: equal arrays give equal files
    with h5py.File(path, "x") as file:
        file.attrs.update(attributes)
        space = h5py.h5s.create_simple(shape)
        type_id = h5py.h5t.py_create(dtype, logical=True)
        created = h5py.h5d.create(file.id, dataset.encode(), type_id, space, dcpl=creation)
        data = h5py.Dataset(created)
        data.attrs["complete"] = False
        data.attrs["steps_written"] = 0
        offset = data.id.get_offset()
    if offset is None:  # an empty dataset has no storage
        return 0
    return int(offset)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The little-endian numpy dtype of a torch dtype."""
    return np.dtype(torch.empty((), dtype=dtype).numpy().dtype).newbyteorder("<")


def _checked_shape(shape: Sequence[int]) -> tuple[int, ...]:
    checked = tuple(int(s) for s in shape)
    if any(s < 0 for s in checked) or len(checked) != len(tuple(shape)):
        raise ValueError(f"dataset shape must be non-negative ints, got {tuple(shape)}")
    return checked


def _checked_attributes(attributes: Mapping[str, Attribute]) -> dict[str, Any]:
    """Attributes as HDF5 stores them; a value it cannot is one clear error, before any file."""
    checked = {}
    for name, value in attributes.items():
        if not isinstance(name, str):
            raise TypeError(f"attribute names must be str, got {name!r}")
        if isinstance(value, (str, bool, int, float, np.generic)):
            checked[name] = value
            continue
        array = np.asarray(value)
        if array.dtype == object or array.dtype.kind not in "biufcU":
            raise TypeError(
                f"attribute {name!r} = {value!r} cannot be stored in HDF5; expected str, int, "
                f"float, bool or a sequence of them"
            )
        checked[name] = array.astype(h5py.string_dtype()) if array.dtype.kind == "U" else array
    return checked
