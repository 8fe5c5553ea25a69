"""``__torch_function__`` for ShardTensor: function handlers and replicated parameters.

A call reaches here before autograd records anything. Registered function handlers run
first; otherwise plain tensors that require grad (module weights) are promoted to replicated
ShardTensors, so that the ops below see only ShardTensors and each weight's gradient is the
sum over shards (NOTE [Where the gradient of a replicated parameter is summed] in
``_promotion``); not in ``torch.autograd.grad`` and ``backward``, which only walk the graph.
Everything then continues to ``__torch_dispatch__``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from shardsci.tensor._gather_guard import check_result, dispatching
from shardsci.tensor._registry import function_handler_for
from shardsci.tensor._torch_compat import _disabled_torch_function_impl

__all__ = ["bind_promotion", "dispatch"]

# Calls ``func`` with this subclass's ``__torch_function__`` disabled, in C.
_call_below = _disabled_torch_function_impl
_ShardTensor: type = torch.Tensor
_promote: Callable[[torch.Tensor, DeviceMesh], torch.Tensor] | None = None


def bind_promotion(cls: type, promote: Callable[[torch.Tensor, DeviceMesh], torch.Tensor]) -> None:
    """Called once by ``_promotion``: the ShardTensor type and ``promote_replicated``."""
    global _ShardTensor, _promote
    _ShardTensor = cls
    _promote = promote


def dispatch(cls: type, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None):
    handler = function_handler_for(func)
    if handler is not None:
        ops = dispatching()  # NOTE [Gathers an op was not asked to make]
        ops.append(func)
        try:
            result = handler(func, args, kwargs or {})
            if result is not NotImplemented:
                check_result(args, result)
        finally:
            ops.pop()
        if result is not NotImplemented:
            return result
    if torch.is_grad_enabled() and func not in _GRAPH_WALKS and _promotion_needed(args, kwargs):
        mesh = _mesh_of(args, kwargs)
        args = tuple(_promoted(a, mesh) for a in args)
        kwargs = {k: _promoted(v, mesh) for k, v in (kwargs or {}).items()}
    return _call_below(func, types, args, kwargs or {})


# Their tensor arguments are nodes of the graph to differentiate, not operands: a promoted copy
# of ``inputs`` would be a new node that no output depends on, and its gradient None.
_GRAPH_WALKS = frozenset({torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward})


def _needs_promotion(x: object) -> bool:
    return isinstance(x, torch.Tensor) and type(x) is not _ShardTensor and x.requires_grad


def _promotion_needed(args: tuple, kwargs: dict | None) -> bool:
    for value in args:
        if type(value) is _ShardTensor:
            continue
        if _needs_promotion(value) or (
            isinstance(value, (list, tuple)) and any(_needs_promotion(v) for v in value)
        ):
            return True
    return bool(kwargs) and any(_needs_promotion(v) for v in kwargs.values())


def _mesh_of(args: tuple, kwargs: dict | None) -> DeviceMesh:
    for value in (*args, *(kwargs or {}).values()):
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if type(item) is _ShardTensor:
                return item._spec.mesh
    raise RuntimeError("no ShardTensor among the arguments")


def _promoted(value: object, mesh: DeviceMesh) -> object:
    if isinstance(value, (list, tuple)):
        return type(value)(_promoted(v, mesh) for v in value)
    if _needs_promotion(value):
        return _promote(value, mesh)
    return value
