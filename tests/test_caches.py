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
from shardsci.tensor import _collectives, _gather_plan, _propagation, _redistribute, _spec
from shardsci.tensor._gather_plan import gather_plan
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
        _redistribute._PLANS,
        _spec._REPLICATED,
        _spec._RELAID,
        _spec._REMEMBERED,
        _redistribute._TARGETS,
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
    "redistribution plans",
    "replicated specs",
    "relaid specs",
    "remembered specs",
    "redistribution targets",
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
    (a * 2).view(-1).redistribute(placements=[Replicate()])
    plans = shardsci.cache_sizes()
    (b * 2).view(-1).redistribute(placements=[Replicate()])
    same = shardsci.cache_sizes() == plans
    return first is not second, a._spec is b._spec and same, plans["axis groups"], plans


def test_equal_meshes_built_separately_share_cache_entries() -> None:
    for distinct, shared, groups, plans in run_on_ranks(2, _equal_meshes_body):
        assert distinct and shared and groups == 1
        assert plans["view plans"] == 1


# ---------------------------------------------------------------------------- redistribution plans
def _redistribution_plans_body() -> dict[str, object]:
    """A redistribution is planned once per pair of layouts: the same moves again, on equal
    specs built from a new mesh object, plan nothing; another dtype plans again (the steps hold
    their specs); ``clear_caches`` empties the plans."""
    shardsci.clear_caches()
    made = []
    real_plan = _redistribute._plan

    def counting_plan(src, dst):
        made.append((src.placements, dst.placements))
        return real_plan(src, dst)

    data = torch.arange(14.0, dtype=torch.float64).reshape(7, 2)
    results, planned = [], []
    _redistribute._plan = counting_plan
    try:
        for dtype in (torch.float64, torch.float64, torch.float32):
            mesh = init_device_mesh("cpu", (2,))
            x = shardsci.distribute_tensor(data.to(dtype), mesh, [Shard(0)], {0: (5, 2)})
            whole = x.redistribute(placements=[Replicate()])
            columns = whole.redistribute(placements=[Shard(1)])
            results.append((whole.to_local().double(), columns.full_tensor().double()))
            planned.append(len(made))
    finally:
        _redistribute._plan = real_plan
    cached = shardsci.cache_sizes()["redistribution plans"]
    shardsci.clear_caches()
    return {
        "planned": planned,
        "cached": cached,
        "cleared": shardsci.cache_sizes()["redistribution plans"],
        "values": all(torch.equal(a, data) and torch.equal(b, data) for a, b in results),
    }


def test_a_redistribution_is_planned_once_per_pair_of_layouts() -> None:
    for result in run_on_ranks(2, _redistribution_plans_body):
        first, again, other_dtype = result.pop("planned")
        assert 0 < first == again and other_dtype == 2 * first == result.pop("cached")
        assert result == {"cleared": 0, "values": True}


# ---------------------------------------------------------------------------- layout changes
def _relaid_body() -> dict[str, object]:
    """A layout change (``relaid``, ``target_spec``) is validated once per value of its
    arguments and gives the spec ``build`` gives; ``same_layout`` compares by value, a
    deep copy (dynamo's guard keeps one) included."""
    import copy

    from shardsci.tensor._spec import ShardTensorSpec

    shardsci.clear_caches()
    mesh = init_device_mesh("cpu", (2,))
    x = ShardTensorSpec.build(mesh, [Shard(0)], (7, 4), torch.float64, {0: (5, 2)})
    builds = []
    real_build = ShardTensorSpec.build.__func__

    def counting_build(cls, *args, **kwargs):
        builds.append(args[1])
        return real_build(cls, *args, **kwargs)

    ShardTensorSpec.build = classmethod(counting_build)
    try:
        moved = [x.relaid([Shard(1)], {1: [1, 3]}, order={1: [0]}) for _ in range(3)]
        targets = [_redistribute.target_spec(x, [Shard(1)]) for _ in range(3)]
        back = _redistribute.target_spec(targets[0], [Shard(0)])
    finally:
        ShardTensorSpec.build = classmethod(real_build)
    built = ShardTensorSpec.build(mesh, [Shard(1)], (7, 4), torch.float64, {1: (1, 3)})
    other_dtype = x.with_dtype(torch.float32)
    assert other_dtype.layout_key is x.layout_key  # cached on x: a deep copy copies it
    copied = copy.deepcopy(x)
    try:
        x.relaid([Shard(1)], {1: (1, 2)})
        refused = ""
    except ValueError as error:
        refused = str(error)
    return {
        "builds": len(builds),
        "same object": all(m is built for m in moved),
        "targets equal": all(t is targets[0] for t in targets),
        "hint restored": back.shardings == x.shardings,
        "copy same layout": copied.layout_key is not x.layout_key and copied.same_layout(x),
        "dtype shares key": other_dtype.layout_key is x.layout_key and x.same_layout(other_dtype),
        "other sizes": x.same_layout(x.relaid([Shard(0)], {0: (4, 3)})),
        "refused": refused,
    }


def test_layout_changes_are_validated_once_and_compare_by_value() -> None:
    for result in run_on_ranks(2, _relaid_body):
        # one build for relaid, one for the target, one for the way back
        assert result.pop("builds") == 3
        assert "sum to 3" in result.pop("refused")
        assert result.pop("other sizes") is False
        assert all(result.values()), result


def _remembered_body() -> dict[str, object]:
    """The fast path merges the hints of operands of one layout (``remembering``) once per
    value of the specs: the same op again, and on a deep copy of a spec (equal, not the
    same object), merges nothing; the result remembers both operands' sizes."""
    import copy

    shardsci.clear_caches()
    mesh = init_device_mesh("cpu", (2,))
    data = torch.randn(7, 4, dtype=torch.float64)
    x = shardsci.distribute_tensor(data, mesh, [Shard(0)], {0: (5, 2)})
    # y has x's layout and remembers a split of dim 1 that x never had
    y = x.redistribute(placements=[Shard(1)]).redistribute(placements=[Shard(0)])
    merges = []
    real_merge = _spec.merged_hints

    def counting_merge(*groups):
        merges.append(groups)
        return real_merge(*groups)

    _spec.merged_hints = counting_merge
    try:
        sums = [x + y for _ in range(3)]
        again = copy.deepcopy(x._spec).remembering(y._spec.hints)
    finally:
        _spec.merged_hints = real_merge
    return {
        "merges": len(merges),
        "same spec": all(s._spec is sums[0]._spec for s in sums) and again is sums[0]._spec,
        "remembers y": set(y._spec.hints) <= set(sums[0]._spec.hints) != set(x._spec.hints),
        "values": all(torch.equal(s.full_tensor(), 2 * data) for s in sums),
    }


def test_operands_hints_are_merged_once_per_value() -> None:
    for result in run_on_ranks(2, _remembered_body):
        assert result == {"merges": 1, "same spec": True, "remembers y": True, "values": True}


def _view_shapes_body() -> dict[str, object]:
    """A view's target shape (a -1 filled in) is worked out once per value: three views of
    one layout, and of another tensor of that layout, infer it once; a bad shape still
    raises torch's error on every call."""
    from shardsci.tensor._ops import _view_ops

    shardsci.clear_caches()
    mesh = init_device_mesh("cpu", (2,))
    data = torch.randn(7, 4, dtype=torch.float64)
    x, y = (shardsci.distribute_tensor(d, mesh, [Shard(0)], {0: (5, 2)}) for d in (data, -data))
    inferred = []
    real_infer = _view_ops.infer_size

    def counting_infer(numel, shape):
        inferred.append(shape)
        return real_infer(numel, shape)

    _view_ops.infer_size = counting_infer
    try:
        views = [x.view(7, 2, -1) for _ in range(3)] + [y.view(7, 2, -1)]
        errors = []
        for _ in range(2):
            try:
                x.view(7, 3, -1)
            except RuntimeError as error:
                errors.append(str(error))
    finally:
        _view_ops.infer_size = real_infer
    return {
        "inferred": len(inferred) - len(errors),
        "errors": len(errors),
        "values": all(
            torch.equal(v.full_tensor(), d.view(7, 2, 2))
            for v, d in zip(views, [data] * 3 + [-data])
        ),
    }


def test_a_views_shape_is_inferred_once_per_value() -> None:
    for result in run_on_ranks(2, _view_shapes_body):
        assert result == {"inferred": 1, "errors": 2, "values": True}


# ---------------------------------------------------------------------------- gather plans
def _line_group() -> _collectives.AxisGroup:
    """Rank 0 of two along one axis: enough for a replicated index, whose plan is local."""
    return _collectives.AxisGroup(
        group=None, size=2, index=0, group_ranks=(0, 1), global_ranks=(0, 1)
    )


def _gather_plans() -> int:
    return shardsci.cache_sizes()["gather plans"]


def test_gather_plans_are_reused_bounded_per_storage_and_cleared() -> None:
    shardsci.clear_caches()
    group = _line_group()
    index = torch.tensor([4, 0, 1, 3])
    plan = gather_plan(index, (3, 2), group, replicated=True)
    assert gather_plan(index[:], (3, 2), group, replicated=True) is plan  # a view, same geometry
    for value in range(40):  # in-place writes: each version replaces the plan
        index[0] = value % 5
        halo = len({v for v in index.tolist() if v >= 3})
        assert gather_plan(index, (3, 2), group, replicated=True).halo == halo
    assert _gather_plans() == 1
    views = torch.arange(64)
    for start in range(40):  # ever-new views of one storage
        gather_plan(views[start:], (40, 24), group, replicated=True)
    assert _gather_plans() <= 1 + _gather_plan._PLANS_PER_STORAGE
    shardsci.clear_caches()
    assert _gather_plans() == 0


def _index_on(storage: torch.UntypedStorage, values: list[int]) -> torch.Tensor:
    """An int64 index on ``storage``: version 1 whatever the storage, so that only the
    storage tells two such indices apart."""
    storage.copy_(torch.tensor(values).untyped_storage())
    return torch.empty(0, dtype=torch.int64).set_(storage, 0, (len(values),))


def test_a_storage_never_finds_the_plans_of_a_dead_one_at_its_id() -> None:
    shardsci.clear_caches()
    group = _line_group()
    index = _index_on(torch.UntypedStorage(16), [3, 4])
    dead = id(index.untyped_storage())
    assert gather_plan(index, (3, 2), group, replicated=True).halo == 2
    del index
    storages = [torch.UntypedStorage(16) for _ in range(1000)]  # one takes the dead one's id
    assert _gather_plans() == 0  # the plans went with their storage
    reused = next((s for s in storages if id(s) == dead), None)
    if reused is None:
        pytest.skip("no new storage took the dead one's id")
    index = _index_on(reused, [0, 1])  # same geometry and version, other values
    assert gather_plan(index, (3, 2), group, replicated=True).halo == 0


# ---------------------------------------------------------------------------- registry
def test_clear_caches_empties_the_resolved_handlers() -> None:
    from shardsci.tensor import _registry

    _registry.aten_handler_for(torch.ops.aten.cumsum.default)
    assert shardsci.cache_sizes()["resolved aten handlers"] >= 1
    shardsci.clear_caches()
    assert not _registry._RESOLVED


# ---------------------------------------------------------------------------- regions
def _region_verdicts_body() -> dict[str, int]:
    """A module met on equal meshes built separately keeps one verdict; its verdicts stay
    within their bound and ``clear_caches`` empties them."""
    from shardsci.compiling import _regions, compile_regions

    shardsci.clear_caches()
    saved, _regions._LAYOUTS_PER_MODULE = _regions._LAYOUTS_PER_MODULE, 4
    try:
        model = compile_regions(torch.nn.SiLU())
    finally:
        _regions._LAYOUTS_PER_MODULE = saved
    data = torch.randn(2, 3, dtype=torch.float64)
    for _ in range(2):  # shards of one row run eagerly: no compilation
        model(shardsci.distribute_tensor(data, init_device_mesh("cpu", (2,)), [Shard(0)]))
    counts = {"equal meshes": shardsci.cache_sizes()["local-region verdicts"]}
    mesh = init_device_mesh("cpu", (2,))
    for ndim in range(1, 5):
        for dim in range(ndim):
            whole = torch.randn([2] * ndim, dtype=torch.float64)
            model(shardsci.distribute_tensor(whole, mesh, [Shard(dim)]))
    counts["after 10 layouts"] = shardsci.cache_sizes()["local-region verdicts"]
    shardsci.clear_caches()
    counts["cleared"] = shardsci.cache_sizes()["local-region verdicts"]
    return counts


def test_region_verdicts_are_keyed_by_the_mesh_value_bounded_and_cleared() -> None:
    for counts in run_on_ranks(2, _region_verdicts_body):
        assert counts == {"equal meshes": 1, "after 10 layouts": 4, "cleared": 0}


# ---------------------------------------------------------------------------- shape probes
def _attention_probe_body() -> dict[str, object]:
    """SDPA's shape probe on ``meta`` tensors (milliseconds of host time a call) runs once per
    layout of its arguments; bad arguments still raise torch's own error on every call."""
    import torch.nn.functional as F

    shardsci.clear_caches()
    mesh = init_device_mesh("cpu", (2,))

    def tokens(n: int, width: int = 4) -> torch.Tensor:
        whole = torch.randn(1, 2, n, width, dtype=torch.float64)
        return shardsci.distribute_tensor(whole, mesh, [Shard(2)])

    q = tokens(6)
    with shardsci.attention_exchange("ring"):  # "auto" would gather these few keys and values
        for _ in range(2):
            F.scaled_dot_product_attention(q, q, q)
        counts: dict[str, object] = {"one layout": shardsci.cache_sizes()["meta shape probes"]}
        q = tokens(8)
        F.scaled_dot_product_attention(q, q, q)
        counts["two layouts"] = shardsci.cache_sizes()["meta shape probes"]
        errors = []
        for _ in range(2):
            with pytest.raises(RuntimeError) as error:
                F.scaled_dot_product_attention(q, tokens(8, width=3), q)
            errors.append(str(error.value).splitlines()[0])
    counts["same error twice"] = errors[0] == errors[1]
    return counts


def test_attention_shape_probe_runs_once_per_layout() -> None:
    for counts in run_on_ranks(2, _attention_probe_body):
        assert counts == {"one layout": 1, "two layouts": 2, "same error twice": True}


def _window_probes_body() -> dict[str, object]:
    """The pooling, padding and einsum handlers' shape probes (``avg_pool2d``'s meta function
    costs milliseconds) run once per layout of their arguments."""
    import torch.nn.functional as F

    shardsci.clear_caches()
    mesh = init_device_mesh("cpu", (2,))
    x = shardsci.distribute_tensor(torch.randn(1, 2, 8, 6, dtype=torch.float64), mesh, [Shard(2)])
    w = torch.randn(2, 3, dtype=torch.float64)
    sizes = []
    for _ in range(2):
        F.avg_pool2d(x, 2)
        F.pad(x, [1, 1, 1, 1], mode="circular")
        torch.einsum("bchw,cd->bdhw", x, w)
        sizes.append(shardsci.cache_sizes()["meta shape probes"])
    return {"after one call each": sizes[0], "after two": sizes[1]}


def test_window_shape_probes_run_once_per_layout() -> None:
    for counts in run_on_ranks(2, _window_probes_body):
        assert counts["after one call each"] >= 2
        assert counts["after two"] == counts["after one call each"]


def _layout_probes_body() -> list[int]:
    """The FFT, split, pixel-shuffle and diag_embed handlers' shape probes: one entry each,
    none added by a second call on the same layouts."""
    shardsci.clear_caches()
    mesh = init_device_mesh("cpu", (2,))
    x = shardsci.distribute_tensor(torch.randn(1, 4, 8, 6, dtype=torch.float64), mesh, [Shard(2)])
    sizes = []
    for _ in range(2):
        torch.fft.rfft2(x)
        torch.split(x, 3, dim=2)
        torch.pixel_shuffle(x, 2)
        torch.diag_embed(x)
        sizes.append(shardsci.cache_sizes()["meta shape probes"])
    return sizes


def test_layout_shape_probes_run_once_per_layout() -> None:
    for sizes in run_on_ranks(2, _layout_probes_body):
        assert sizes == [4, 4]


def test_meta_probe_keys_arguments_by_value_and_type() -> None:
    """``probe_on_meta``: a tensor stands in by shape and dtype, a number with its type (an
    int and a float give different result dtypes), a list comes back a list, and a call
    that raises is not cached: it raises again."""
    from shardsci.tensor._shape_probe import probe_on_meta

    shardsci.clear_caches()
    ints = torch.zeros(3, dtype=torch.int64)
    assert probe_on_meta(torch.add, (ints, 1)).dtype == torch.int64
    assert probe_on_meta(torch.add, (ints, 1.0)).dtype == torch.float32
    assert probe_on_meta(torch.add, (torch.zeros(3, 2, dtype=torch.int64), 1)).shape == (3, 2)
    assert shardsci.cache_sizes()["meta shape probes"] == 3
    assert probe_on_meta(torch.add, (ints, 1)).dtype == torch.int64
    assert shardsci.cache_sizes()["meta shape probes"] == 3
    assert probe_on_meta(torch.ops.aten.constant_pad_nd.default, (ints, [1, 2])).shape == (6,)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="broadcast"):
            probe_on_meta(torch.add, (ints, torch.zeros(4)))
    assert shardsci.cache_sizes()["meta shape probes"] == 4


def test_a_shape_probe_holds_no_memory_in_the_dry_runs_tracker() -> None:
    """NOTE [Shape probes hold no memory]: the global-shape stand-ins a probe makes are not
    counted by a tracker of the ``meta`` device (the dry run's). They were, once the probe
    cache thawed its key outside ``shape_probe()``: a 1024³ FNO's dry run peaked at 256 GiB
    per rank, one whole layer, instead of its shards."""
    from shardsci.planning._memory import LiveMemory
    from shardsci.tensor._caches import clear_caches
    from shardsci.tensor._shape_probe import probe_on_meta

    clear_caches()
    with LiveMemory("meta") as memory:
        whole = torch.empty(4, 16, 1024, 1024, 1024, device="meta")  # 256 GiB, counted
        probe_on_meta(torch.fft.rfft, (whole,), {"dim": -1})
    assert memory.peak == whole.untyped_storage().nbytes()
