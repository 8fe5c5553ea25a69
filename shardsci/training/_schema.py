"""Hydra schemas from config dataclasses, and config dataclasses back from composed configs.

A component declares its settings once, as a (usually frozen) dataclass with ``Literal``
choices that validates itself (``models.UNetConfig``). ``schema_of`` turns it into what
OmegaConf can type-check: a mutable dataclass whose ``Literal`` string choices are Enums, so a
mistyped choice (``model.padding_mode=wrapp``) fails when the config is composed, and whose
tuples are lists. ``config_from`` goes back: a composed node becomes the component's own
dataclass, choices as plain strings, so its own checks run (once, in the launching process,
before any rank starts; see ``check_run`` in ``_checks.py``).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from dataclasses import field
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

__all__ = ["config_from", "config_type_of", "instantiate", "plain", "schema_of"]

_SOURCE = "__shardsci_config_type__"


def schema_of(config_type: type, target: str | None = None) -> type:
    """A Hydra schema with the fields of the dataclass ``config_type`` (possibly frozen).

    ``Literal`` choices of strings become Enums named after the choices, nested dataclasses
    their own schemas, tuples lists; ``target`` adds Hydra's ``_target_``. The schema
    remembers ``config_type`` (``config_type_of``).
    """
    return _schema_of(config_type, target)


@functools.cache
def _schema_of(config_type: type, target: str | None) -> type:
    hints = typing.get_type_hints(config_type)
    fields = [("_target_", str, field(default=target))] if target else []
    for f in dataclasses.fields(config_type):
        kind = _omegaconf_type(hints[f.name], f"{config_type.__name__}_{f.name}")
        if dataclasses.is_dataclass(kind):
            fields.append((f.name, kind, field(default_factory=kind)))
        elif f.default is not dataclasses.MISSING:
            default = kind[f.default] if _is_choice(kind) else f.default
            if isinstance(default, tuple):
                fields.append((f.name, kind, field(default_factory=lambda d=default: list(d))))
            else:
                fields.append((f.name, kind, field(default=default)))
        else:
            fields.append((f.name, kind, field(default_factory=f.default_factory)))
    schema = dataclasses.make_dataclass(f"{config_type.__name__}Schema", fields)
    setattr(schema, _SOURCE, config_type)
    return schema


def _is_choice(kind: Any) -> bool:
    return isinstance(kind, type) and issubclass(kind, enum.Enum)


def _omegaconf_type(hint: Any, name: str) -> Any:
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        choices = typing.get_args(hint)
        if all(isinstance(c, str) for c in choices):
            return enum.Enum(name, [(c, c) for c in choices])
        return type(choices[0])
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        inner = _omegaconf_type(options[0], name) if len(options) == 1 else Any
        return inner | None
    if origin is tuple:
        return list[typing.get_args(hint)[0]]
    if dataclasses.is_dataclass(hint):
        return schema_of(hint)
    return hint


def config_type_of(node: DictConfig) -> type | None:
    """The dataclass a composed node's schema was made from (``schema_of``), if any."""
    schema = OmegaConf.get_type(node)
    return getattr(schema, _SOURCE, None)


def plain(node: DictConfig) -> dict[str, Any]:
    """A composed node as plain containers, interpolations resolved, Enum choices as names."""
    return OmegaConf.to_container(node, resolve=True, enum_to_str=True)


def config_from(config_type: type, node: DictConfig | dict[str, Any]) -> Any:
    """Build the dataclass ``config_type`` from a composed node (nested dataclasses too).

    Fields the node has but ``config_type`` lacks (``_target_``) are dropped; lists become
    tuples where the field is a tuple. Raises what ``config_type`` raises for bad values.
    """
    values = plain(node) if isinstance(node, DictConfig) else node
    hints = typing.get_type_hints(config_type)
    kwargs = {}
    for f in dataclasses.fields(config_type):
        if f.name not in values:
            continue
        value, hint = values[f.name], hints[f.name]
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            value = config_from(hint, value)
        elif isinstance(value, list) and _is_tuple(hint):
            value = tuple(value)
        kwargs[f.name] = value
    return config_type(**kwargs)


def _is_tuple(hint: Any) -> bool:
    """Whether ``hint`` is a tuple type, or an optional one."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_is_tuple(a) for a in typing.get_args(hint))
    return hint is tuple or typing.get_origin(hint) is tuple


def instantiate(node: DictConfig, *args: Any) -> Any:
    """``hydra.utils.instantiate`` of a node with a ``_target_``, Enum choices passed as the
    strings the target expects."""
    return hydra.utils.instantiate(plain(node), *args, _convert_="all")
