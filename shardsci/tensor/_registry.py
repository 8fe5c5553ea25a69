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

Registering a second handler for an op warns (``DuplicateHandlerWarning``) unless
``replace=True`` says it is meant; :func:`scoped_handlers` undoes every registration made in a
block, so a test's handler does not outlive the test.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from shardsci.tensor._caches import register_cache
from shardsci.tensor._torch_compat import OpOverload, OpOverloadPacket

__all__ = [
    "DuplicateHandlerWarning",
    "aten_handler_for",
    "function_handler_for",
    "outliving_handlers",
    "register_aten_handler",
    "register_function_handler",
    "scoped_handlers",
]

AtenHandler = Callable[[OpOverload, tuple, dict], Any]
FunctionHandler = Callable[[Callable, tuple, dict], Any]

_ATEN: dict[OpOverload | OpOverloadPacket | str, AtenHandler] = {}
_FUNCTIONS: dict[Callable, FunctionHandler] = {}
_ON_REGISTRATION: list[Callable[[], None]] = []
# The handler (or None) of each aten overload met: keyed by overloads, a finite set, so
# unbounded (as dispatch's routes); emptied by every registration and by ``clear_caches``.
_RESOLVED: dict[OpOverload, AtenHandler | None] = {}
register_cache("resolved aten handlers", _RESOLVED.__len__, _RESOLVED.clear)

K = TypeVar("K")


class DuplicateHandlerWarning(UserWarning):
    """An op that already has a handler was given another one without ``replace=True``."""


def on_registration(callback: Callable[[], None]) -> None:
    """Call ``callback`` whenever an aten handler is registered (caches of routes clear)."""
    _ON_REGISTRATION.append(callback)


def register_aten_handler(
    *ops: OpOverload | OpOverloadPacket | str, replace: bool = False
) -> Callable[[AtenHandler], AtenHandler]:
    """Register ``handler(func, args, kwargs)`` for aten overloads, packets or op names.

    An op that already has another handler keeps the new one, with a
    ``DuplicateHandlerWarning`` unless ``replace`` is True.

    Examples
    --------
    >>> @register_aten_handler(torch.ops.aten.cumsum.default, "mylib::scan")  # doctest: +SKIP
    ... def cumsum_handler(func, args, kwargs): ...
    """

    def decorate(handler: AtenHandler) -> AtenHandler:
        for op in ops:
            if not isinstance(op, (OpOverload, OpOverloadPacket, str)):
                raise TypeError(f"cannot register a handler for {op!r}: not an aten op or name")
            _store(_ATEN, op, handler, replace)
        _registrations_changed()
        return handler

    return decorate


def register_function_handler(
    *funcs: Callable, replace: bool = False
) -> Callable[[FunctionHandler], FunctionHandler]:
    """Register ``handler(func, args, kwargs)`` for Python-level torch functions.

    Register every spelling a user may call, e.g. ``torch.softmax``, ``Tensor.softmax`` and
    ``torch.nn.functional.softmax`` (each reaches ``__torch_function__`` separately). A
    function that already has another handler keeps the new one, with a
    ``DuplicateHandlerWarning`` unless ``replace`` is True.
    """

    def decorate(handler: FunctionHandler) -> FunctionHandler:
        for func in funcs:
            _store(_FUNCTIONS, func, handler, replace)
        return handler

    return decorate


@contextmanager
def scoped_handlers() -> Iterator[None]:
    """Undo, on leaving the block, every handler registration made inside it: new handlers
    are removed and replaced ones come back.

    Examples
    --------
    >>> with scoped_handlers():  # doctest: +SKIP
    ...     register_function_handler(F.normalize)(my_normalize)
    ...     check_against_reference(F.normalize, ...)
    """
    aten, functions = dict(_ATEN), dict(_FUNCTIONS)
    try:
        yield
    finally:
        _ATEN.clear()
        _ATEN.update(aten)
        _FUNCTIONS.clear()  # cleared in place: ``function_handler_for`` is its bound ``get``
        _FUNCTIONS.update(functions)
        _registrations_changed()


def outliving_handlers(before: dict[Any, Callable]) -> list[str]:
    """Handlers registered (or replaced) since ``before = dict(registered_handlers())`` by
    code outside the library, as ``"op -> module.handler"``: in a test, those outlive it
    unless registered inside :func:`scoped_handlers`."""
    return [
        f"{key} -> {_qualified(handler)}"
        for key, handler in registered_handlers().items()
        if before.get(key) is not handler
        and not (getattr(handler, "__module__", None) or "").startswith("shardsci.")
    ]


def registered_handlers() -> dict[Any, Callable]:
    """Every registered handler by its key (aten ops and names, then torch functions)."""
    return {**_ATEN, **_FUNCTIONS}


def _store(registry: dict[K, Any], key: K, handler: Callable, replace: bool) -> None:
    previous = registry.get(key)
    if previous is not None and previous is not handler and not replace:
        warnings.warn(
            f"{key} already has the handler {_qualified(previous)}; {_qualified(handler)} "
            "replaces it (pass replace=True if that is intended, or use scoped_handlers() "
            "in tests)",
            DuplicateHandlerWarning,
            stacklevel=3,
        )
    registry[key] = handler


def _qualified(handler: Callable) -> str:
    return f"{getattr(handler, '__module__', '?')}.{getattr(handler, '__qualname__', handler)}"


def _registrations_changed() -> None:
    _RESOLVED.clear()
    for callback in _ON_REGISTRATION:
        callback()


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
