"""A field stored in HDF5, read as ShardTensors: each rank reads only its own slab.

NOTE [Dims of a field and of the tensors read from it]
A dataset of shape ``(I_0, ..., I_{K-1}, D_K, ..., D_{n-1})`` has ``K`` leading *index dims*
(trajectory, time, ...) that pick a sample, and *sample dims* after them; some sample dims are
*spatial* (they may be sharded), the others (channels) are always read whole. Reading ``S``
samples gives a tensor of shape ``(S, D_K, ..., D_{n-1})``: dataset dim ``d >= K`` is tensor
dim ``d - K + 1``. Shard sizes and the mesh-axis mapping are given in dataset dims.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

from shardsci.data._hdf5 import FileSource, HDF5Source
from shardsci.data._stats import DEFAULT_BLOCK_BYTES, FieldStatistics, field_statistics
from shardsci.tensor._api import ShardTensor, from_local_spec
from shardsci.tensor._spec import ShardTensorSpec

__all__ = ["ShardedHDF5Field", "axis_index"]

Indices = Sequence[int | Sequence[int]] | np.ndarray
"""Leading indices of samples: one tuple of ``K`` ints per sample (a bare int when K = 1), or
an int array of shape ``(S, K)``."""


class ShardedHDF5Field:
    """An HDF5 dataset read in slabs: every rank reads only its part of the sharded dims.

    See NOTE [Dims of a field and of the tensors read from it] for the dims, and NOTE [HDF5
    handles never cross a fork]: constructing this object opens nothing.

    Parameters
    ----------
    source : path or callable
        The HDF5 file, or a zero-argument callable returning a binary file object.
    dataset : str
        The dataset's path in the file.
    mesh : DeviceMesh
        The domain mesh: every rank of it reads a different slab of the same samples. Pass
        the domain sub-mesh (``mesh["domain"]``), not a data-parallel axis: ranks along an
        axis that shards nothing read, and hold, the same slab (``Replicate``).
    shard_dims : mapping
        Mesh axis (index or name) -> the spatial dataset dim it shards. Several axes may shard
        one dim (outermost first, by increasing axis).
    index_dims : int
        Number ``K`` of leading index dims.
    spatial_dims : sequence of int, optional
        Dataset dims that are spatial; default: every dim after the index dims.
    sizes : mapping, optional
        Dataset dim -> extents of the shards along it, row-major over the axes that shard it
        (zeros allowed). Default: the ``torch.chunk`` split.
    dtype : torch.dtype, optional
        Element type of the tensors read (converted after reading); default: the file's.
    file_options : mapping, optional
        Keyword arguments for ``h5py.File``.
    """

    def __init__(
        self,
        source: FileSource,
        dataset: str,
        mesh: DeviceMesh,
        shard_dims: Mapping[int | str, int],
        *,
        index_dims: int,
        spatial_dims: Sequence[int] | None = None,
        sizes: Mapping[int, Sequence[int]] | None = None,
        dtype: torch.dtype | None = None,
        file_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.source = HDF5Source(source, dataset, file_options)
        self.mesh = mesh
        self.index_dims = index_dims
        self._spatial_dims = None if spatial_dims is None else tuple(spatial_dims)
        self._shard_dims = {axis_index(mesh, axis): dim for axis, dim in shard_dims.items()}
        self._sizes = {int(dim): tuple(extents) for dim, extents in (sizes or {}).items()}
        self._dtype = dtype

    # ------------------------------------------------------------------ layout
    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the whole dataset."""
        return self.source.shape

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """Shape of one sample, ``(D_K, ..., D_{n-1})``."""
        return self.shape[self.index_dims :]

    @cached_property
    def spatial_dims(self) -> tuple[int, ...]:
        """The dataset dims that are spatial, validated against the file."""
        ndim = len(self.shape)
        if not 0 < self.index_dims < ndim:
            raise ValueError(
                f"index_dims={self.index_dims} must leave at least one sample dim and pick "
                f"samples by at least one index dim of the {ndim}-D dataset of shape {self.shape}"
            )
        dims = self._spatial_dims
        if dims is None:
            dims = tuple(range(self.index_dims, ndim))
        if any(not self.index_dims <= d < ndim for d in dims) or len(set(dims)) != len(dims):
            raise ValueError(
                f"spatial dims {dims} must be distinct dims after the {self.index_dims} index "
                f"dims of the dataset of shape {self.shape}"
            )
        return dims

    @cached_property
    def dtype(self) -> torch.dtype:
        """Element type of the tensors read."""
        return self._dtype or torch.from_numpy(np.empty(0, self.source.dtype)).dtype

    @cached_property
    def placements(self) -> tuple[Placement, ...]:
        """Per mesh axis: ``Shard`` of the tensor dim it shards, else ``Replicate``."""
        for axis, dim in self._shard_dims.items():
            if dim not in self.spatial_dims:
                raise ValueError(
                    f"mesh axis {axis} is mapped to dataset dim {dim}, which is not one of the "
                    f"spatial dims {self.spatial_dims}"
                )
        return tuple(
            Shard(self._tensor_dim(self._shard_dims[axis]))
            if axis in self._shard_dims
            else Replicate()
            for axis in range(self.mesh.ndim)
        )

    def spec(self, n_samples: int, dtype: torch.dtype | None = None) -> ShardTensorSpec:
        """Layout of ``n_samples`` samples read as one tensor."""
        unknown = set(self._sizes) - set(self._shard_dims.values())
        if unknown:
            raise ValueError(
                f"shard sizes given for dataset dims {sorted(unknown)}, which no mesh axis "
                f"shards (sharded: {sorted(set(self._shard_dims.values()))})"
            )
        return ShardTensorSpec.build(
            self.mesh,
            self.placements,
            (n_samples, *self.sample_shape),
            dtype or self.dtype,
            {self._tensor_dim(d): extents for d, extents in self._sizes.items()},
        )

    def local_box(self) -> tuple[slice, ...]:
        """This rank's selection on every sample dim: its hyperslab of each sample."""
        spec = self.spec(1)
        offsets, shape = spec.local_offsets()[1:], spec.local_shape()[1:]
        return tuple(slice(o, o + n) for o, n in zip(offsets, shape))

    def _tensor_dim(self, dataset_dim: int) -> int:
        return dataset_dim - self.index_dims + 1

    # ------------------------------------------------------------------ reads
    def read(self, indices: Indices, dtype: torch.dtype | None = None) -> ShardTensor:
        """This rank's slab of the samples at ``indices``, as one ShardTensor.

        Returns
        -------
        ShardTensor
            Shape ``(S, D_K, ..., D_{n-1})``, sample ``i`` at ``indices[i]`` (repeats
            allowed); the rank holds only its slab, read from the file and nothing else.
        """
        return self.read_many(indices, dtype=dtype)[0]

    def read_many(
        self, *index_lists: Indices, dtype: torch.dtype | None = None
    ) -> tuple[ShardTensor, ...]:
        """One ShardTensor per list of indices; a sample in several lists is read once
        (inputs and targets of next-step pairs share snapshots)."""
        if not index_lists:
            return ()
        arrays = [self.checked_indices(indices) for indices in index_lists]
        unique, inverse = np.unique(np.concatenate(arrays), axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
        block = self.read_local(unique, dtype)
        results = []
        start = 0
        for array in arrays:
            rows = inverse[start : start + len(array)]
            start += len(array)
            same = len(rows) == len(unique) and bool((rows == np.arange(len(rows))).all())
            local = block if same else block[torch.from_numpy(rows)]
            results.append(from_local_spec(local, self.spec(len(array), local.dtype)))
        return tuple(results)

    def read_local(self, indices: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
        """This rank's slab of sorted, distinct samples ``(S, K)`` as a plain tensor."""
        dtype = dtype or self.dtype
        box = self.local_box()
        shape = (len(indices), *(s.stop - s.start for s in box))
        buffer = np.empty(shape, self.source.dtype)
        if buffer.size:  # an empty slab reads nothing
            self.source.read_box(indices, box, buffer)
        # Converting after the read is ~10x faster than HDF5's conversion while reading.
        return torch.from_numpy(buffer).to(dtype)

    def checked_indices(self, indices: Indices) -> np.ndarray:
        """``indices`` as an int64 array ``(S, K)``, each within the index dims' extents."""
        array = np.asarray(indices, dtype=np.int64)
        if array.size == 0 or (self.index_dims == 1 and array.ndim == 1):
            array = array.reshape(-1, self.index_dims)
        if array.ndim != 2 or array.shape[1] != self.index_dims:
            raise ValueError(
                f"expected sample indices of shape (S, {self.index_dims}) (one entry per index "
                f"dim), got shape {array.shape}"
            )
        extents = np.asarray(self.shape[: self.index_dims])
        bad = ((array < 0) | (array >= extents)).any(axis=1)
        if bad.any():
            raise IndexError(
                f"sample index {tuple(array[bad][0].tolist())} is out of range for index dims "
                f"of extents {tuple(extents.tolist())}"
            )
        return array

    def statistics(
        self, indices: Indices, max_block_bytes: int = DEFAULT_BLOCK_BYTES
    ) -> FieldStatistics:
        """Mean, std, min and max over the distinct samples at ``indices`` and all spatial
        cells, per channel, identical on every rank; each rank reads only its slab, at most
        ``max_block_bytes`` of float64 at a time. Collective over the mesh (see
        :mod:`shardsci.data._stats`)."""
        return field_statistics(self, indices, max_block_bytes)

    def close(self) -> None:
        """Close this process's file handle."""
        self.source.close()

    def __repr__(self) -> str:
        return (
            f"ShardedHDF5Field({self.source.source!r}, {self.source.dataset_name!r}, "
            f"shard_dims={self._shard_dims}, index_dims={self.index_dims})"
        )


def axis_index(mesh: DeviceMesh, axis: int | str) -> int:
    """The index of a mesh axis given by index or name."""
    names = mesh.mesh_dim_names or ()
    if isinstance(axis, str):
        if axis not in names:
            raise ValueError(f"mesh has no axis named {axis!r}; its axes are {names}")
        return names.index(axis)
    if not 0 <= axis < mesh.ndim:
        raise ValueError(f"mesh axis {axis} is out of range for a {mesh.ndim}-D mesh")
    return axis
