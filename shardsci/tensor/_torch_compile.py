"""How ``torch.compile`` treats ShardTensors: their ops run eagerly, outside compiled graphs.

# NOTE [torch.compile and ShardTensor]
Dynamo does not trace ShardTensor dispatch. Tracing it would put layouts into compiled code
as constants: a shard size baked into a halo plan or an output spec is correct only for that
layout, so dynamo would have to guard on every shard extent and recompile for each new one
(PyTorch issue 152963 describes the same limit for DTensor, whose specs must be guard
constants; a subclass's metadata cannot hold SymInts), and the output layout of a compiled
graph is the traced constant, whatever the input's extents. The collectives are in-place c10d
calls with Python-side byte accounting, which compiled code would run once, at trace time.
So this module registers ShardTensor as a subclass dynamo models conservatively and
``shardsci.tensor`` as code it does not inline: ``torch.compile(model)`` on ShardTensor inputs
gives eager results, every ShardTensor op running through ShardTensor dispatch. The speed of
compiled code comes from ``shardsci.compiling.compile_regions`` (NOTE [Compiled local
regions]), which compiles what each rank computes alone, on plain local tensors.
"""

from __future__ import annotations

from shardsci.tensor._torch_compat import dynamo_config, trace_rules

__all__ = ["keep_dynamo_out"]


def keep_dynamo_out(cls: type) -> None:
    """Called once by ``shardsci.tensor`` with the ShardTensor class."""
    dynamo_config.nontraceable_tensor_subclasses.add(cls)
    trace_rules.add("shardsci.tensor")
