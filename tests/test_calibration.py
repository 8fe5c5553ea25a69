"""Calibrating the cost model on this machine (``benchmarks.calibrate``, NOTE [Calibrating the
machine]) and holding it against measured steps (``benchmarks.calibrate_steps``, NOTE [The
model held against measurement]): the fit and the verdicts on synthetic measurements, no ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import time

import pytest
import torch
import torch.distributed as dist

from benchmarks import calibrate, calibrate_steps
from benchmarks.calibrate import (
    COLLECTIVE_HOST_FIELDS,
    COMPUTE,
    HALO_SIZES,
    KINDS,
    SIZES,
    WORLDS,
    at_rates,
    fit_collective_host,
    fit_collectives,
    gloo_machine,
    measure_flop_free_families,
    neighbour_splits,
    one_flop_free_rate,
    predicted_collective_s,
    received_bytes,
    scaled_collective_host,
)
from benchmarks.calibrate_bandwidth import rate_bytes_per_s
from benchmarks.calibrate_steps import (
    Explanation,
    judge,
    layout,
    measure_steps,
    paired_ratios,
    predict,
    sharing,
)
from benchmarks.cost_model import fit, fitted_models, step_s
from shardsci.planning._machine import Machine, collective_host_s, flop_free_rate
from shardsci.planning._work import FLOP_FREE_FAMILIES
from shardsci.testing import count_traffic, run_on_ranks
from tests.test_cost_model import TRUTH, synthetic_measurement

TRUE = {"base_latency_s": 40e-6, "step_latency_s": 25e-6, "bytes_per_s": 1.5e9}


def synthetic_points(machine: Machine, noise: float = 0.0) -> list[dict]:
    """Every calibration point as the Machine's own formulas cost it, alternately ``noise``
    too slow and too fast."""
    points = []
    for kind in KINDS:
        for ranks in WORLDS[kind]:
            for i, nbytes in enumerate(SIZES):
                seconds = predicted_collective_s(machine, kind, ranks, nbytes)
                points.append(
                    {
                        "kind": kind,
                        "ranks": ranks,
                        "bytes": nbytes,
                        "seconds": seconds * (1 + noise * (-1) ** i),
                    }
                )
    return points


def test_the_fit_recovers_the_machine_its_formulas_describe():
    machine = gloo_machine(Machine(), *TRUE.values())
    fitted = fit_collectives(synthetic_points(machine))
    for name, value in TRUE.items():
        assert fitted[name] == pytest.approx(value, rel=1e-6), name
    noisy = fit_collectives(synthetic_points(machine, noise=0.05))
    for name, value in TRUE.items():
        assert noisy[name] == pytest.approx(value, rel=0.15), name


def test_a_negative_parameter_is_dropped_and_the_rest_refitted():
    machine = gloo_machine(Machine(), 50e-6, 0.0, 2e9)
    fitted = fit_collectives(synthetic_points(machine, noise=0.02))
    assert fitted["step_latency_s"] >= 0
    assert fitted["base_latency_s"] == pytest.approx(50e-6, rel=0.2)
    assert fitted["bytes_per_s"] == pytest.approx(2e9, rel=0.1)


def test_gloo_all_reduces_are_rings():
    machine = gloo_machine(Machine(), *TRUE.values())
    ring = TRUE["base_latency_s"] + 6 * TRUE["step_latency_s"] + 1.5 * 1024 / TRUE["bytes_per_s"]
    assert predicted_collective_s(machine, "all_reduce", 4, 1024) == pytest.approx(ring)


def test_the_verdict_on_a_prediction():
    ratios = {"with_term": 0.9}
    within = judge(1.2, None, ratios)
    assert within["ok"] and within["within"] and within["explained"] is None
    assert not judge(0.7, None, ratios)["ok"]
    assert not judge(1.3, None, ratios)["ok"]
    assert judge(1.3, Explanation("host stalls"), ratios)["ok"]
    assert judge(1.3, Explanation("a term", "with_term"), ratios)["ok"]
    missed = judge(1.3, Explanation("a term", "with_term"), {"with_term": 1.4})
    assert not missed["ok"] and missed["explanation_holds"] is False


def test_ranks_beyond_the_cores_share_them():
    machine = dataclasses.replace(Machine(), host_overlaps_device=False, host_us_per_op=50.0)
    assert sharing(machine, 2, 2) == machine
    half = sharing(machine, 4, 2)
    assert half.sustained_flops == machine.sustained_flops / 2
    assert half.host_us_per_op == 100.0
    fitted, _ = fit("fno", synthetic_measurement()["runs"]["auto"], [32, 64, 128], [1e9] * 3)
    models = {"auto": fitted}
    alone = predict(machine, models, 4, (16, 64), cores=4)
    shared = predict(machine, models, 4, (16, 64), cores=2)
    assert shared["cpu"] == alone["cpu"]
    parts = alone["parts"]
    assert alone["cpu"] == pytest.approx(parts["host"] + parts["compute"])
    assert shared["wall"] > alone["wall"]


def test_a_cpu_adds_host_and_device():
    fitted, _ = fit("fno", synthetic_measurement()["runs"]["auto"], [32, 64, 128], [1e9] * 3)
    gpu = Machine()
    cpu = dataclasses.replace(gpu, host_overlaps_device=False)
    on_gpu, on_cpu = step_s(gpu, fitted, 2, (16, 32)), step_s(cpu, fitted, 2, (16, 32))
    assert on_gpu["total"] == max(on_gpu["host"], on_gpu["device"])
    assert on_cpu["total"] == pytest.approx(on_cpu["host"] + on_cpu["device"])


def test_the_timed_layouts_are_the_cost_models():
    assert layout("unet", 4, 128, 0) == ((2, 2), (64, 64))
    assert layout("fno", 4, 128, 0) == ((4,), (32, 128))
    assert layout("meshgraphnet", 2, 0, 4096) == ((2,), (2048,))


def test_the_host_cpu_of_communication_counts_every_call_ring_step_halo_round_and_byte():
    """A call's CPU time here: 700 µs, 300 µs per ring step and 0.5 ns per byte received (gloo
    copies every byte through the CPU); an all-to-all's 400 µs and 150 µs per other rank of its
    group, whether its piece for that rank is empty (a halo's: ``neighbour_splits``) or not
    (NOTE [What an all-to-all posts]). Fitting only the small calls without the bytes (until
    2026-11-29) left a 4 MiB all-gather on 4 ranks 6.3 ms of CPU short."""

    def point(kind: str, ranks: int, received: float, each_us: float) -> dict:
        cpu = each_us * 1e-6 + 0.5e-9 * received
        return {"kind": kind, "ranks": ranks, "received": received, "cpu_seconds": cpu}

    points = [
        point(kind, ranks, received_bytes(kind, ranks, nbytes), 700 + 300 * steps)
        for kind, ranks, steps in [
            ("p2p", 2, 1),
            ("all_gather", 2, 1),
            ("all_gather", 4, 3),
            ("all_reduce", 2, 2),
            ("all_reduce", 4, 6),
        ]
        for nbytes in SIZES
    ]
    points += [
        point("all_to_all", ranks, received, 400 + 150 * (ranks - 1))
        for ranks in (2, 4, 8)
        for received in [received_bytes("all_to_all", ranks, n) for n in SIZES[:2]]
        + [4.0 * sum(neighbour_splits(ranks, 0, n)) for n in HALO_SIZES]
    ]
    assert neighbour_splits(4, 1, 3) == [3, 0, 3, 0] and neighbour_splits(2, 0, 3) == [0, 6]
    fitted_host = fit_collective_host(points)
    assert list(fitted_host) == list(COLLECTIVE_HOST_FIELDS)
    assert list(fitted_host.values()) == pytest.approx([700.0, 300.0, 400.0, 150.0, 0.5e-9])
    machine = dataclasses.replace(Machine(), **fitted_host)
    for p in points:
        charged = collective_host_s(machine, p["kind"], p["ranks"], 1, p["received"])
        assert charged == pytest.approx(p["cpu_seconds"])
    fitted, _ = fit("fno", synthetic_measurement()["runs"]["auto"], [32, 64, 128], [1e9] * 3)
    machine = dataclasses.replace(
        Machine(),
        host_us_per_op=2.0,
        host_us_per_collective=1000.0,
        host_us_per_collective_step=500.0,
        host_us_per_all_to_all=1000.0,
        host_us_per_all_to_all_peer=500.0,
        host_s_per_byte_received=1e-9,
    )
    # CALLS of tests/test_cost_model.py, 1000 ops: 4 halo rounds of one step; 5 all-gathers and
    # 16 all-to-alls of P - 1 steps; 2 all-reduces of 2 (P - 1); the bytes of its TRUTH.
    ops = 1000 * 2e-6
    shape = (16, 64)
    assert fitted.host_s(machine, 1, shape) == pytest.approx(ops)
    two = 4 * 1500 + 5 * 1500 + 16 * 1500 + 2 * 2000
    two_bytes = sum(truth(2, *shape) for truth in TRUTH.values())
    assert fitted.host_s(machine, 2, shape) == pytest.approx(ops + two * 1e-6 + two_bytes * 1e-9)
    four = 4 * 1500 + 5 * 2500 + 16 * 2500 + 2 * 4000
    four_bytes = sum(truth(4, *shape) for truth in TRUTH.values())
    assert fitted.host_s(machine, 4, shape) == pytest.approx(ops + four * 1e-6 + four_bytes * 1e-9)
    assert step_s(machine, fitted, 4, shape)["host"] == fitted.host_s(machine, 4, shape)


def test_link_rates_read_as_tc_writes_them():
    assert rate_bytes_per_s("1gbit") == 125e6
    assert rate_bytes_per_s("200mbit") == 25e6
    with pytest.raises(ValueError, match="rate '200mb': expected a number and one of"):
        rate_bytes_per_s("200mb")


def _timed_with_a_known_gap() -> tuple[list[str], list[dict]]:
    """Rank body: ``time_collectives`` of an all-reduce with ``_gap`` burning 2 ms of CPU and
    every gap and call recorded."""
    events: list[str] = []
    call_once = calibrate._call_once

    def gap(matrix) -> None:
        events.append("gap")
        start = time.process_time()
        while time.process_time() - start < 2e-3:
            pass

    def call(*args) -> None:
        events.append("call")
        call_once(*args)

    calibrate._gap, calibrate._call_once = gap, call
    return events, calibrate.time_collectives("all_reduce", 1)


# 21-49 s at load 35: a 2-rank pool and every size of SIZES.
@pytest.mark.slow
def test_a_calls_cpu_time_is_taken_between_computations_and_without_them():
    """A step computes between its collectives, so their CPU time is taken so (a 256 B call
    costs twice its back-to-back figure here), and the computations' own CPU is subtracted."""
    for events, points in run_on_ranks(2, _timed_with_a_known_gap):
        timed = "".join("g" if e == "gap" else "c" for e in events)
        assert "gcgc" in timed, timed  # the CPU loop: a gap before every call
        assert all(p["cpu_seconds"] < 1.5e-3 for p in points[:2]), points  # 2 ms gaps left out


FAST = {name: 2e9 for name in COMPUTE} | {"fft": 1e9, "complex_matmul": 1e8, "memory": 4e9}


def _work_s(machine: Machine) -> float:
    """A step of 1 GFLOP, 0.5 GFLOP of FFTs and 4 GB of memory traffic on ``machine``."""
    return (
        1e9 / machine.sustained_flops
        + 0.5e9 / machine.fft_flops_per_s
        + 4e9 / (machine.memory_bytes_per_s)
    )


def test_each_timed_step_is_predicted_at_the_small_call_cpu_its_own_call_probed(monkeypatch):
    # NOTE [Host terms paired with the steps]: the load makes a call's collectives cost 1 to
    # 4 times their calibrated CPU, rank r (1 + r / 4) times more than rank 0; its steps issue
    # 100 small all-reduces (the CPU ``collective_host_s`` charges) besides 20 ms of compute.
    machine = dataclasses.replace(
        at_rates(Machine(), FAST),
        host_us_per_collective=150.0,
        host_us_per_collective_step=20.0,
        host_us_per_all_to_all=90.0,
        host_us_per_all_to_all_peer=30.0,
        host_s_per_byte_received=1e-9,
    )
    loads = itertools.cycle([1.0, 4.0, 2.0, 3.0])

    def step_s(machine: Machine, ranks: int) -> float:
        issued = collective_host_s(machine, "all_reduce", ranks, 100, 100 * 512.0)
        return _work_s(machine) / 100 + issued

    def on_ranks(ranks, body, *args):
        load = next(loads)
        per_rank = []
        for rank in range(ranks):
            scale = load * (1 + rank / 4)
            slower = scaled_collective_host(machine, scale)
            small = {
                kind: collective_host_s(
                    slower, kind, ranks, 1, received_bytes(kind, ranks, SIZES[0])
                )
                for kind in calibrate.SMALL_CALLS
            }
            seconds = step_s(slower, ranks)
            per_rank.append(
                {
                    "wall": [seconds] * 2,
                    "cpu": [seconds] * 2,
                    "rates": FAST,
                    "small_calls": small if ranks > 1 else {},
                    "ops": 1,
                }
            )
        return per_rank

    monkeypatch.setattr(calibrate_steps, "on_ranks", on_ranks)
    args = argparse.Namespace(ranks=[1, 2, 4], rounds=3, steps=2, size=128, nodes=4096)
    measured = measure_steps("unet", args)
    for ranks in (2, 4):
        steps = measured[str(ranks)]
        assert len(steps["small_calls"]) == 6 and all(steps["small_calls"])
        predict_cpu = functools.partial(step_s, ranks=ranks)
        paired = paired_ratios(
            predict_cpu, machine, steps["cpu"], steps["rates"], steps["small_calls"], ranks
        )
        assert paired == pytest.approx([1.0] * 6)
        # On the calibration's host terms alone, the loaded calls' steps are mispredicted.
        unpaired = paired_ratios(predict_cpu, machine, steps["cpu"], steps["rates"])
        assert max(abs(r - 1) for r in unpaired) > 0.4
    assert measured["1"]["small_calls"] == [{}] * 6 == measured["plain"]["small_calls"]


def test_a_step_is_predicted_at_its_own_kernels_rates():
    """NOTE [The step's own kernels]: a step whose kernels run at other rates than the
    calibration's probes (FFTs 3x faster, the rest 4x slower) is predicted exactly at the rates
    ``measure_step_kernels`` takes from its own calls, and mispredicted at the probes'."""
    probe = at_rates(Machine(), FAST)
    own = {"flops": probe.sustained_flops / 4, "fft": probe.fft_flops_per_s * 3}
    seconds = _work_s(
        dataclasses.replace(probe, sustained_flops=own["flops"], fft_flops_per_s=own["fft"])
    )
    at_kernels = paired_ratios(_work_s, probe, [seconds], [FAST], kernel_rates=[own])
    assert at_kernels == pytest.approx([1.0])
    assert paired_ratios(_work_s, probe, [seconds], [FAST])[0] < 0.7


def test_the_step_kernels_are_its_own_calls_with_their_flops():
    """``measure_step_kernels`` replays the step's calls with FLOPs: a matmul's, an FFT's and
    a complex matmul's rates (NOTE [Complex matmuls are counted apart]), each its WorkCounter
    FLOPs over a positive time; calls without FLOPs are skipped."""
    a, x = torch.randn(64, 64), torch.randn(8, 256)

    def step() -> None:
        (a @ a).relu()
        spectrum = torch.fft.rfft(x, dim=-1)
        spectrum.T @ spectrum

    rates = calibrate.measure_step_kernels(step, 3)
    assert set(rates) == {"flops", "fft", "complex_matmul"} and min(rates.values()) > 0
    assert calibrate.measure_step_kernels(lambda: a.relu(), 3) == {}


def _kernels_of_a_step_with_a_collective() -> int:
    """Rank body: the collectives ``measure_step_kernels`` issues for a step of one
    all-reduce and a matmul (``count_traffic``)."""
    a = torch.randn(32, 32)

    def step() -> None:
        dist.all_reduce(a @ a)

    with count_traffic() as traffic:
        calibrate.measure_step_kernels(step, 3)
    return traffic.collective_calls


def test_the_step_kernels_replay_no_collective():
    # A replayed collective on some ranks only hangs the others (seen on 2 ranks).
    assert run_on_ranks(2, _kernels_of_a_step_with_a_collective) == [1, 1]


def test_each_timed_step_is_predicted_at_the_compute_rates_its_own_call_measured(monkeypatch):
    # NOTE [Compute rates paired with the steps]: the machine's speed alternates between
    # calls (the load), and within a call rank r runs (1 + r / 4) times slower than rank 0;
    # each call's steps take what ``_work_s`` costs at its slowest rank's rates.
    speeds = itertools.cycle([1.0, 0.5, 0.8, 0.4, 0.9])

    def on_ranks(ranks, body, *args):
        speed = next(speeds)
        per_rank = []
        for rank in range(ranks):
            rates = {kind: rate * speed / (1 + rank / 4) for kind, rate in FAST.items()}
            seconds = _work_s(at_rates(Machine(), rates))
            per_rank.append({"wall": [seconds] * 2, "cpu": [seconds] * 2, "rates": rates, "ops": 1})
        return per_rank

    monkeypatch.setattr(calibrate_steps, "on_ranks", on_ranks)
    args = argparse.Namespace(ranks=[1, 2, 4], rounds=3, steps=2, size=128, nodes=4096)
    measured = measure_steps("unet", args)
    calibrated = at_rates(Machine(), FAST)
    for variant in ("plain", "1", "2", "4"):
        steps = measured[variant]
        assert len(steps["cpu"]) == len(steps["rates"]) == 6
        assert paired_ratios(_work_s, calibrated, steps["cpu"], steps["rates"]) == pytest.approx(
            [1.0] * 6
        )
    # On the calibration's rates alone, the slow calls' steps are mispredicted.
    unpaired = [_work_s(calibrated) / seconds for seconds in measured["4"]["cpu"]]
    assert max(abs(r - 1) for r in unpaired) > 0.5


def test_a_steps_shardtensor_calls_are_priced_by_their_path():
    """NOTE [Host time by dispatch path]: fifty handler-path ops cost what fifty handler calls
    cost, not what fifty fast-path ops cost; a function handler's call is priced apart."""
    from benchmarks.calibrate_dispatch import path_figures, price_step

    figures = {"fast": 10.0, "propagation": 40.0, "handler": 60.0, "function": 100.0}
    assert price_step({"path_ops": {"handler": 50}, "function_calls": 0}, figures) == 3000.0
    assert price_step({"path_ops": {"fast": 50}, "function_calls": 0}, figures) == 500.0
    assert price_step({"path_ops": {"fast": 1}, "function_calls": 2}, figures) == 210.0
    added = {"fast": {"add": [1.0, 3.0, 2.0], "mul": [9.0, 9.0]}, "function": {"conv": [5.0]}}
    assert path_figures(added) == {"fast": 5.5, "function": 5.0}


def test_a_communication_op_costs_its_exchanges_cpu_less_its_collectives_and_other_ops():
    """NOTE [One price per op]: 40 communication ops at 20 µs, 10 others at the plain 5 µs and
    two halo all-to-alls over groups of 4 (100 µs a call, 50 a peer, 1 ns a byte of 10 kB)."""
    machine = Machine(
        plain_host_us_per_op=5.0,
        host_us_per_all_to_all=100.0,
        host_us_per_all_to_all_peer=50.0,
        host_s_per_byte_received=1e-9,
    )
    calls = [{"kind": "all_to_all", "posted": 4, "calls": 2, "received": 10**4}]
    cpu_us = 40 * 20 + 10 * 5 + 2 * (100 + 3 * 50) + 10
    exchange = {"ops": 50, "communication_ops": 40, "calls": calls, "cpu_seconds": cpu_us * 1e-6}
    assert calibrate.communication_op_us(machine, exchange) == pytest.approx(20.0)


def test_a_timed_halo_exchange_is_the_communication_modules_ops_and_one_all_to_all_a_way():
    """``time_halo_exchange`` on 2 ranks: every op it counts is a communication module's, its
    collectives are one halo all-to-all forward and one backward over the group of 2, each
    bringing a face of the shard from each side."""
    for result in run_on_ranks(2, calibrate.time_halo_exchange, (2,), 1):
        assert result["ops"] == result["communication_ops"] > 0
        _, channels, _, width = calibrate.COMMUNICATION_SHARD
        face = channels * width * 4
        assert result["calls"] == [
            {"kind": "all_to_all", "posted": 2, "calls": 2, "received": 2 * 2 * face}
        ]
        assert result["cpu_seconds"] > 0


def test_the_host_price_command_times_the_plain_step_per_op():
    """``benchmarks.calibrate_host``'s plain step (on the CPU here; ``--device cuda`` on a
    GPU host): CPU µs per aten op, a few µs to a few hundred."""
    from benchmarks.calibrate_host import plain_us_per_op_on

    assert 0.1 < plain_us_per_op_on("cpu", 2) < 1000


def test_ranks_without_one_are_held_and_scaled_only_against_a_timed_rank(monkeypatch, capsys):
    """``calibrate_steps --ranks 4`` (1 not timed; it raised KeyError) holds the 4-rank step,
    its scaling ratio ``None``; with 1 timed the ratio is a number. No ranks run: every call's
    steps take what ``_work_s`` costs at the probes' rates."""
    seconds = _work_s(at_rates(Machine(), FAST))

    def on_ranks(ranks, body, *args):
        timed = {"wall": [seconds] * 2, "cpu": [seconds] * 2, "rates": FAST, "ops": 1}
        return [timed for _ in range(ranks)]

    monkeypatch.setattr(calibrate_steps, "on_ranks", on_ranks)
    models, _ = fitted_models("fno", synthetic_measurement())
    for ranks, scaling in (([4], None), ([1, 4], float)):
        args = argparse.Namespace(ranks=ranks, rounds=1, steps=2, size=128, nodes=4096, cores=2)
        records = calibrate_steps.hold("fno", at_rates(Machine(), FAST), models, args)
        assert [r["ranks"] for r in records] == ranks
        found = records[-1]["cpu_scaling_ratio"]
        assert found is None if scaling is None else isinstance(found, float)
    capsys.readouterr()


def test_each_flop_free_family_is_timed_on_kernels_of_that_family():
    """NOTE [Calibrating the machine]: ``measure_flop_free_families`` times kernels that
    ``WorkCounter`` puts in each family (it asserts so) and fits each family's rate; the rates
    reach the machine through ``at_rates`` with the other probes', and ``one_flop_free_rate``
    takes them away again (every flop-free byte at ``memory_bytes_per_s``)."""
    rates = measure_flop_free_families(1)
    assert set(rates) == {f"flop_free:{family}" for family in FLOP_FREE_FAMILIES}
    assert all(1e8 < rate < 1e12 for rate in rates.values())
    machine = at_rates(Machine(), FAST | rates)
    for family in FLOP_FREE_FAMILIES:
        assert flop_free_rate(machine, family) == rates[f"flop_free:{family}"]
        assert flop_free_rate(one_flop_free_rate(machine), family) == FAST["memory"]
    # a probe without the families (saved before them) leaves the machine's
    assert at_rates(machine, FAST).copy_bytes_per_s == rates["flop_free:copy"]


def test_the_same_steps_are_scored_at_one_flop_free_rate_and_by_family(monkeypatch, capsys):
    """NOTE [One flop-free rate or one a family]: steps that take what the model prices at the
    family rates their calls probed are judged 1.0; the same steps scored at one flop-free rate
    (the probe's memory rate, 4x the families') are predicted short, and at the in-step rates
    otherwise. No ranks run."""
    measured = synthetic_measurement()
    sizes = measured["flop_sizes"]
    measured["flop_free_memory_bytes"] = [2e4 * s * s for s in sizes]
    measured["flop_free_memory_bytes_by_family"] = {
        "reduction": [1.5e4 * s * s for s in sizes],
        "copy": [0.5e4 * s * s for s in sizes],
    }
    models, _ = fitted_models("fno", measured)
    families = {f"flop_free:{family}": 1e9 for family in FLOP_FREE_FAMILIES}
    machine = at_rates(Machine(), FAST | families)

    def on_ranks(ranks, body, *args):
        if body is calibrate_steps.time_plain:
            seconds = predict(machine, models, 1, (128, 128), 2)["cpu"]
        else:
            seconds = predict(machine, models, ranks, args[2], 2)["cpu"]
        timed = {"wall": [seconds] * 2, "cpu": [seconds] * 2, "rates": FAST | families, "ops": 1}
        return [timed for _ in range(ranks)]

    monkeypatch.setattr(calibrate_steps, "on_ranks", on_ranks)
    args = argparse.Namespace(ranks=[1, 2, 4], rounds=1, steps=2, size=128, nodes=4096, cores=2)
    for record in calibrate_steps.hold("fno", machine, models, args):
        assert record["cpu"]["ratio"] == 1.0
        assert record["cpu_ratio_one_flop_free_rate"] < 0.9
        assert record["cpu_ratio_in_step_family_rates"] != 1.0
        assert record["flop_free_gb_per_s_paired"]["copy"]["median"] == 1.0
    capsys.readouterr()
