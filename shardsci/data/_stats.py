"""Normalisation statistics of a sharded field, computed without gathering it.

Each rank reduces its own slab, a bounded block of samples at a time, to per-channel moments
(count, mean, sum of squared deviations, min, max) in float64, merged with Chan et al.'s
pairwise update. The ranks then merge their moments axis by axis: along every mesh axis that
shards the field, each rank gathers its group's moments (a few numbers per channel) and merges
them in group order, so all ranks end with bitwise-identical statistics. Ranks along an axis
that shards nothing hold the same slab and already agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

if TYPE_CHECKING:
    from shardsci.data._field import Indices, ShardedHDF5Field

__all__ = ["DEFAULT_BLOCK_BYTES", "FieldStatistics", "field_statistics"]

DEFAULT_BLOCK_BYTES = 64 * 2**20


@dataclass(frozen=True)
class FieldStatistics:
    """Statistics over samples and spatial cells, per channel (non-spatial sample dim).

    Attributes
    ----------
    count : int
        Values per channel: samples times spatial cells.
    mean, std, min, max : Tensor
        float64, shape ``(C_0, ...)`` of the non-spatial sample dims (0-d when none); ``std``
        is the population standard deviation (``ddof=0``, as ``numpy.std``).
    """

    count: int
    mean: torch.Tensor
    std: torch.Tensor
    min: torch.Tensor
    max: torch.Tensor


@dataclass(frozen=True)
class _Moments:
    count: float
    mean: torch.Tensor
    m2: torch.Tensor
    min: torch.Tensor
    max: torch.Tensor

    @staticmethod
    def empty(shape: tuple[int, ...]) -> _Moments:
        zeros = torch.zeros(shape, dtype=torch.float64)
        inf = torch.full(shape, torch.inf, dtype=torch.float64)
        return _Moments(0.0, zeros, zeros, inf, -inf)

    @staticmethod
    def of(block: torch.Tensor, dims: tuple[int, ...]) -> _Moments:
        mean = block.mean(dims)
        centred = block - mean.reshape(_kept_shape(block, dims))
        return _Moments(
            float(block.numel() // max(mean.numel(), 1)),
            mean,
            centred.square().sum(dims),
            block.amin(dims),
            block.amax(dims),
        )

    def merged(self, other: _Moments) -> _Moments:
        """Chan et al.'s parallel update of the mean and the sum of squared deviations."""
        count = self.count + other.count
        if other.count == 0:
            return self
        if self.count == 0:
            return other
        delta = other.mean - self.mean
        return _Moments(
            count,
            self.mean + delta * (other.count / count),
            self.m2 + other.m2 + delta.square() * (self.count * other.count / count),
            torch.minimum(self.min, other.min),
            torch.maximum(self.max, other.max),
        )

    def packed(self) -> torch.Tensor:
        parts = [self.mean, self.m2, self.min, self.max]
        return torch.cat(
            [torch.tensor([self.count], dtype=torch.float64)] + [p.reshape(-1) for p in parts]
        )

    @staticmethod
    def unpacked(flat: torch.Tensor, shape: tuple[int, ...]) -> _Moments:
        mean, m2, low, high = (part.reshape(shape) for part in flat[1:].chunk(4))
        return _Moments(float(flat[0]), mean, m2, low, high)


def field_statistics(
    field: ShardedHDF5Field, indices: Indices, max_block_bytes: int = DEFAULT_BLOCK_BYTES
) -> FieldStatistics:
    """Mean, std, min and max of ``field`` over the distinct samples at ``indices`` and all
    spatial cells; every rank reads only its slab and gets identical results.

    Collective over the field's mesh: every rank calls it with the same ``indices``. Each
    rank reads at most ``max_block_bytes`` of float64 (but at least one sample) at a time.
    """
    samples = np.unique(field.checked_indices(indices), axis=0)
    if len(samples) == 0:
        raise ValueError("statistics need at least one sample; got no indices")
    dims = (0, *(d - field.index_dims + 1 for d in field.spatial_dims))
    channels = tuple(n for d, n in enumerate(field.sample_shape, 1) if d not in dims)
    moments = _local_moments(field, samples, dims, channels, max_block_bytes)
    for axis, placement in enumerate(field.placements):
        if isinstance(placement, Shard):
            moments = _merged_along(field.mesh.get_group(axis), moments, channels)
    return FieldStatistics(
        count=int(moments.count),
        mean=moments.mean,
        std=(moments.m2 / moments.count).sqrt(),
        min=moments.min,
        max=moments.max,
    )


def _local_moments(
    field: ShardedHDF5Field,
    samples: np.ndarray,
    dims: tuple[int, ...],
    channels: tuple[int, ...],
    max_block_bytes: int,
) -> _Moments:
    """Moments of this rank's slab, read block by block of samples."""
    moments = _Moments.empty(channels)
    box = field.local_box()
    sample_bytes = 8 * int(np.prod([s.stop - s.start for s in box]))
    if sample_bytes == 0:
        return moments
    step = max(1, max_block_bytes // sample_bytes)
    for start in range(0, len(samples), step):
        block = field.read_local(samples[start : start + step], torch.float64)
        moments = moments.merged(_Moments.of(block, dims))
    return moments


def _merged_along(
    group: dist.ProcessGroup, moments: _Moments, channels: tuple[int, ...]
) -> _Moments:
    packed = moments.packed().to(_group_device(group))
    gathered = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, packed, group=group)
    merged = _Moments.empty(channels)
    for flat in gathered:
        merged = merged.merged(_Moments.unpacked(flat.cpu(), channels))
    return merged


def _group_device(group: dist.ProcessGroup) -> torch.device:
    """Where ``group``'s collectives take their tensors: NCCL only CUDA ones, gloo CPU ones."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _kept_shape(block: torch.Tensor, dims: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(1 if d in dims else n for d, n in enumerate(block.shape))
