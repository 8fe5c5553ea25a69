"""ShardTensor: tensors sharded over a DeviceMesh with arbitrary shard sizes."""

from shardsci.tensor._api import ShardTensor
from shardsci.tensor._caches import cache_sizes, clear_caches
from shardsci.tensor._comm_stats import CommStats, comm_counter
from shardsci.tensor._halo import halo_exchange
from shardsci.tensor._options import attention_exchange, overlap_halos
from shardsci.tensor._registry import register_aten_handler, register_function_handler
from shardsci.tensor._scatter import distribute_tensor, scatter_tensor
from shardsci.tensor._spec import ShardTensorSpec

# Importing the handler families registers them.
from shardsci.tensor import _ops  # noqa: F401  isort: skip

__all__ = [
    "CommStats",
    "ShardTensor",
    "ShardTensorSpec",
    "attention_exchange",
    "cache_sizes",
    "clear_caches",
    "comm_counter",
    "distribute_tensor",
    "halo_exchange",
    "overlap_halos",
    "register_aten_handler",
    "register_function_handler",
    "scatter_tensor",
]
