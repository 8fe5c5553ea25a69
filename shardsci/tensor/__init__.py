"""ShardTensor: tensors sharded over a DeviceMesh with arbitrary shard sizes."""

from shardsci.tensor._api import ShardTensor
from shardsci.tensor._caches import cache_sizes, clear_caches
from shardsci.tensor._comm_stats import CommStats, comm_counter
from shardsci.tensor._gather_guard import (
    Gather,
    GatherError,
    GatherWarning,
    gather_policy,
    record_gathers,
)
from shardsci.tensor._halo import halo_exchange
from shardsci.tensor._options import (
    attention_exchange,
    normalization_statistics,
    overlap_halos,
)
from shardsci.tensor._registry import register_aten_handler, register_function_handler
from shardsci.tensor._scatter import distribute_tensor, scatter_tensor
from shardsci.tensor._spec import ShardTensorSpec

# Importing these binds the promotion of replicated operands and registers the handlers.
from shardsci.tensor import _promotion  # noqa: F401  isort: skip
from shardsci.tensor import _ops  # noqa: F401  isort: skip
from shardsci.tensor._torch_compile import compile_through  # isort: skip

compile_through(ShardTensor)

__all__ = [
    "CommStats",
    "Gather",
    "GatherError",
    "GatherWarning",
    "ShardTensor",
    "ShardTensorSpec",
    "attention_exchange",
    "cache_sizes",
    "clear_caches",
    "comm_counter",
    "distribute_tensor",
    "gather_policy",
    "halo_exchange",
    "normalization_statistics",
    "overlap_halos",
    "record_gathers",
    "register_aten_handler",
    "register_function_handler",
    "scatter_tensor",
]
