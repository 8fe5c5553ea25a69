"""Handler registries: where ops get shard-aware implementations.

Two levels, matching where an op can be intercepted:
- **function handlers** run in ``__torch_function__``, above autograd, on the Python function a
  user calls (``F.conv2d``, ``torch.einsum``); they compose differentiable pieces, so their
  backward comes from autograd.
- **aten handlers** run in ``__torch_dispatch__``, below autograd, on one aten overload, a whole
  overload packet (``aten.mean``), or a custom op by its qualified name (``"mylib::op"``); the
  backward ops they need get handlers of their own.

A handler returns ``NotImplemented`` to decline a call (e.g. when the dim it cares about is
not sharded): the op then takes the default path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardsci.tensor._torch_compat import OpOverload, OpOverloadPacket

__all__ = [
    "aten_handler_for",
    "function_handler_for",
    "register_aten_handler",
    "register_function_handler",
]

AtenHandler = Callable[[OpOverload, tuple, dict], Any]
FunctionHandler = Callable[[Callable, tuple, dict], Any]

_ATEN: dict[OpOverload | OpOverloadPacket | str, AtenHandler] = {}
_RESOLVED: dict[OpOverload, AtenHandler | None] = {}
_FUNCTIONS: dict[Callable, FunctionHandler] = {}
_ON_REGISTRATION: list[Callable[[], None]] = []


def on_registration(callback: Callable[[], None]) -> None:
    """Call ``callback`` whenever an aten handler is registered (caches of routes clear)."""
    _ON_REGISTRATION.append(callback)


def register_aten_handler(
    *ops: OpOverload | OpOverloadPacket | str,
) -> Callable[[AtenHandler], AtenHandler]:
    """Register ``handler(func, args, kwargs)`` for aten overloads, packets or op names.

    Examples
    --------
    >>> @register_aten_handler(torch.ops.aten.cumsum.default, "mylib::scan")  # doctest: +SKIP
    ... def cumsum_handler(func, args, kwargs): ...
    """

    def decorate(handler: AtenHandler) -> AtenHandler:
        for op in ops:
            if not isinstance(op, (OpOverload, OpOverloadPacket, str)):
                raise TypeError(f"cannot register a handler for {op!r}: not an aten op or name")
            _ATEN[op] = handler
        _RESOLVED.clear()
        for callback in _ON_REGISTRATION:
            callback()
        return handler

    return decorate


def register_function_handler(*funcs: Callable) -> Callable[[FunctionHandler], FunctionHandler]:
    """Register ``handler(func, args, kwargs)`` for Python-level torch functions.

    Register every spelling a user may call, e.g. ``torch.softmax``, ``Tensor.softmax`` and
    ``torch.nn.functional.softmax`` (each reaches ``__torch_function__`` separately).
    """

    def decorate(handler: FunctionHandler) -> FunctionHandler:
        for func in funcs:
            _FUNCTIONS[func] = handler
        return handler

    return decorate


def aten_handler_for(func: OpOverload) -> AtenHandler | None:
    try:
        return _RESOLVED[func]
    except KeyError:
        pass
    handler = (
        _ATEN.get(func)
        or _ATEN.get(func.overloadpacket)
        or _ATEN.get(func.name())
        or _ATEN.get(func._schema.name)
    )
    _RESOLVED[func] = handler
    return handler


#: ``function_handler_for(func)``: the registered handler or None (a bound ``dict.get``,
#: since ``__torch_function__`` calls it for every torch function on a ShardTensor).
function_handler_for = _FUNCTIONS.get
