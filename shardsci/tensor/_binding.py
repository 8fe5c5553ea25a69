"""Bind a handler's ``(args, kwargs)`` to parameter names, the one way handlers read arguments.

A handler receives the call as the caller spelled it: ``F.avg_pool2d(x, 2, padding=1)`` and
``F.avg_pool2d(input=x, kernel_size=2, padding=1)`` are the same call. :func:`bind` turns either
into one mapping from every parameter name to its value, defaults filled in, by the callee's
signature:

- an aten overload (``aten.cumsum.default``): its schema;
- a Python function (``F.interpolate``): ``inspect.signature``;
- a torch builtin (``torch.max_pool2d``, ``F.avg_pool2d``): the schema of the aten op of the
  same name when it has one overload (not counting ``out=`` variants, which add a keyword
  ``out=None``), its ``self`` named ``input`` as torch documents it;
- anything else, or to override the above: ``signature=``, a Python function whose parameters
  are the callee's (``lambda input, kernel_size, stride=None: None``); a ``*name`` parameter
  collects the remaining positional arguments as a tuple (``torch.einsum``'s operands).

Bad calls raise Python's own ``TypeError`` wording, naming the callee, on every rank alike.
:func:`replaced` rewrites a call with some arguments changed, each where the caller passed it,
for a handler that runs the op again on other inputs (made whole, or on the meta device).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardsci.tensor._caches import cached
from shardsci.tensor._torch_compat import OpOverload

__all__ = ["Arguments", "bind", "replaced"]

_REQUIRED = inspect.Parameter.empty


@dataclass(frozen=True)
class _Parameter:
    name: str
    default: Any  # _REQUIRED when the caller must pass it
    keyword_only: bool
    variadic: bool = False  # ``*name``: the remaining positional arguments


class _Signature:
    """A callee's parameters, arranged for binding a call in a few dict operations."""

    def __init__(self, parameters: tuple[_Parameter, ...]) -> None:
        named = [p for p in parameters if not p.variadic]
        self.positional = tuple(p.name for p in named if not p.keyword_only)
        self.variadic = next((p.name for p in parameters if p.variadic), None)
        self.names = frozenset(p.name for p in named)
        self.defaults = {p.name: p.default for p in named if p.default is not _REQUIRED}
        if self.variadic is not None:
            self.defaults[self.variadic] = ()
        self.required = tuple(p.name for p in named if p.default is _REQUIRED)


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
    bound = Arguments(sig.defaults)
    if len(args) > len(sig.positional):
        if sig.variadic is None:
            raise TypeError(
                f"{_name(func)}() takes {len(sig.positional)} positional arguments but "
                f"{len(args)} were given"
            )
        bound[sig.variadic] = tuple(args[len(sig.positional) :])
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


def replaced(
    func: Callable,
    args: tuple,
    kwargs: dict,
    values: dict[str, Any],
    *,
    signature: Callable | None = None,
) -> tuple[tuple, dict]:
    """The call's ``(args, kwargs)`` with the arguments named in ``values`` replaced, each
    where the caller passed it: by position, else by keyword.

    Parameters
    ----------
    func, args, kwargs, signature
        As for :func:`bind`.
    values : dict
        Parameter name -> the value to pass instead.

    Examples
    --------
    >>> args, kwargs = replaced(func, args, kwargs, {"input": whole})  # doctest: +SKIP
    >>> func(*args, **kwargs)  # doctest: +SKIP
    """
    sig = _signature(signature if signature is not None else func)
    args, kwargs = list(args), dict(kwargs)
    for name, value in values.items():
        if name not in sig.names:
            raise TypeError(f"{_name(func)}() has no argument {name!r}")
        position = sig.positional.index(name) if name in sig.positional else len(args)
        if position < len(args):
            args[position] = value
        else:
            kwargs[name] = value
    return tuple(args), kwargs


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
    kinds = [p.kind for p in signature.parameters.values()]
    if inspect.Parameter.VAR_KEYWORD in kinds or (
        kinds and kinds[0] is inspect.Parameter.VAR_POSITIONAL
    ):
        raise TypeError(
            f"cannot bind the arguments of {_name(func)}: its signature {signature} hides the "
            "parameter names; pass signature=<a function with its parameters>"
        )
    return tuple(
        _Parameter(
            p.name,
            p.default,
            p.kind is inspect.Parameter.KEYWORD_ONLY,
            p.kind is inspect.Parameter.VAR_POSITIONAL,
        )
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


def _named(overload: str) -> bool:
    return "dimname" in overload.lower() or "names" in overload.split("_")


def _from_builtin(func: Callable) -> tuple[_Parameter, ...]:
    packet = getattr(torch.ops.aten, getattr(func, "__name__", ""), None)
    # Named-tensor overloads (``index_select.dimname``, ``mean.names_dim``: torch 2.11 and 2.12
    # still have them; their schemas show the dim name as a ``str``) take a dim name, which no
    # ShardTensor has.
    overloads = [o for o in packet.overloads() if not _named(o)] if packet else []
    schemas = [getattr(packet, o)._schema for o in overloads]
    functional = [s for s in schemas if not any(a.is_out for a in s.arguments)]
    if len(functional) != 1:
        raise TypeError(
            f"cannot bind the arguments of {_name(func)}: it has no inspectable signature and "
            f"not one aten schema ({len(functional)} without out=); pass "
            "signature=<a function with its parameters>"
        )
    parameters = _from_schema(functional[0], {"self": "input"})
    if len(functional) < len(schemas) and not any(p.name == "out" for p in parameters):
        parameters += (_Parameter("out", None, keyword_only=True),)  # the out= variant's
    return parameters


def _name(func: Callable) -> str:
    if isinstance(func, OpOverload):
        return str(func)
    return getattr(func, "__name__", None) or repr(func)
