"""shardsci: domain-parallel scientific ML for PyTorch.

Tensors too large for one device are split across a DeviceMesh with arbitrary (uneven, even
empty) shards; models written for one device run on them unchanged.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.tensor import Partial, Replicate, Shard

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

# NOTE [import shardsci is lazy]
# A name is imported from its module the first time it is read (PEP 562), so a command that
# refuses its config, or a module needing only one sub-package, does not pay for DTensor and
# shardsci.tensor. ``from shardsci import X``, ``shardsci.X`` and ``dir(shardsci)`` are as
# before.
_PLACEMENTS = {"Partial", "Replicate", "Shard"}
# Not in __all__: for libraries that look functions up by a tensor's module (see the NOTE).
_ARRAY_FUNCTIONS = {"einsum", "tensordot", "transpose"}


# Sub-modules ``import shardsci`` imported before it was lazy, so ``shardsci.tensor`` works too.
_SUBMODULES = {"_array_functions", "tensor"}


def _module_of(name: str) -> str | None:
    if name in _PLACEMENTS:
        return "torch.distributed.tensor"
    if name in _ARRAY_FUNCTIONS:
        return "shardsci._array_functions"
    if name in __all__:
        return "shardsci.tensor"
    return None


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    module = _module_of(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    dunders = {name for name in globals() if name.startswith("__")} - {"__getattr__", "__dir__"}
    return sorted({*dunders, *__all__, *_ARRAY_FUNCTIONS, *_SUBMODULES})
