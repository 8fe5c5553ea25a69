"""Sharded data: each rank reads only its own slab of a field stored in HDF5.

``ShardedHDF5Field`` reads samples of a dataset as ShardTensors, every rank of the domain mesh
reading only its hyperslab; ``ShardedHDF5Field.statistics`` gives normalisation statistics
combined from a few numbers per rank; ``NextStepPairs`` yields shuffled, resumable (input,
target) batches split over data-parallel ranks, and ``HeldOutPairs`` the evaluation's pairs
and rollout starts; ``check_hdf5`` validates a user's file against a recipe's ``HDF5Schema`` and
``generation_reason`` says whether a run may generate its data (NOTE [Whose data file is it]).
``ShardedHDF5Writer`` (and ``write_sharded_hdf5``) writes a ShardTensor to one new HDF5 file,
every rank its own block, no rank holding the whole field (NOTE [Writing one HDF5 file from
many ranks]).
"""

from shardsci.data._field import ShardedHDF5Field
from shardsci.data._files import (
    CREATED_BY,
    GENERATED_DIR,
    DataError,
    DatasetSpec,
    GenerateMode,
    HDF5Contents,
    HDF5Schema,
    check_hdf5,
    generation_reason,
    in_generated_dir,
    is_ours,
    read_attributes,
    replace_if_ours,
    temporary_beside,
)
from shardsci.data._hdf5 import HDF5Source
from shardsci.data._pairs import HeldOutPairs, NextStepPairs, PairBatch
from shardsci.data._stats import FieldStatistics
from shardsci.data._writer import ShardedHDF5Writer, on_first_rank, write_sharded_hdf5

__all__ = [
    "CREATED_BY",
    "GENERATED_DIR",
    "DataError",
    "DatasetSpec",
    "FieldStatistics",
    "GenerateMode",
    "HDF5Contents",
    "HDF5Schema",
    "HDF5Source",
    "HeldOutPairs",
    "NextStepPairs",
    "PairBatch",
    "ShardedHDF5Field",
    "ShardedHDF5Writer",
    "check_hdf5",
    "generation_reason",
    "in_generated_dir",
    "is_ours",
    "on_first_rank",
    "read_attributes",
    "replace_if_ours",
    "temporary_beside",
    "write_sharded_hdf5",
]
