"""Bind a handler's ``(args, kwargs)`` to parameter names, the one way handlers read arguments.

A handler receives the call as the caller spelled it: ``F.avg_pool2d(x, 2, padding=1)`` and
``F.avg_pool2d(input=x, kernel_size=2, padding=1)`` are the same call. :func:`bind` turns either
into one mapping from every parameter name to its value, defaults filled in, by the callee's
signature:

- an aten overload (``aten.cumsum.default``): its schema;
- a Python function (``F.interpolate``): ``inspect.signature``;
- a torch builtin (``torch.max_pool2d``, ``F.avg_pool2d``): the schema of the aten op of the
  same name when it has one overload, its ``self`` named ``input`` as torch documents it;
- anything else, or to override the above: ``signature=``, a Python function whose parameters
  are the callee's (``lambda input, kernel_size, stride=None: None``).

Bad calls raise Python's own ``TypeError`` wording, naming the callee, on every rank alike.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardsci.tensor._caches import cached
from shardsci.tensor._torch_compat import OpOverload

__all__ = ["Arguments", "bind"]

_REQUIRED = inspect.Parameter.empty


@dataclass(frozen=True)
class _Parameter:
    name: str
    default: Any  # _REQUIRED when the caller must pass it
    keyword_only: bool


class _Signature:
    """A callee's parameters, arranged for binding a call in a few dict operations."""

    def __init__(self, parameters: tuple[_Parameter, ...]) -> None:
        self.positional = tuple(p.name for p in parameters if not p.keyword_only)
        self.names = frozenset(p.name for p in parameters)
        self.defaults = {p.name: p.default for p in parameters if p.default is not _REQUIRED}
        self.required = tuple(p.name for p in parameters if p.default is _REQUIRED)


class Arguments(dict):
    """Bound arguments: every parameter of the callee by name, defaults filled in. Read as a
    mapping (``a["dim"]``) or by attribute (``a.dim``)."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(
                f"no argument named {name!r}; the arguments are {list(self)}"
            ) from None


def bind(
    func: Callable, args: tuple, kwargs: dict | None = None, *, signature: Callable | None = None
) -> Arguments:
    """Bind a call's ``args`` and ``kwargs`` to the parameter names of ``func``.

    Parameters
    ----------
    func : callable
        What the handler received: an aten overload or a Python-level torch function.
    args, kwargs
        The call's arguments, as the handler received them.
    signature : callable, optional
        A function with ``func``'s parameters, for callables whose signature cannot be read
        (``F.max_pool2d`` is a ``(*args, **kwargs)`` wrapper).

    Returns
    -------
    Arguments
        Parameter name -> value, every parameter present.

    Examples
    --------
    >>> a = bind(torch.ops.aten.cumsum.default, (x, 1), {})  # doctest: +SKIP
    >>> a.self, a.dim, a.dtype  # doctest: +SKIP
    """
    sig = _signature(signature if signature is not None else func)
    if len(args) > len(sig.positional):
        raise TypeError(
            f"{_name(func)}() takes {len(sig.positional)} positional arguments but "
            f"{len(args)} were given"
        )
    bound = Arguments(sig.defaults)
    bound.update(zip(sig.positional, args))
    if kwargs:
        for key in kwargs:
            if key not in sig.names:
                raise TypeError(f"{_name(func)}() got an unexpected keyword argument {key!r}")
            if key in sig.positional[: len(args)]:
                raise TypeError(f"{_name(func)}() got multiple values for argument {key!r}")
        bound.update(kwargs)
    for name in sig.required:
        if name not in bound:
            raise TypeError(f"{_name(func)}() missing required argument {name!r}")
    return bound


@cached("handler signatures", 1024)
def _signature(func: Callable) -> _Signature:
    return _Signature(_parameters(func))


def _parameters(func: Callable) -> tuple[_Parameter, ...]:
    if isinstance(func, OpOverload):
        return _from_schema(func._schema)
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return _from_builtin(func)
    kinds = {p.kind for p in signature.parameters.values()}
    if kinds & {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
        raise TypeError(
            f"cannot bind the arguments of {_name(func)}: its signature {signature} hides the "
            "parameter names; pass signature=<a function with its parameters>"
        )
    return tuple(
        _Parameter(p.name, p.default, p.kind is inspect.Parameter.KEYWORD_ONLY)
        for p in signature.parameters.values()
    )


def _from_schema(schema: torch.FunctionSchema, rename: dict[str, str] | None = None) -> tuple:
    rename = rename or {}
    return tuple(
        _Parameter(
            rename.get(a.name, a.name),
            a.default_value if a.has_default_value() else _REQUIRED,
            a.kwarg_only,
        )
        for a in schema.arguments
    )


def _from_builtin(func: Callable) -> tuple[_Parameter, ...]:
    packet = getattr(torch.ops.aten, getattr(func, "__name__", ""), None)
    schemas = [getattr(packet, o)._schema for o in packet.overloads()] if packet else []
    functional = [s for s in schemas if not any(a.is_out for a in s.arguments)]
    if len(functional) != 1:
        raise TypeError(
            f"cannot bind the arguments of {_name(func)}: it has no inspectable signature and "
            f"not one aten schema ({len(functional)} without out=); pass "
            "signature=<a function with its parameters>"
        )
    return _from_schema(functional[0], {"self": "input"})


def _name(func: Callable) -> str:
    if isinstance(func, OpOverload):
        return str(func)
    return getattr(func, "__name__", None) or repr(func)
