"""The two ways a normalisation combines statistics split over ranks (NOTE [Normalisation
statistics across shards]): each forced, on 2, 4 and 8 ranks, against one process (forward,
input and parameter gradients, running statistics bitwise identical on every rank, float64,
uneven and empty shards, the output's layout); the collectives each issues, counted by
``count_traffic``; and the rule that picks between them."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from benchmarks.cost_model import statistics_crossover, statistics_s
from shardsci.planning._machine import Machine, all_gather_s, all_reduce_s, gloo_cpu
from shardsci.tensor._options import (
    ALL_REDUCE_FROM_RANKS,
    normalization_statistics,
    statistics_all_reduced,
)
from shardsci.tensor._torch_compat import TorchDispatchMode, tree_leaves
from shardsci.testing import Layout, assert_all_ranks, count_traffic, run_on_ranks
from tests.layouts import Sharded
from tests.test_norm_ops import F64, _module_body, _sharded

CASES = [
    Sharded("2r-H-7/4", (2,), (2, 4, 11, 6), Layout((Shard(2),), {2: (7, 4)})),
    Sharded(
        "4r-2x2-block-empty",
        (2, 2),
        (2, 4, 5, 9),
        Layout((Shard(2), Shard(3)), {2: (5, 0), 3: (4, 5)}),
    ),
    Sharded(
        "8r-W-uneven-empty",
        (8,),
        (2, 4, 3, 13),
        Layout((Shard(3),), {3: (3, 0, 2, 1, 0, 4, 2, 1)}),
    ),
]
MODULES = ["GroupNorm(2)", "BatchNorm", "LayerNorm(C,*S)"]


def _forced_body(case: Sharded, name: str, mode: str) -> None:
    with normalization_statistics(mode):
        _module_body(case, name)


@pytest.mark.parametrize("mode", ["all_gather", "all_reduce"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_forced_against_one_process(case: Sharded, mode: str) -> None:
    for name in MODULES:
        run_on_ranks(case.world, _forced_body, case, name, mode)


def _collectives_body(mode: str, crossover: int, expected: dict[str, int]) -> None:
    """GroupNorm on a 2x2 block (a group of 4 ranks): the forward's collectives, counted
    independently of the library's own counter."""
    torch.manual_seed(0)
    x = _sharded(torch.randn(CASES[1].shape, dtype=F64), CASES[1])
    module = torch.nn.GroupNorm(2, 4, dtype=F64)
    with normalization_statistics(mode, crossover), count_traffic() as traffic:
        module(x)
    calls = {k: n for k, n in traffic.calls_by_kind.items() if n}
    assert_all_ranks(calls == expected, f"{mode}, from {crossover} ranks: {calls} != {expected}")


@pytest.mark.parametrize(
    "mode, crossover, expected",
    [
        ("all_gather", 2, {"all_gather": 1}),
        ("all_reduce", 1000, {"all_reduce": 2}),
        ("auto", 5, {"all_gather": 1}),
        ("auto", 4, {"all_reduce": 2}),
    ],
)
def test_collectives_issued(mode: str, crossover: int, expected: dict[str, int]) -> None:
    run_on_ranks(4, _collectives_body, mode, crossover, expected)


# Ops that move a shard's values without computing on them: a reshape's copy of a strided shard.
_COPIES = frozenset({"aten.clone.default", "aten._unsafe_view.default"})


class _ShardReads(TorchDispatchMode):
    """The aten ops that compute on ``shard``'s values: on its storage, through views, or
    on a copy of it (copies, views and collectives aside)."""

    def __init__(self, shard: torch.Tensor) -> None:
        super().__init__()
        self.storages, self.reads = {shard.untyped_storage().data_ptr()}, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if name.startswith("aten.") and not func.is_view and self._reads(args, kwargs):
            if name in _COPIES:
                self.storages.add(out.untyped_storage().data_ptr())
            else:
                self.reads.append(name)
        return out

    def _reads(self, args, kwargs) -> bool:
        return any(
            isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.storages
            for a in tree_leaves((args, kwargs))
        )


def _passes_body(case: Sharded) -> None:
    """GroupNorm's forward below the crossover: the statistics in one pass over the shard
    (``var_mean``), the output in a second (NOTE [Normalisation statistics across shards])."""
    torch.manual_seed(0)
    x = _sharded(torch.randn(case.shape, dtype=F64), case)
    module = torch.nn.GroupNorm(2, 4, dtype=F64)
    local = x.to_local()
    with normalization_statistics("all_gather"), _ShardReads(local) as reads:
        module(x)
    passes = ["aten.var_mean.correction", "aten.addcmul.default"]
    assert_all_ranks(not local.numel() or reads.reads == passes, f"{case}: {reads.reads}")


@pytest.mark.parametrize("case", CASES, ids=str)
def test_group_norm_reads_its_shard_twice(case: Sharded) -> None:
    run_on_ranks(case.world, _passes_body, case)


def test_rule_is_the_machine_crossover() -> None:
    """The default crossover is the H100 model's; below it the all-gather, from it on the
    all-reduces; gloo on this machine crosses over at 21 ranks."""
    assert statistics_crossover(Machine()) == ALL_REDUCE_FROM_RANKS == 104
    assert statistics_crossover(gloo_cpu(8, 2)) == 21
    assert not statistics_all_reduced(2)
    assert not statistics_all_reduced(ALL_REDUCE_FROM_RANKS - 1)
    assert statistics_all_reduced(ALL_REDUCE_FROM_RANKS)
    assert statistics_all_reduced(512)
    with normalization_statistics(all_reduce_from_ranks=21):
        assert not statistics_all_reduced(20) and statistics_all_reduced(21)
    with normalization_statistics("all_gather"):
        assert not statistics_all_reduced(4096)
    with normalization_statistics("all_reduce"):
        assert statistics_all_reduced(2)


def test_crossover_is_one_boundary() -> None:
    """Past the crossover the all-reduces stay cheaper, up to 4,096 ranks: the rule's
    threshold in ranks is the cost model's choice at every rank count."""
    for machine in (Machine(), gloo_cpu(8, 2)):
        crossover = statistics_crossover(machine)
        for ranks in range(crossover, 4097):
            all_reduces = 2 * all_reduce_s(machine, ranks, 32.0)
            assert all_reduces < all_gather_s(machine, ranks, 64.0), (machine, ranks)


def test_projection_costs_what_the_rule_picks() -> None:
    """``cost_model`` costs 14 statistics all-gathers of 64-byte pieces below the crossover
    and 28 all-reduces of 32 bytes from it on."""
    machine = Machine()
    for ranks in (8, 64, 103, 104, 512):
        received = 14 * 64.0 * (ranks - 1)
        gathered = 14 * all_gather_s(machine, ranks, 64.0)
        reduced = 28 * all_reduce_s(machine, ranks, 32.0)
        expected = reduced if ranks >= 104 else gathered
        assert statistics_s(machine, ranks, 14, received) == pytest.approx(expected), ranks


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mode": "tree"}, "mode must be"),
        ({"all_reduce_from_ranks": 1}, "must be >= 2"),
        ({"all_reduce_from_ranks": 8.0}, "must be an int"),
    ],
)
def test_bad_option(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message), normalization_statistics(**kwargs):
        pass
