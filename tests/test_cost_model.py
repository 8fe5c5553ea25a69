"""The cost model (``benchmarks.cost_model``, NOTE [The cost model]): its collective costs, its
fit of a step's traffic over shapes and rank counts, the attention exchange it picks, and
(``slow``) its fitted laws against a measured step at a rank count it was not fitted on.

Run the slow check with ``pytest -m slow tests/test_cost_model.py``.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from benchmarks import cost_model
from benchmarks.cost_model import (
    GEOMETRY,
    STATISTICS,
    _gathers_as_all_to_alls,
    choose_exchange,
    fit,
    fitted_models,
    laws,
    measurements,
    neighbours,
    step_s,
)
from shardsci import attention_exchange
from shardsci.planning import MemoryPlan, RankClassPlan, RunPlan
from shardsci.planning._choose import project
from shardsci.planning._machine import (
    GLOO_FLOP_FREE_BYTES_PER_S,
    Machine,
    all_gather_s,
    all_reduce_s,
    collective_s,
    flop_free_rate,
    flop_free_s,
    gloo_cpu,
    ops_host_s,
    override,
    strided_copy_s,
)
from shardsci.planning._work import FLOP_FREE_FAMILIES

# Per kind, true bytes as a function of (ranks P, rows r, cols c): a halo of the faces, fixed
# in P; statistics all-gathered, a fixed piece per rank; a transposed volume of kept modes.
TRUTH = {
    "p2p": lambda p, r, c: 2 * 4 * c * 4.0,
    "all_gather": lambda p, r, c: (p - 1) * 64.0,
    "all_to_all": lambda p, r, c: (p - 1) / p * r * 12 * 32 * 8.0,
    "all_reduce": lambda p, r, c: 2 * (p - 1) / p * 4096.0,
}
# Calls; messages: a send and a receive per neighbour in each of 4 halo rounds.
CALLS = {"p2p_rounds": 4, "all_gather": 5, "all_to_all": 16, "all_reduce": 2}


def synthetic_runs(ranks=(2, 4), shapes=GEOMETRY["fno"].shapes) -> list[dict]:
    """Runs as ``measure`` reports them, from ``TRUTH``."""
    return [
        {
            "ranks": p,
            "shape": list(shape),
            "calls": {**CALLS, "p2p": 8 * neighbours((p,))},
            "received": {kind: bytes_(p, *shape) for kind, bytes_ in TRUTH.items()},
            "peers": p - 1,
            "ops": 1000,
            "communication_ops": 0,
        }
        for p in ranks
        for shape in shapes
    ]


def synthetic_measurement() -> dict:
    """A model's measurement (``measure_model``'s JSON) without running anything."""
    sizes = [32, 64, 128]
    return {
        "runs": {"auto": synthetic_runs()},
        "flop_sizes": sizes,
        "flops": [5e4 * s * s for s in sizes],
        "fft_flops": [100.0 * s * s * math.log2(s * s) for s in sizes],
        "memory_bytes": [4e3 * s * s for s in sizes],
    }


def test_fit_recovers_the_laws_at_other_rank_counts_and_shapes():
    fitted, misfit = fit(
        "fno", synthetic_runs(), [32, 64, 128], [5e4 * s * s for s in (32, 64, 128)]
    )
    assert max(misfit.values()) < 1e-9
    for p, shape in ((512, (7.5, 2000.0)), (64, (100.0, 300.0))):
        for kind, bytes_ in TRUTH.items():
            assert fitted.bytes(kind, p, shape) == pytest.approx(bytes_(p, *shape), rel=1e-6)
        assert fitted.count("all_to_all", p) == pytest.approx(16)
    assert fitted.per_rank(fitted.flops, 8, (32.0, 32.0)) == pytest.approx(5e4 * 32 * 32, rel=1e-6)


def test_fit_reports_a_law_it_cannot_express():
    runs = synthetic_runs(ranks=(2, 4, 8))
    for run in runs:  # bytes growing like P²: neither a piece per rank nor a fixed whole
        run["received"]["all_gather"] = run["ranks"] ** 2 * 64.0
    _, misfit = fit("fno", runs, [32, 64], [1.0, 4.0])
    assert misfit["all_gather"] > 0.01


def test_collective_costs():
    machine = Machine()
    assert all_reduce_s(machine, 1, 1e9) == 0.0
    # A large buffer: the ring's Simple protocol, 2 (P - 1) / P of it over InfiniBand, and
    # 2 (P - 1) steps of which 64 in 512 (one per node) cross the network.
    large = all_reduce_s(machine, 512, 1e9)
    step = (448 * machine.nvlink_step_latency_s + 64 * machine.net_step_latency_s) / 512
    latency = machine.base_latency_s + 2 * 511 * step
    expected = (
        machine.simple_latency_factor * latency + 2 * 511 / 512 * 1e9 / machine.ib_bytes_per_s
    )
    assert large == pytest.approx(expected)
    # A small one: the tree's log2 P latency, far below the ring's 2 (P - 1) steps.
    small = all_reduce_s(machine, 512, 8.0)
    assert small < 2 * 511 * machine.net_step_latency_s / 10
    assert all_gather_s(machine, 512, 8.0) > 511 * machine.nvlink_step_latency_s


def test_step_grows_by_the_fitted_laws():
    fitted, _ = fit("fno", synthetic_runs(), [32, 64, 128], [5e4 * s * s for s in (32, 64, 128)])
    machine = Machine(host_us_per_op=0.0)
    shape = GEOMETRY["fno"].weak(64, 512)
    small, large = step_s(machine, fitted, 8, shape), step_s(machine, fitted, 512, shape)
    assert large["all_gather"] > 50 * small["all_gather"]  # P - 1 steps and pieces
    assert large["total"] == large["device"] > large["compute"]
    with_host = step_s(Machine(host_us_per_op=100.0), fitted, 512, shape)
    # 1000 ops at 100 µs, and 23 collectives and 4 halo rounds at NCCL's 10 µs each.
    assert with_host["host"] == pytest.approx(0.1 + 27 * 10e-6)
    assert with_host["total"] == pytest.approx(max(with_host["host"], large["device"]))


def test_ops_per_peer_grow_the_host_term():
    # NOTE [Ops per peer]: 700 ops of the ShardTensor step and 250 per peer, as the FNO's
    # 128² step measured while redistributions packed per peer (513, 985, 1485 on 1, 2, 4
    # ranks), the communication modules'; fitted on 4 and 8 ranks (NOTE [Ops per peer]).
    runs = synthetic_runs(ranks=(2, 4, 8))
    for run in runs:
        run["ops"] = 700 + 250 * (run["ranks"] - 1)
        run["communication_ops"] = 250 * (run["ranks"] - 1)
    fitted, _ = fit("fno", runs, [32, 64, 128], [5e4 * s * s for s in (32, 64, 128)])
    assert fitted.op_count(512) == pytest.approx((700 + 250 * 511, 250 * 511))
    machine = Machine(
        host_us_per_op=50.0,
        host_us_per_communication_op=20.0,
        host_us_per_collective=0,
        host_us_per_all_to_all=0,
    )
    assert fitted.host_s(machine, 512, (16, 32)) == pytest.approx(
        (700 * 50 + 250 * 511 * 20) * 1e-6
    )
    assert fitted.host_s(machine, 2, (16, 32)) == pytest.approx((700 * 50 + 250 * 20) * 1e-6)


def test_a_blocks_collective_over_one_axis_is_fitted_and_priced_over_that_axis():
    """NOTE [Collectives over one axis]: a UNet block measured on 2x2 and 2x4 ranks, a
    statistic all-reduced along H (``@h``: 2 ranks on both meshes) and a transpose along W
    (``@w``: 2, then 4). Fitted over each axis's size, the all-reduce's bytes stay those of 2
    ranks on both meshes' fit, and at 32 ranks (a 4x8 grid; 8 GPUs a node: a row is a node)
    each is priced over rank 0's column (4 ranks on 4 nodes) or row (8 ranks on one node), not
    over the 32 of the block."""
    shapes = GEOMETRY["unet"].shapes
    truth = {
        "all_reduce@h": lambda h, w, r, c: 2 * (h - 1) / h * 4096.0,
        "all_to_all@w": lambda h, w, r, c: (w - 1) / w * r * c * 8.0,
    }
    runs = [
        {
            "ranks": h * w,
            "mesh": [h, w],
            "shape": list(shape),
            "calls": {"all_reduce@h": 2, "all_to_all@w": 4},
            "received": {label: law(h, w, *shape) for label, law in truth.items()},
            "peers": w - 1,
            "ops": 1000,
            "communication_ops": 0,
        }
        for h, w in GEOMETRY["unet"].meshes
        for shape in shapes
    ]
    fitted, misfit = fit("unet", runs, [32, 64, 128], [5e4 * s * s for s in (32, 64, 128)])
    assert max(misfit.values()) < 1e-9
    assert cost_model.projected_group(Machine(), "unet", "all_reduce@h", 32) == (4, 4)
    assert cost_model.projected_group(Machine(), "unet", "all_to_all@w", 32) == (8, 1)
    assert cost_model.projected_group(Machine(), "unet", "all_to_all", 32) == (32, None)
    machine = Machine(host_us_per_op=0.0)
    shape = (64.0, 64.0)
    parts = step_s(machine, fitted, 32, shape)
    column = collective_s(machine, "all_reduce", 4, 2, truth["all_reduce@h"](4, 8, *shape), 2, 4)
    row = collective_s(machine, "all_to_all", 8, 4, truth["all_to_all@w"](4, 8, *shape), 4, 1)
    assert parts["all_reduce@h"] == pytest.approx(column)
    assert parts["all_to_all@w"] == pytest.approx(row)
    whole = collective_s(machine, "all_reduce", 32, 2, 2 * 31 / 32 * 4096.0, 2)
    assert whole > 1.5 * column


def test_attention_exchange_chosen_by_the_librarys_rule():
    gathered, ring = synthetic_runs(), synthetic_runs()
    for run in gathered:  # one attention all-gather of the local keys and values, r c 128 B
        run["received"]["all_gather"] += (
            (run["ranks"] - 1) * run["shape"][0] * run["shape"][1] * 128
        )
        run["calls"]["all_gather"] += 1
    models = {
        "all_gather": fit("vit", gathered, [32, 64], [1.0, 4.0])[0],
        "ring": fit("vit", ring, [32, 64], [1.0, 4.0])[0],
    }
    shape = (16.0, 512.0)  # 8192 * 128 B = 1 MiB per rank
    with attention_exchange(gather_limit_bytes=8 * 2**20 - 1):
        assert choose_exchange(models, 8, shape) == "ring"  # 8 MiB gathered
        assert choose_exchange(models, 4, shape) == "all_gather"
    with attention_exchange(gather_limit_bytes=2**30):
        assert choose_exchange(models, 512, shape) == "all_gather"


def test_override_names_what_it_takes():
    assert override(Machine(), ["ib_bytes_per_s=25e9", "gpus_per_node=4"]).gpus_per_node == 4
    with pytest.raises(ValueError, match="expected name=value, name one of"):
        override(Machine(), ["ib_bandwidth=1"])


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="measured 2026-11-27: the 12 kept W modes go to 8 ranks as torch.chunk's "
    "2,2,2,2,2,2,0,0, so the busiest rank (no mode) receives the whole spectral weights' "
    "gradient (4 x 2,359,296 bytes, where the laws' even share is 7/8 of it) and all 12 "
    "modes of its rows in the inverse transposes: 9,844,736 bytes of gathers and all-to-alls "
    "against 8,960,000 predicted (+9.9%; 21 calls as predicted; the ranks owning modes "
    "8,665,088). The law (P - 1) / P of a whole holds for even "
    "pieces only. (Before gathers and all-to-alls were one kind, the uneven gathers came as "
    "all-to-alls at 8 ranks and as all-gathers at 2 and 4: 14x.)",
)
def test_fitted_laws_predict_a_measured_step_at_8_ranks():
    """The FNO fitted on 2 and 4 ranks predicts, per kind, the bytes and calls of the busiest
    rank of a real step on 8 ranks (``count_traffic``) at a shape it was not measured at."""
    measured = cost_model.measure_model("fno", "nccl")
    (fitted,), _ = zip(*[cost_model.fit("fno", r, [32], [1.0]) for r in measured["runs"].values()])
    shape = (16, 48)
    per_rank = cost_model.on_ranks(8, cost_model.measure, "fno", (8,), shape, "auto", "nccl")
    busiest = max(per_rank, key=lambda r: sum(r["received"].values()))
    for kind, nbytes in busiest["received"].items():
        assert fitted.bytes(kind, 8, shape) == pytest.approx(nbytes, rel=0.02, abs=64), kind
        assert fitted.count(kind, 8) == pytest.approx(busiest["calls"][kind], abs=0.5), kind
    assert math.isclose(sum(laws("all_gather", 8)), 7 + 7 / 8)


def test_the_statistics_kind_is_one_a_measurement_yields() -> None:
    """The UNet's statistics all-gathers, counted with the all-to-alls (NOTE [The cost
    model]), are the kind the projection costs by the library's rule."""
    measured = _gathers_as_all_to_alls({"all_gather": 14, "all_reduce": 15, "p2p": 132})
    assert measured[STATISTICS["unet"]] == 14


def test_every_model_counts_its_ops_beyond_its_traffic_meshes():
    # NOTE [Ops per peer]: the ops' law is fitted at the two largest rank counts, so each
    # geometry needs a count above the meshes its traffic is measured on (the UNet's 4x4).
    for name, geometry in GEOMETRY.items():
        largest = max(math.prod(mesh) for mesh in geometry.meshes)
        assert max((math.prod(mesh) for mesh in geometry.op_meshes), default=0) > largest, name


def test_the_ops_per_peer_are_fitted_where_ranks_have_peers_on_both_sides():
    """NOTE [Ops per peer]: the FNO's ops counted on 2, 4 and 8 ranks (955, 987, 991 at 128²,
    2026-11-29): fitted on 2 and 4 ranks they grew 16 per peer, 9,115 at 512 ranks; the
    8-rank count (an ``ops_only`` run, its traffic not fitted) and the 4-rank ones give 1
    per peer."""
    runs = synthetic_runs()
    for run in runs:
        run["ops"] = {2: 955, 4: 987}[run["ranks"]]
    only = {**synthetic_runs(ranks=(8,))[0], "ops": 991, "ops_only": True}
    only["received"] = {kind: 1e12 for kind in only["received"]}
    fitted, misfit = fit("fno", [*runs, only], [32, 64, 128], [5e4 * s * s for s in (32, 64, 128)])
    assert fitted.op_count(512)[0] == pytest.approx(984 + 511)
    assert max(misfit.values()) < 1e-9
    assert fitted.bytes("all_to_all", 8, (16, 32)) == pytest.approx(TRUTH["all_to_all"](8, 16, 32))


def test_the_planner_and_the_cost_model_price_host_time_alike():
    """NOTE [One price per op]: the same step's ops cost the same host time in the dry run's
    projection (``parallel=auto``) as in the cost model; before, the planner priced the
    communication modules' ops at the ShardTensor rate (here 1.75x the cost model's figure)."""
    runs = synthetic_runs(ranks=(2, 4, 8))
    for run in runs:
        run["ops"] = 700 + 250 * (run["ranks"] - 1)
        run["communication_ops"] = 250 * (run["ranks"] - 1)
    fitted, _ = fit("fno", runs, [32, 64, 128], [5e4 * s * s for s in (32, 64, 128)])
    machine = Machine(
        host_us_per_op=50.0,
        host_us_per_communication_op=20.0,
        host_us_per_collective=0,
        host_us_per_all_to_all=0,
    )
    ops, communication = fitted.op_count(8)
    memory = MemoryPlan(0, 0, 0, 0, 0, 0, 0, "")
    rank_class = RankClassPlan(
        1, 0, [0], [0], memory, {}, {}, aten_ops=round(ops), communication_ops=round(communication)
    )
    plan = RunPlan("cfd", "8", "", 8, "m", 0, 1, [rank_class], [], None, [], [])
    assert project(plan, machine).host == pytest.approx(fitted.host_s(machine, 8, (16, 32)))
    assert fitted.host_s(machine, 8, (16, 32)) == pytest.approx((700 * 50 + 250 * 7 * 20) * 1e-6)


def test_calls_are_priced_by_their_dispatch_path_alike_in_the_planner_and_the_cost_model():
    """NOTE [Host time by dispatch path]: a step's aten ops at the plain rate and its
    ShardTensor calls at their path's price times the in-step factor, in the cost model (the
    counts fitted over ranks as the ops are: function calls one more per peer) and in the
    dry run's projection alike; a measurement without path counts (saved before) prices
    every op at ``host_us_per_op``."""
    runs = synthetic_runs(ranks=(2, 4, 8))
    for run in runs:
        calls = {"fast": 40, "propagation": 10, "handler": 5, "function": 20 + run["ranks"]}
        run["dispatch_calls"] = calls
    fitted, _ = fit("fno", runs, [32, 64, 128], [5e4 * s * s for s in (32, 64, 128)])
    machine = Machine(
        plain_host_us_per_op=5.0,
        host_us_per_fast_op=10.0,
        host_us_per_propagation_op=40.0,
        host_us_per_handler_op=60.0,
        host_us_per_function_call=100.0,
        host_calls_in_step_factor=2.0,
        host_us_per_collective=0,
        host_us_per_all_to_all=0,
    )
    expected = (1000 * 5 + 2 * (40 * 10 + 10 * 40 + 5 * 60 + 28 * 100)) * 1e-6
    assert fitted.host_s(machine, 8, (16, 32)) == pytest.approx(expected)
    memory = MemoryPlan(0, 0, 0, 0, 0, 0, 0, "")
    rank_class = RankClassPlan(
        1, 0, [0], [0], memory, {}, {}, aten_ops=1000, dispatch_calls=fitted.dispatch_count(8)
    )
    plan = RunPlan("cfd", "8", "", 8, "m", 0, 1, [rank_class], [], None, [], [])
    assert project(plan, machine).host == pytest.approx(expected)
    for run in runs:
        del run["dispatch_calls"]
    saved, _ = fit("fno", runs, [32, 64, 128], [5e4 * s * s for s in (32, 64, 128)])
    assert saved.dispatch_calls is None
    assert saved.host_s(machine, 8, (16, 32)) == pytest.approx(1000 * machine.host_us_per_op * 1e-6)


def test_the_planner_and_the_cost_model_price_compute_alike():
    """NOTE [One price per op]: one rank's kernels (FLOPs, FFTs, complex matmuls, memory
    traffic, that of the ops without FLOPs, strided runs) cost the same device time in the dry
    run's projection (``parallel=auto``) as in the cost model, on a machine where each term
    counts; before, the planner left out the memory traffic (here 0.025 s where 0.124 is due)."""
    sizes, ranks, shape = [32, 64, 128], 8, (100.0, 300.0)
    pixels = ranks * shape[0] * shape[1]
    measured = synthetic_measurement()
    measured["complex_matmul_flops"] = [10.0 * s * s for s in sizes]
    measured["flop_free_memory_bytes"] = [1e3 * s * s for s in sizes]
    # of them 600 bytes a pixel by reductions, 400 by contiguous pointwise ops (NOTE [Kernels
    # without FLOPs by family])
    measured["flop_free_memory_bytes_by_family"] = {
        "reduction": [600.0 * s * s for s in sizes],
        "pointwise_contiguous": [400.0 * s * s for s in sizes],
    }
    runs = measured["runs"]["auto"]
    for run in runs:
        run["strided_runs"] = 40 * run["shape"][0]
    fitted = fitted_models("fno", measured)[0]["auto"]
    by_family = fitted.flop_free_by_family(ranks, shape)
    rank_class = RankClassPlan(
        1, 0, [0], [0], MemoryPlan(0, 0, 0, 0, 0, 0, 0, ""), {}, {},
        flops=round(fitted.per_rank(fitted.flops, ranks, shape)),
        fft_flops=round(fitted.fft_per_rank(ranks, shape)),
        complex_matmul_flops=round(fitted.complex_matmul_per_rank(ranks, shape)),
        memory_bytes=round(fitted.per_rank(fitted.memory, ranks, shape)),
        flop_free_bytes=round(fitted.per_rank(fitted.flop_free_memory, ranks, shape)),
        flop_free_bytes_by_family={f: round(n) for f, n in by_family.items()},
        strided_runs=round(fitted.strided(shape)),
    )  # fmt: skip
    plan = RunPlan("cfd", "8", "", ranks, "m", 0, 1, [rank_class], [], None, [], [])
    machine = Machine(
        sustained_flops=1e11,
        fft_flops_per_s=1e10,
        complex_matmul_flops_per_s=1e9,
        memory_bytes_per_s=1e9,
        strided_copy_s_per_run=1e-6,
        reduction_bytes_per_s=0.5e9,
        pointwise_contiguous_bytes_per_s=2e9,
    )
    priced = step_s(machine, fitted, ranks, shape)["compute"]
    assert project(plan, machine).compute == pytest.approx(priced, rel=1e-6)
    # Bound by the FLOP-counting ops' 3e3 bytes a pixel, plus 600 + 400 without FLOPs at
    # their families' rates, plus runs.
    flop_free = 600 / 0.5e9 + 400 / 2e9
    assert priced == pytest.approx((3e3 / 1e9 + flop_free) * pixels / ranks + 4000 * 1e-6, rel=1e-3)


def test_strided_copies_are_priced_as_the_planner_prices_them():
    """NOTE [Strided copies]: the runs of a step's strided copies, fitted over the local shape
    (a W split's ``B C H`` runs grow with the rows), add ``strided_copy_s`` to the compute of
    the cost model as of the dry run."""
    runs = synthetic_runs()
    for run in runs:
        run["strided_runs"] = 500 + 40 * run["shape"][0]
    fitted, _ = fit("fno", runs, [32, 64, 128], [5e4 * s * s for s in (32, 64, 128)])
    shape = (100.0, 300.0)
    assert fitted.strided(shape) == pytest.approx(500 + 40 * 100)
    machine = Machine(strided_copy_s_per_run=1e-6)
    free = Machine(strided_copy_s_per_run=0.0)
    extra = step_s(machine, fitted, 8, shape)["compute"] - step_s(free, fitted, 8, shape)["compute"]
    assert extra == pytest.approx(strided_copy_s(machine, 4500)) and extra == pytest.approx(4.5e-3)


def test_complex_matmuls_are_priced_at_their_own_rate():
    """NOTE [Complex matmuls are counted apart]: a spectral contraction's FLOPs, fitted over
    the field (``c + a p``) and shared by the ranks, add their own rate's seconds to the
    compute, as the dry run prices them; an override of the rate moves them."""
    sizes = [32, 64, 128]
    measured = synthetic_measurement()
    measured["complex_matmul_flops"] = [1e6 + 10.0 * s * s for s in sizes]
    fitted = fitted_models("fno", measured)[0]["auto"]
    shape = (100.0, 300.0)
    whole = 1e6 + 10.0 * 8 * 100 * 300
    assert fitted.complex_matmul_per_rank(8, shape) == pytest.approx(whole / 8)
    unbound = ["memory_bytes_per_s=1e18"]  # compute-bound: the FLOPs' time is the compute
    slow = override(Machine(), [*unbound, "complex_matmul_flops_per_s=1e9"])
    fast = override(Machine(), [*unbound, "complex_matmul_flops_per_s=1e12"])
    extra = step_s(slow, fitted, 8, shape)["compute"] - step_s(fast, fitted, 8, shape)["compute"]
    assert extra == pytest.approx(whole / 8 * (1e-9 - 1e-12))


def test_kernels_without_flops_add_their_traffic_to_the_compute():
    """NOTE [Kernels without FLOPs]: the traffic of the ops without FLOPs, fitted over the field
    and shared by the ranks, adds its seconds to a FLOP-bound step's compute (a roofline per
    kernel, not per step) and is not counted twice in a memory-bound one."""
    sizes = [32, 64, 128]
    measured = synthetic_measurement()  # 5e4 FLOPs and 4e3 bytes a pixel
    measured["flop_free_memory_bytes"] = [1e3 * s * s for s in sizes]
    fitted = fitted_models("fno", measured)[0]["auto"]
    shape, ranks = (100.0, 300.0), 8
    pixels = shape[0] * shape[1]
    assert fitted.per_rank(fitted.flop_free_memory, ranks, shape) == pytest.approx(1e3 * pixels)
    rest = ["fft_flops_per_s=1e30", "strided_copy_s_per_run=0", "memory_bytes_per_s=1e11"]
    flop_bound = override(Machine(), [*rest, "sustained_flops=1e12"])
    assert step_s(flop_bound, fitted, ranks, shape)["compute"] == pytest.approx(
        5e4 * pixels / 1e12 + 1e3 * pixels / 1e11
    )
    memory_bound = override(Machine(), [*rest, "sustained_flops=1e16"])
    assert step_s(memory_bound, fitted, ranks, shape)["compute"] == pytest.approx(
        4e3 * pixels / 1e11
    )


# The UNet's step at 16² a rank (2026-11-29 06:20 UTC, ``count_traffic`` and ``WorkCounter``
# on the busiest rank, ``benchmarks/records/2026-11-29-cost-model/ops_unet_before.jsonl``):
# block -> (messages, ops).
UNET_BLOCKS = {(2, 2): (132, 3170), (2, 4): (198, 3500), (4, 2): (198, 3498), (4, 4): (264, 3828)}


def test_a_halo_steps_messages_and_ops_stop_growing_at_a_ranks_neighbours():
    """NOTE [A rank's messages are bounded by its neighbours], NOTE [Ops per peer]: fitted on
    the UNet's counts, a step at 512 ranks (a 16x32 block) sends the 264 messages of a 4x4
    block's inner rank and dispatches its ops; the laws of calls and ``P - 1`` put 8,514
    messages and 24,226 ops there."""
    runs = [
        {
            "ranks": h * w,
            "mesh": [h, w],
            "shape": list(GEOMETRY["unet"].shapes[0]),
            "calls": {"p2p": messages, "p2p_rounds": 66, "all_to_all": 14},
            "received": {"p2p": 197392.0, "all_to_all": 224.0 * (h * w - 1)},
            "peers": h * w - 1,  # the statistics' all-gathers span the block
            "ops": ops,
            "communication_ops": ops - 1557,
            "ops_only": (h, w) not in GEOMETRY["unet"].meshes,
        }
        for (h, w), (messages, ops) in UNET_BLOCKS.items()
    ]
    fitted, misfit = fit("unet", runs, [32, 64, 128], [5e4 * s * s for s in (32, 64, 128)])
    assert max(misfit.values()) < 1e-9
    assert [fitted.count("p2p", p) for p in (4, 8, 16, 512)] == pytest.approx([132, 198, 264, 264])
    ops, communication = fitted.op_count(512)
    assert ops == pytest.approx(3828, rel=0.005) and communication == pytest.approx(
        3828 - 1557, rel=0.01
    )
    assert fitted.op_count(8)[0] == pytest.approx(3499, rel=0.005)


def test_a_graph_parts_peers_are_bounded_by_the_most_measured():
    """NOTE [Ops per peer]: a graph part's exchanges reach its neighbouring parts only (the
    spans of ``count_traffic`` name them): ops growing 30 a peer while the peers go 3, 5, 6 on
    4, 8, 16 parts stay at 6 peers' worth at 512; a transpose's peers are every rank."""
    runs = synthetic_runs(ranks=(2, 4, 8, 16))
    peers = {2: 1, 4: 3, 8: 5, 16: 6}
    for run in runs:
        run["peers"] = peers[run["ranks"]]
        run["ops"] = 2257 + 30 * run["peers"]
        run["communication_ops"] = 30 * run["peers"]
    fitted, _ = fit("fno", runs, [32, 64, 128], [5e4 * s * s for s in (32, 64, 128)])
    assert fitted.peers_bound == 6
    assert fitted.op_count(512) == pytest.approx((2257 + 30 * 6, 30 * 6))
    for run in runs:
        run["peers"] = run["ranks"] - 1
        run["ops"] = 2257 + 30 * run["peers"]
    dense, _ = fit("fno", runs, [32, 64, 128], [5e4 * s * s for s in (32, 64, 128)])
    assert dense.peers_bound is None
    assert dense.op_count(512)[0] == pytest.approx(2257 + 30 * 511)


HALO_KINDS = ("p2p", "all_to_all@h", "all_to_all@w")


def test_a_step_is_measured_as_the_machine_it_is_projected_onto_issues_its_halos():
    """NOTE [Measured as the target issues it]: on these gloo ranks, a 2x2 UNet step measured
    for the H100 machine (NCCL) counts its halos as messages and none as an all-to-all along
    an axis of the block; measured for this machine (gloo) as one all-to-all each over an
    axis's 2 ranks, and no message. Each rank receives the same halo bytes either way."""
    by_machine = {
        name: cost_model.on_ranks(
            4, cost_model.measure, "unet", (2, 2), (16, 16), "auto", machine.backend
        )
        for name, machine in (("h100", Machine()), ("cpu", gloo_cpu(4)))
    }
    for h100, cpu in zip(by_machine["h100"], by_machine["cpu"]):
        assert h100["calls"]["p2p"] > 0 and not set(h100["calls"]) & set(HALO_KINDS[1:])
        assert "p2p" not in cpu["calls"] and set(cpu["calls"]) >= set(HALO_KINDS[1:])
        assert cpu["calls"]["all_to_all@h"] == cpu["calls"]["all_to_all@w"] > 0
        halo_bytes = [sum(r["received"].get(k, 0) for k in HALO_KINDS) for r in (h100, cpu)]
        assert halo_bytes[0] == halo_bytes[1] > 0


def test_saved_measurements_of_another_backend_are_refused():
    """A measurement saved as gloo issues its halos is not projected onto NCCL's machine (NOTE
    [Measured as the target issues it]); one that does not say which backend neither."""
    saved = {"fno": {"backend": "gloo"}, "vit": {}}
    for name in saved:
        with pytest.raises(SystemExit, match=f"{name}: the saved measurements .* as nccl"):
            measurements(name, saved, Machine().backend)


def test_kernels_without_flops_are_priced_by_family():
    """NOTE [Kernels without FLOPs by family]: each family's bytes at its ``Machine`` rate (a
    rate left None at ``memory_bytes_per_s``), flop-free bytes not counted by family at
    ``memory_bytes_per_s``; the dry run's projection prices a rank class's families alike;
    ``gloo_cpu`` shares each measured rate among the ranks of a core."""
    assert {f.name for f in dataclasses.fields(Machine)} >= {
        f"{family}_bytes_per_s" for family in FLOP_FREE_FAMILIES
    }
    machine = override(
        Machine(memory_bytes_per_s=1e9),
        ["pointwise_strided_bytes_per_s=1e8", "reduction_bytes_per_s=2e8"],
    )
    by_family = {"pointwise_strided": 1e6, "reduction": 1e6, "copy": 1e6}
    assert flop_free_s(machine, 4e6, by_family) == pytest.approx(1e-2 + 5e-3 + 1e-3 + 1e-3)
    assert flop_free_s(machine, 4e6) == pytest.approx(4e-3)
    rank_class = RankClassPlan(
        1, 0, [0], [0], MemoryPlan(0, 0, 0, 0, 0, 0, 0, ""), {}, {},
        flop_free_bytes=4_000_000, flop_free_bytes_by_family=by_family,
    )  # fmt: skip
    plan = RunPlan("cfd", "1", "", 1, "m", 0, 1, [rank_class], [], None, [], [])
    assert project(plan, machine).compute == pytest.approx(1.7e-2)
    one, shared = gloo_cpu(1, cores=1, memory_bytes=2**30), gloo_cpu(4, cores=2, memory_bytes=2**30)
    for family, rate in GLOO_FLOP_FREE_BYTES_PER_S.items():
        assert flop_free_rate(one, family) == rate
        assert flop_free_rate(shared, family) == rate / 2


def test_kernels_without_flops_are_priced_by_family_in_the_cost_model():
    """NOTE [Kernels without FLOPs by family]: the flop-free traffic of each family, fitted
    over the field as the whole (``c + a p + b p²``) and shared by the ranks, costs its
    family's rate; a measurement without the families (saved before 2026-11-30 07:00) and a
    machine without the rates price it all at ``memory_bytes_per_s``."""
    sizes, ranks, shape = [32, 64, 128], 8, (100.0, 300.0)
    pixels = shape[0] * shape[1]
    measured = synthetic_measurement()  # 5e4 FLOPs and 4e3 bytes a pixel
    measured["flop_free_memory_bytes"] = [1e5 + 1e3 * s * s for s in sizes]
    measured["flop_free_memory_bytes_by_family"] = {
        "pointwise_strided": [1e5 + 700.0 * s * s for s in sizes],
        "copy": [300.0 * s * s for s in sizes],
    }
    fitted = fitted_models("fno", measured)[0]["auto"]
    by_family = fitted.flop_free_by_family(ranks, shape)
    assert by_family == {
        "pointwise_strided": pytest.approx(1e5 + 700 * pixels, rel=1e-4),
        "copy": pytest.approx(300 * pixels, rel=1e-4),
    }
    rest = ["fft_flops_per_s=1e30", "strided_copy_s_per_run=0", "memory_bytes_per_s=1e11"]
    rates = ["pointwise_strided_bytes_per_s=1e9", "copy_bytes_per_s=1e10"]
    machine = override(Machine(), [*rest, "sustained_flops=1e12", *rates])
    flops_s = 5e4 * pixels / 1e12
    assert step_s(machine, fitted, ranks, shape)["compute"] == pytest.approx(
        flops_s + (1e5 + 700 * pixels) / 1e9 + 300 * pixels / 1e10, rel=1e-4
    )
    one_rate = dataclasses.replace(
        machine, **{f"{family}_bytes_per_s": None for family in FLOP_FREE_FAMILIES}
    )
    assert step_s(one_rate, fitted, ranks, shape)["compute"] == pytest.approx(
        flops_s + (1e5 + 1e3 * pixels) / 1e11, rel=1e-4
    )
    del measured["flop_free_memory_bytes_by_family"]
    saved = fitted_models("fno", measured)[0]["auto"]
    assert saved.flop_free_by_family(ranks, shape) is None
    assert step_s(machine, saved, ranks, shape)["compute"] == pytest.approx(
        flops_s + (1e5 + 1e3 * pixels) / 1e11, rel=1e-4
    )


def test_a_saved_measurement_without_the_families_is_recounted(monkeypatch):
    """``recounted``: a measurement saved before the flop-free families were counted gets them
    (and the flop-free total) from the plain model at its sizes; one with them is kept."""
    counted = []

    def work_at(name, sizes):
        counted.append((name, list(sizes)))
        return {
            "flops": [0.0] * len(sizes),
            "flop_free_memory_bytes": [3.0 * s for s in sizes],
            "flop_free_memory_bytes_by_family": {"copy": [3.0 * s for s in sizes]},
        }

    monkeypatch.setattr(cost_model, "work_at", work_at)
    saved = {**synthetic_measurement(), "flop_free_memory_bytes": [1.0, 2.0, 3.0]}
    found = cost_model.recounted("fno", saved)
    assert counted == [("fno", [32, 64, 128])]
    assert found["flop_free_memory_bytes"] == [96.0, 192.0, 384.0]
    assert found["flop_free_memory_bytes_by_family"] == {"copy": [96.0, 192.0, 384.0]}
    assert found["flops"] == saved["flops"]
    assert cost_model.recounted("fno", found) is found and len(counted) == 1


def test_the_plain_steps_work_is_counted_by_family():
    """``work_at``: the flop-free bytes of a zoo step by family add up to its flop-free total."""
    found = cost_model.work_at("unet", [16])
    by_family = found["flop_free_memory_bytes_by_family"]
    assert set(by_family) == set(FLOP_FREE_FAMILIES)
    assert sum(v[0] for v in by_family.values()) == found["flop_free_memory_bytes"][0] > 0
    assert found["flop_free_memory_bytes"][0] < found["memory_bytes"][0]


# The UNet's busiest rank's ops and communication ops on 2x2, 2x4, 4x2 and 4x4 blocks, its
# pieces' peers (halos sent as all-to-alls over an axis, statistics gathered over the block;
# benchmarks/records/2026-11-30-predicted-vs-measured/measured_unet.json), and its 1-rank step.
UNET_OPS_2026_11_30 = {(2, 2): (3135, 1679, 3), (2, 4): (3399, 1943, 7), (4, 2): (3397, 1941, 7)}
UNET_OPS_4X4 = (3661, 2205, 15)
UNET_ONE_RANK = {"ops": 1352, "dispatch_calls": {"fast": 38, "propagation": 11, "function": 56}}


def _unet_op_runs(one_rank: bool) -> list[dict]:
    runs = [
        {
            "ranks": h * w,
            "mesh": [h, w],
            "shape": list(GEOMETRY["unet"].shapes[0]),
            "calls": {"all_to_all": 14, "all_reduce": 15},
            "received": {"all_to_all": 224.0 * (h * w - 1), "all_reduce": 64.0},
            "peers": peers,
            "ops": ops,
            "communication_ops": communication,
            "dispatch_calls": {"fast": 38, "propagation": 11, "function": 56},
            "ops_only": (h, w) == (4, 4),
        }
        for (h, w), (ops, communication, peers) in {
            **UNET_OPS_2026_11_30,
            (4, 4): UNET_OPS_4X4,
        }.items()
    ]
    if one_rank:
        runs.append(
            {
                "ranks": 1,
                "mesh": [1, 1],
                "shape": list(GEOMETRY["unet"].shapes[-1]),
                "calls": {"p2p_rounds": 0},
                "received": {},
                "peers": 0,
                "communication_ops": 0,
                "ops_only": True,
                **UNET_ONE_RANK,
            }
        )
    return runs


def test_a_one_rank_step_dispatches_no_communication_op():
    """NOTE [Ops per peer]: the UNet's laws, fitted on 4-16 ranks, put 3,035 ops in its 1-rank
    step, 1,579 of them communication ops, where it dispatches 1,352 and none (2026-11-30);
    on one rank the model takes the counted ops, or without them the laws' ops less their
    communication ops, and never a communication op."""
    sizes = [32, 64, 128]
    flops = [5e4 * s * s for s in sizes]
    counted, _ = fit("unet", _unet_op_runs(one_rank=True), sizes, flops)
    assert counted.op_count(1) == pytest.approx((1352, 0))
    assert counted.dispatch_count(1) == pytest.approx(
        {"fast": 38, "propagation": 11, "handler": 0, "function": 56}
    )
    machine = Machine(host_us_per_op=50.0, host_us_per_communication_op=20.0)
    assert counted.host_s(machine, 1, (128, 128)) == pytest.approx(
        ops_host_s(machine, 1352, 0, True, counted.dispatch_count(1))
    )
    uncounted, _ = fit("unet", _unet_op_runs(one_rank=False), sizes, flops)
    assert uncounted.op_count(1) == pytest.approx((3035 - 1579, 0), abs=1)
    assert uncounted.op_count(4) == counted.op_count(4)  # the laws, as before
    assert counted.op_count(4)[1] > 1600
