"""Every cache shardsci keeps, keyed by value, bounded, and cleared by one call.

# NOTE [Caches are keyed by value]
Specs are interned, and redistribution plans, sharding plans, DTensor's sharding
propagations, groups of mesh axes, halo runs and extensions (with where each cell of an
extension's buffer comes from), views, attention's aligned layouts, FFT steps and resampling
weights are cached, so that a training step pays for planning on its first iteration only.
Every such cache follows these rules:
- Keys are values, never ``id(...)``: an id is reused as soon as its object dies (a stale hit),
  and equal layouts built separately (a spec rebuilt by ``dataclasses.replace``, a mesh
  sliced again) must hit the same entry. A spec's value is ``ShardTensorSpec.key``, a
  ``SpecKey`` that hashes its value once (a plan key holds one per operand and is hashed on
  every op).
- A DeviceMesh's value is what ``DeviceMesh.__eq__`` compares: its device type, its rank grid
  (the ranks and their layout over the root mesh) and its axis names. A key holds the mesh
  object itself; ``hash(mesh)`` is computed once per mesh object.
- Process groups are not part of that value. An entry holding an ``AxisGroup`` (the axis-group
  cache, and the plans built with it) keeps the mesh it was created for, and so its process
  groups, alive while it stays cached; an equal mesh created later reuses those groups. That
  is safe: they span the same ranks, and every rank issues the same ops in the same order, so
  every rank fills and evicts its caches alike and all ranks agree on the group a collective
  runs on. Destroying process groups (``dist.destroy_process_group``) leaves cached entries
  holding dead groups: call :func:`clear_caches` after it.
- Every cache is a least-recently-used cache with a bound on its entries
  (:class:`BoundedCache`, or a function decorated with :func:`cached`), so a long run over
  ever-changing layouts and new meshes holds at most that many entries of each. Caches that
  belong to an object (a module's verdicts in ``compiling._regions``, an index storage's
  gather plans in ``_gather_plan``) are bounded each, go with their object, and are
  registered as one family.
- :func:`clear_caches` empties them all; :func:`cache_sizes` reports their sizes.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["BoundedCache", "cache_sizes", "cached", "clear_caches", "register_cache"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
F = TypeVar("F", bound=Callable)

# name -> (size, clear) of every cache, in registration order.
_REGISTRY: dict[str, tuple[Callable[[], int], Callable[[], None]]] = {}


def register_cache(name: str, size: Callable[[], int], clear: Callable[[], None]) -> None:
    """Make a cache that is not a :class:`BoundedCache` visible to :func:`clear_caches`."""
    if name in _REGISTRY:
        raise ValueError(f"a cache named {name!r} is already registered")
    _REGISTRY[name] = (size, clear)


class BoundedCache(Generic[K, V]):
    """A least-recently-used mapping of at most ``maxsize`` entries, registered by ``name``.

    Parameters
    ----------
    name : str or None
        Shown by :func:`cache_sizes`; unique. None for one cache of a family that its owner
        registers as a whole (:func:`register_cache`).
    maxsize : int
        Entries kept; the least recently used one goes first.
    """

    def __init__(self, name: str | None, maxsize: int) -> None:
        if maxsize <= 0:
            raise ValueError(f"maxsize must be positive, got {maxsize}")
        self.name = name
        self.maxsize = maxsize
        self._entries: OrderedDict[K, V] = OrderedDict()
        if name is not None:
            register_cache(name, self.__len__, self.clear)

    def get(self, key: K) -> V | None:
        """The entry for ``key`` (now the most recently used), or None."""
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> V:
        """Store ``value`` under ``key``, evicting the least recently used entry if full."""
        self._entries[key] = value
        self._entries.move_to_end(key)
        if len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)
        return value

    def get_or_make(self, key: K, make: Callable[[], V]) -> V:
        value = self.get(key)
        return value if value is not None else self.put(key, make())

    def values(self) -> list[V]:
        return list(self._entries.values())

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def cached(name: str, maxsize: int) -> Callable[[F], F]:
    """``functools.lru_cache(maxsize)``, registered as ``name``; arguments are the key."""

    def decorate(fn: F) -> F:
        wrapped = functools.lru_cache(maxsize=maxsize)(fn)
        register_cache(name, lambda: wrapped.cache_info().currsize, wrapped.cache_clear)
        return wrapped  # type: ignore[return-value]

    return decorate


def clear_caches() -> None:
    """Empty every shardsci cache (NOTE [Caches are keyed by value]).

    Never needed for correctness within one set of process groups; call it after destroying
    process groups, or to release the memory plans hold.
    """
    for _, clear in _REGISTRY.values():
        clear()


def cache_sizes() -> dict[str, int]:
    """Cache name -> number of entries."""
    return {name: size() for name, (size, _) in _REGISTRY.items()}
