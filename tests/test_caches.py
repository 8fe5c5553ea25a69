"""Caches are keyed by value and bounded (NOTE [Caches are keyed by value]): equal meshes and
layouts built separately share entries, a long run over ever-new layouts and mesh objects
keeps every cache within its bound and the process's memory flat, and ``clear_caches``
empties them all."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import shardsci
from shardsci.tensor import _collectives, _propagation, _redistribute, _spec
from shardsci.testing import assert_all_ranks, run_on_ranks

BOUND = 16
# Each iteration: a new mesh object (equal to the last), a layout never seen before, and 13
# dispatches on it (pointwise ops, reductions, a realignment, a view, a concatenation) and
# redistributions each way.


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@contextmanager
def _bounded(maxsize: int) -> Iterator[list]:
    """The bounded caches, each with ``maxsize`` entries at most (restored afterwards)."""
    caches = [
        _propagation._PLANS,
        _propagation._SHARDINGS,
        _redistribute._EXCHANGE_PLANS,
        _spec._REPLICATED,
        _collectives._GROUPS,
    ]
    saved = [c.maxsize for c in caches], _propagation._MAX_PRICING_ENTRIES
    for cache in caches:
        cache.maxsize = maxsize
    _propagation._MAX_PRICING_ENTRIES = maxsize
    try:
        yield caches
    finally:
        for cache, size in zip(caches, saved[0]):
            cache.maxsize = size
        _propagation._MAX_PRICING_ENTRIES = saved[1]


def _step(mesh, i: int) -> None:
    rows = 8 + i % 97
    split = (i * 7) % (rows + 1)
    x = shardsci.distribute_tensor(
        torch.randn(rows, 3 + i % 5, dtype=torch.float64),
        mesh,
        [Shard(0)],
        {0: (split, rows - split)},
    )
    y = (x * 2 + 1).sin().sum(1)
    z = x + shardsci.distribute_tensor(torch.ones(x.shape, dtype=torch.float64), mesh, [Shard(0)])
    z.redistribute(placements=[Shard(1)]).redistribute(placements=[Replicate()])
    y.redistribute(placements=[Replicate()])
    torch.cat([x.t(), z.t()], 0)[1:].var(0).mean()


def _long_run_body(iterations: int) -> dict[str, object]:
    shardsci.clear_caches()
    problems = []
    meshes = []
    with _bounded(BOUND):
        for i in range(iterations):
            mesh = init_device_mesh("cpu", (2,))
            meshes.append(weakref.ref(mesh))
            _step(mesh, i)
            if i == iterations // 4:
                gc.collect()
                warm = (_rss_mib(), shardsci.cache_sizes())
        gc.collect()
        sizes = shardsci.cache_sizes()
        rss = _rss_mib()
    over = {name: n for name, n in sizes.items() if n > 4096 or (name in _SMALL and n > BOUND)}
    if over:
        problems.append(f"caches over their bound {BOUND}: {over}")
    if sizes["axis groups"] != 1:
        problems.append(f"{sizes['axis groups']} axis-group entries for one mesh value")
    # Each cache entry may hold the mesh object that made it; no more.
    alive = sum(ref() is not None for ref in meshes)
    if alive > (len(_SMALL) + 1) * BOUND:
        problems.append(f"{alive} of {iterations} mesh objects kept alive")
    dtensor_growth = sizes["DTensor's propagation cache"] - warm[1]["DTensor's propagation cache"]
    if dtensor_growth > 0:
        problems.append(f"DTensor's own propagation cache grew by {dtensor_growth} entries")
    growth = rss - warm[0]
    if growth > 16:
        problems.append(f"RSS grew by {growth:.1f} MiB over {3 * iterations // 4} iterations")
    shardsci.clear_caches()
    left = {name: n for name, n in shardsci.cache_sizes().items() if n}
    if left:
        problems.append(f"clear_caches left {left}")
    assert_all_ranks(not problems, "; ".join(problems))
    return {"sizes": sizes, "rss_growth_mib": growth, "alive_meshes": alive}


_SMALL = {
    "DTensor's redistribute planners",
    "DTensor's transform infos",
    "sharding plans",
    "DTensor sharding propagations",
    "exchange plans",
    "replicated specs",
    "axis groups",
}


@pytest.mark.parametrize(
    "iterations", [pytest.param(50, id="50"), pytest.param(800, id="800", marks=pytest.mark.slow)]
)
def test_a_long_run_over_new_layouts_and_meshes_keeps_caches_and_memory_bounded(
    iterations: int,
) -> None:
    """50 iterations (650 dispatches) outgrow every lowered bound three times over; the slow
    variant runs 10000 dispatches (``pytest -m slow tests/test_caches.py``)."""
    run_on_ranks(2, _long_run_body, iterations, timeout_s=600)


def _equal_meshes_body() -> tuple[bool, bool, int]:
    """Two equal meshes built separately: one interned spec, one plan, one axis group."""
    shardsci.clear_caches()
    first, second = init_device_mesh("cpu", (2,)), init_device_mesh("cpu", (2,))
    data = torch.randn(5, 2, dtype=torch.float64)
    a = shardsci.distribute_tensor(data, first, [Shard(0)], {0: (4, 1)})
    b = shardsci.distribute_tensor(data, second, [Shard(0)], {0: (4, 1)})
    (a * 2).redistribute(placements=[Replicate()])
    plans = shardsci.cache_sizes()
    (b * 2).redistribute(placements=[Replicate()])
    same = shardsci.cache_sizes() == plans
    return first is not second, a._spec is b._spec and same, plans["axis groups"]


def test_equal_meshes_built_separately_share_cache_entries() -> None:
    for distinct, shared, groups in run_on_ranks(2, _equal_meshes_body):
        assert distinct and shared and groups == 1
