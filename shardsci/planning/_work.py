"""What a step asks of its device and its host: FLOPs and aten ops, counted as they run.

Counted below ShardTensor: its handlers run on local shards, so the ops seen here are each
rank's own (a convolution of a quarter of the field counts a quarter of the FLOPs), the halo
exchange's and the shape probes' included. FLOPs follow ``torch.utils.flop_counter``'s
formulas (matmuls, convolutions, attention; FFTs and elementwise ops count none), so they work
on ``meta`` tensors in a dry run as on real ones.
"""

from __future__ import annotations

from typing import Any

from torch.utils.flop_counter import flop_registry

from shardsci.tensor._torch_compat import TorchDispatchMode

__all__ = ["WorkCounter"]


class WorkCounter(TorchDispatchMode):
    """While active, count the aten ops dispatched (``ops``) and their FLOPs (``flops``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        return out
