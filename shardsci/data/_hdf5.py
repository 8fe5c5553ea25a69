"""An HDF5 dataset opened lazily, once per process, and read one box of samples at a time.

NOTE [HDF5 handles never cross a fork]
HDF5 is not fork-safe: a file opened in a parent and used in a forked child (a rank of a pool,
a DataLoader worker) shares the parent's library state and file offsets. :class:`HDF5Source`
therefore holds no handle until the first read, remembers the process that opened it, opens
its own on first use in any other process, and drops its handle when pickled. Open the file
inside the rank body, never before forking.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

import h5py
import numpy as np

__all__ = ["HDF5Source", "index_runs"]

FileSource = str | os.PathLike[str] | Callable[[], IO[bytes]]
"""A path, or a zero-argument callable returning a binary file object (``fsspec.open(...)``,
an instrumented file) that h5py reads through its ``fileobj`` driver."""


class HDF5Source:
    """One dataset of an HDF5 file, opened read-only on first use in each process.

    Parameters
    ----------
    source : path or callable
        The file: a path, or a zero-argument callable returning an open binary file object.
    dataset : str
        Path of the dataset inside the file, e.g. ``"vorticity"``.
    file_options : mapping, optional
        Keyword arguments for ``h5py.File`` (``rdcc_nbytes``, ``locking``, ...).
    """

    def __init__(
        self, source: FileSource, dataset: str, file_options: Mapping[str, Any] | None = None
    ) -> None:
        self.source = source
        self.dataset_name = dataset
        self.file_options = dict(file_options or {})
        self._file: h5py.File | None = None
        self._opened_by: int | None = None
        self._shape: tuple[int, ...] | None = None
        self._dtype: np.dtype | None = None

    # ------------------------------------------------------------------ metadata
    @property
    def shape(self) -> tuple[int, ...]:
        if self._shape is None:
            self._load_metadata()
        return self._shape  # type: ignore[return-value]

    @property
    def dtype(self) -> np.dtype:
        """Element type, in native byte order (HDF5 swaps bytes while reading)."""
        if self._dtype is None:
            self._load_metadata()
        return self._dtype  # type: ignore[return-value]

    def _load_metadata(self) -> None:
        dataset = self.dataset()
        self._shape, self._dtype = tuple(dataset.shape), dataset.dtype.newbyteorder("=")

    # ------------------------------------------------------------------ handle
    def dataset(self) -> h5py.Dataset:
        """The open dataset of this process (see NOTE [HDF5 handles never cross a fork])."""
        if self._file is None or self._opened_by != os.getpid():
            # A handle inherited through a fork is never read: this process opens its own.
            self._file = self._open()
            self._opened_by = os.getpid()
        return self._file[self.dataset_name]

    def _open(self) -> h5py.File:
        target = self.source() if callable(self.source) else self.source
        file = h5py.File(target, "r", **self.file_options)
        if self.dataset_name not in file:
            file.close()
            raise KeyError(f"no dataset {self.dataset_name!r} in HDF5 file {self.source!r}")
        return file

    def close(self) -> None:
        """Close this process's handle (a later read opens a new one)."""
        if self._file is not None and self._opened_by == os.getpid():
            self._file.close()
        self._file = None
        self._opened_by = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_file"] = state["_opened_by"] = None
        return state

    def __repr__(self) -> str:
        return f"HDF5Source({self.source!r}, {self.dataset_name!r})"

    # ------------------------------------------------------------------ reads
    def read_box(self, indices: np.ndarray, box: Sequence[slice], out: np.ndarray) -> None:
        """Read ``box`` of each sample into ``out``, one hyperslab per run of samples.

        Parameters
        ----------
        indices : ndarray of int, (S, K)
            Leading indices of the samples, sorted lexicographically and distinct.
        box : sequence of slice
            The selection on each remaining dim of the dataset (unit step).
        out : ndarray, (S, *box extents)
            Destination, best of the dataset's type (HDF5's own conversion is slow).
        """
        dataset = self.dataset()
        for start, stop in index_runs(indices):
            first = indices[start]
            leading = (*first[:-1].tolist(), slice(int(first[-1]), int(first[-1]) + stop - start))
            dataset.read_direct(out, (*leading, *box), np.s_[start:stop])


def index_runs(indices: np.ndarray) -> list[tuple[int, int]]:
    """Split sorted, distinct leading indices ``(S, K)`` into runs ``[start, stop)`` of rows
    that differ only by consecutive values of the last index: one hyperslab each."""
    if len(indices) == 0:
        return []
    same_prefix = (indices[1:, :-1] == indices[:-1, :-1]).all(axis=1)
    next_last = indices[1:, -1] == indices[:-1, -1] + 1
    breaks = np.flatnonzero(~(same_prefix & next_last)) + 1
    bounds = [0, *breaks.tolist(), len(indices)]
    return list(itertools.pairwise(bounds))
