"""shardsci: domain-parallel scientific ML for PyTorch.

Tensors too large for one device are split across a DeviceMesh with arbitrary (uneven, even
empty) shards; models written for one device run on them unchanged.
"""

from torch.distributed.tensor import Partial, Replicate, Shard

# Not in __all__: for libraries that look functions up by a tensor's module (see the NOTE).
from shardsci._array_functions import einsum, tensordot, transpose  # noqa: F401
from shardsci.tensor import (
    CommStats,
    Gather,
    GatherError,
    GatherWarning,
    ShardTensor,
    ShardTensorSpec,
    attention_exchange,
    cache_sizes,
    clear_caches,
    comm_counter,
    distribute_tensor,
    gather_policy,
    halo_exchange,
    normalization_statistics,
    overlap_halos,
    record_gathers,
    register_aten_handler,
    register_function_handler,
    scatter_tensor,
)

__all__ = [
    "CommStats",
    "Gather",
    "GatherError",
    "GatherWarning",
    "Partial",
    "Replicate",
    "Shard",
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
