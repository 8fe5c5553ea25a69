"""How ``torch.compile`` traces through ShardTensors.

# NOTE [torch.compile and ShardTensor]
Dynamo and AOTAutograd see ShardTensor as a traceable wrapper subclass: ``__tensor_flatten__``
gives the local shard as its one inner tensor and the spec as context. Dynamo inlines
``__torch_function__`` (function handlers, parameter promotion) and runs each op on fake
shards to learn its output's spec; AOTAutograd then runs the same Python, ``__torch_dispatch__``
and the autograd Functions' backward included, on functional fake shards and records the aten
ops they issue on the shards, so the backend receives plain forward and backward graphs over
local tensors. Three things make that sound:
- The spec is the flatten context and ``ShardTensor.__metadata_guard__`` compares it by value:
  a compiled graph runs only on inputs of the layout it was traced for (mesh, placements,
  every shard extent, hints); a new layout fails the guard and compiles once more. Shard
  sizes are constants of the graph, never SymInts (a subclass's metadata cannot hold them).
- Collectives are functional while tracing (``in_graph``): ``_collectives`` issues
  ``_c10d_functional`` all-to-all, all-reduce, all-gather and broadcast with their
  ``wait_tensor``, and halo messages as one all-to-all with a zero split for every rank that
  is not a neighbour (there is no functional point-to-point collective in torch 2.11-2.13).
- Nothing with an effect outside the graph runs only at trace time: caches filled while
  tracing hold the same values eager calls would, and bytes are not recorded while tracing,
  so ``comm_counter`` counts eager collectives only; traffic inside compiled graphs is
  counted by running the model eagerly (or by ``count_traffic``, a dispatch mode, under
  which dynamo does not trace).
What dynamo cannot trace (a data-dependent branch, an unsupported Python construct) breaks the
graph with dynamo's own reason, visible in ``torch._dynamo.explain``; the rest is compiled.
``shardsci.compiling.compile_regions`` (NOTE [Compiled local regions]) remains the way to
compile per-shard regions with shard sizes as dynamic dims, reusing one graph across layouts.
"""

from __future__ import annotations

import torch

from shardsci.tensor._torch_compat import get_proxy_mode

__all__ = ["in_graph"]


def in_graph() -> bool:
    """True while torch.compile traces: dynamo, or AOTAutograd's tracer. Collectives are then
    functional and record no bytes (NOTE [torch.compile and ShardTensor])."""
    return torch.compiler.is_compiling() or get_proxy_mode() is not None
