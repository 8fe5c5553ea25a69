"""Sharded data: each rank reads only its own slab of a field stored in HDF5.

``ShardedHDF5Field`` reads samples of a dataset as ShardTensors, every rank of the domain mesh
reading only its hyperslab; ``ShardedHDF5Field.statistics`` gives normalisation statistics
combined from a few numbers per rank; ``NextStepPairs`` yields shuffled, resumable (input,
target) batches split over data-parallel ranks.
"""

from shardsci.data._field import ShardedHDF5Field
from shardsci.data._files import DataError
from shardsci.data._hdf5 import HDF5Source
from shardsci.data._pairs import NextStepPairs, PairBatch
from shardsci.data._stats import FieldStatistics

__all__ = [
    "DataError",
    "FieldStatistics",
    "HDF5Source",
    "NextStepPairs",
    "PairBatch",
    "ShardedHDF5Field",
]
