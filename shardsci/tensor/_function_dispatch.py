"""``__torch_function__`` for ShardTensor: function handlers and replicated parameters.

A call reaches here before autograd records anything. Registered function handlers run
first; otherwise plain tensors that require grad (module weights) are promoted to replicated
ShardTensors, so that the ops below see only ShardTensors and each weight's gradient comes
back as a plain tensor holding the sum over shards (NOTE [Autograd interaction between
torch.Tensor and ShardTensor] in ``_api``). Everything then continues to
``__torch_dispatch__``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from shardsci.tensor._registry import function_handler_for
from shardsci.tensor._spec import ShardTensorSpec, replicated_spec

__all__ = ["bind_promotion", "dispatch"]

_ShardTensor: type = torch.Tensor
_promote: Callable[[torch.Tensor, ShardTensorSpec], torch.Tensor] | None = None


def bind_promotion(
    cls: type, promote: Callable[[torch.Tensor, ShardTensorSpec], torch.Tensor]
) -> None:
    """Called once by ``_api``: the ShardTensor type and its differentiable ``from_local``."""
    global _ShardTensor, _promote
    _ShardTensor = cls
    _promote = promote


def dispatch(cls: type, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None):
    kwargs = kwargs or {}
    handler = function_handler_for(func)
    if handler is not None:
        result = handler(func, args, kwargs)
        if result is not NotImplemented:
            return result
    if torch.is_grad_enabled():
        mesh = _mesh_if_promotion_needed(args, kwargs)
        if mesh is not None:
            args = tuple(_promoted(a, mesh) for a in args)
            kwargs = {k: _promoted(v, mesh) for k, v in kwargs.items()}
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _needs_promotion(x: object) -> bool:
    return isinstance(x, torch.Tensor) and type(x) is not _ShardTensor and x.requires_grad


def _mesh_if_promotion_needed(args: tuple, kwargs: dict) -> DeviceMesh | None:
    mesh = None
    promote = False
    for value in (*args, *kwargs.values()):
        items = value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            if type(item) is _ShardTensor:
                mesh = mesh or item._spec.mesh
            elif _needs_promotion(item):
                promote = True
    return mesh if promote else None


def _promoted(value: object, mesh: DeviceMesh) -> object:
    if isinstance(value, (list, tuple)):
        return type(value)(_promoted(v, mesh) for v in value)
    if _needs_promotion(value):
        return _promote(value, replicated_spec(value, mesh))
    return value
