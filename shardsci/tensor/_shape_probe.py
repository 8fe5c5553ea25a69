"""Shape probes: torch's own op run on a ``meta`` tensor to learn a result's shape.

# NOTE [Shape probes hold no memory]
Handlers learn an op's global output shape, and raise torch's own error for bad arguments on
every rank before any collective, by running torch's op on a ``meta`` tensor of the global
shape. Such a tensor holds no memory, but it is as large as the whole field: a memory tracker
that counts ``meta`` tensors (the dry run's, whose simulated shards are ``meta`` too; NOTE
[What the memory figures count]) must skip it. So every probe runs inside ``shape_probe()``
and trackers skip what is created while ``probing()``.

A probe costs what torch's meta function costs: 0.01-0.2 ms for most ops, but 6 ms for
``avg_pool2d`` and 12 ms for SDPA (their meta functions are Python decompositions), paid on
every call of a training step. ``probe_on_meta`` runs each probe once per value of its
arguments (NOTE [Caches are keyed by value]: a tensor's value is its shape and dtype; a
scalar's includes its type) and keeps the meta result; a call that raises is not cached, so
bad arguments raise torch's own error on every call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from shardsci.tensor._caches import cached

__all__ = ["probe_on_meta", "probing", "shape_probe"]

_depth = [0]


@contextlib.contextmanager
def shape_probe() -> Iterator[None]:
    """Mark the tensors created inside the block as shape probes."""
    _depth[0] += 1
    try:
        yield
    finally:
        _depth[0] -= 1


def probing() -> bool:
    """Whether a shape probe is running."""
    return _depth[0] > 0


def probe_on_meta(func: Callable, args: tuple, kwargs: dict | None = None) -> Any:
    """``func(*args, **kwargs)`` with every tensor argument (a ShardTensor: its global shape)
    replaced by an empty ``meta`` tensor of its shape and dtype, run once per value of the
    arguments (NOTE [Shape probes hold no memory]).

    Returns
    -------
    Any
        ``func``'s result on the meta tensors (shared between calls: read its shapes and
        dtypes only). Bad arguments raise torch's own error, on every call.
    """
    key = _frozen((args, kwargs or {}))
    try:
        hash(key)
    except TypeError:  # an argument that is not a value (an unhashable object): not cached
        return _probed.__wrapped__(func, key)
    return _probed(func, key)


class _Meta(NamedTuple):
    """A tensor argument's value: an empty meta tensor of this shape and dtype stands in."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class _List(tuple):
    """A list argument, hashable, given back to the op as a list."""


class _Dict(tuple):
    """A dict argument as its items, given back to the op as a dict."""


class _Scalar(NamedTuple):
    """A number with its type: ``1``, ``1.0`` and ``True`` are equal keys otherwise, and an
    op's result dtype may depend on which was given."""

    kind: type
    value: object


def _frozen(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return _Meta(tuple(value.shape), value.dtype)
    if isinstance(value, list):
        return _List(_frozen(v) for v in value)
    if isinstance(value, tuple):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return _Dict((k, _frozen(v)) for k, v in value.items())
    if isinstance(value, (bool, int, float, complex)):
        return _Scalar(type(value), value)
    return value


def _thawed(value: object) -> object:
    if isinstance(value, _Meta):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    if isinstance(value, _Scalar):
        return value.value
    if isinstance(value, _List):
        return [_thawed(v) for v in value]
    if isinstance(value, _Dict):
        return {k: _thawed(v) for k, v in value}
    if isinstance(value, tuple):
        return tuple(_thawed(v) for v in value)
    return value


@cached("meta shape probes", maxsize=1024)
def _probed(func: Callable, key: tuple) -> Any:
    with shape_probe():  # the stand-ins too: each is as large as the whole field
        args, kwargs = _thawed(key)
        return func(*args, **kwargs)
