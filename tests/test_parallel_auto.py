"""``parallel=auto`` (NOTE [How parallel=auto chooses]): the decompositions it enumerates, how it
ranks them, and a field too large for one device, planned by dry runs on a fake world.

Whether the choice is right on real ranks is measured by ``benchmarks/parallel_auto.py``.
The budget case is slow: ``pytest -m slow tests/test_parallel_auto.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir

import shardsci.train  # noqa: F401  registers the config schemas and the recipes
from benchmarks import parallel_auto
from benchmarks.parallel_auto import step_times
from shardsci.planning import (
    PLAN_FILE,
    Candidate,
    Choice,
    CollectiveFigures,
    Decomposition,
    GradientReductionPlan,
    MemoryPlan,
    Projection,
    RankClassPlan,
    RunPlan,
    SpanFigures,
    choice_applies,
    choose,
    chosen_config,
    dry_run,
    format_choice,
    plan_run,
)
from shardsci.planning._choose import decompositions, project
from shardsci.planning._machine import Machine, collective_s, gloo_cpu
from shardsci.planning._work import FLOP_FREE_FAMILIES
from shardsci.training import ConfigError, _progress

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose("config", overrides=overrides)


# ---------------------------------------------------------------------------- enumeration
def test_four_ranks_on_a_2d_field() -> None:
    found = {(d.describe(2), d.mesh) for d in decompositions(4, ("H", "W"))}
    assert found == {
        ("dp=4", "4"),
        ("dp=2 x slab H=2", "2x2"),
        ("dp=2 x slab W=2", "2x2"),
        ("slab H=4", "4"),
        ("slab W=4", "4"),
        ("block H=2 x W=2", "2x2"),
    }


@pytest.mark.parametrize("world", [8, 12])
def test_every_split_of_the_ranks_over_dp_d_h_w_once(world: int) -> None:
    """Counted independently: every (dp, D, H, W) of positive sizes whose product is the
    world."""
    expected = {
        sizes
        for sizes in itertools.product(range(1, world + 1), repeat=4)
        if math.prod(sizes) == world
    }
    found = decompositions(world, ("D", "H", "W"))
    as_sizes = [(d.dp, *(dict(d.splits).get(dim, 1) for dim in "DHW")) for d in found]
    assert len(as_sizes) == len(set(as_sizes))
    assert set(as_sizes) == expected
    assert all(d.world_size == world for d in found)
    assert Decomposition(1, (("D", 2), ("W", 4))).describe(3) == "pencil D=2 x W=4"


def test_a_decomposition_is_a_mesh_and_roles_the_run_accepts(tmp_path: Path) -> None:
    cfg = _compose(["+recipe=cfd", "mesh=4", f"run_dir={tmp_path}"])
    assert choice_applies(cfg, None) == 4
    assert (
        choice_applies(_compose(["+recipe=cfd", "mesh=2x2", f"run_dir={tmp_path}"]), None) is None
    )
    chosen = chosen_config(cfg, Decomposition(2, (("W", 2),)))
    assert (chosen.mesh, chosen.parallel.choose) == ("2x2", False)
    plan = plan_run(chosen)
    assert plan.axes == "dp=2 (data parallel), domain_w=2 (splits W)"


# ---------------------------------------------------------------------------- ranking
def _class(
    flops: int, ops: int, halo_bytes: int, grad_bytes: int, fft_flops: int = 0
) -> RankClassPlan:
    """Rank 0 of 4: one gradient all-reduce over all 4; halos: 4 rounds of messages with
    rank 1."""
    memory = MemoryPlan(0, 0, 0, 0, 0, 0, 2**20, "forward of x")
    collectives = {
        "grad_all_reduce": CollectiveFigures(1, grad_bytes, grad_bytes),
        **({"halo": CollectiveFigures(4, halo_bytes, halo_bytes)} if halo_bytes else {}),
    }
    spans = [SpanFigures("all_reduce", [0, 1, 2, 3], 1, grad_bytes, 4)]
    spans += [SpanFigures("p2p", [0, 1], 8, halo_bytes, 4)] if halo_bytes else []
    return RankClassPlan(
        1, 0, [0], [0], memory, collectives, {}, flops, ops, fft_flops, 0, spans,
        p2p_rounds=4 if halo_bytes else 0,
    )  # fmt: skip


def _plan(world: int, replicas: int, classes: list[RankClassPlan]) -> RunPlan:
    reduction = GradientReductionPlan("ddp", replicas, world, 0, 1, 0)
    return RunPlan("cfd", str(world), "", world, "m", 0, 1, classes, [], reduction, [], [])


MACHINE = Machine(
    sustained_flops=1e9,
    fft_flops_per_s=1e8,
    host_us_per_op=100.0,
    plain_host_us_per_op=10.0,
    host_us_per_collective=1000.0,
    host_us_per_collective_step=500.0,
    host_s_per_byte_received=1e-9,
    host_overlaps_device=False,
    base_latency_s=1e-4,
    nvlink_step_latency_s=0.0,
    nvlink_bytes_per_s=1e9,
)


def test_projection_of_the_slowest_rank_class() -> None:
    """Compute: FLOPs at the sustained rate, FFT FLOPs at theirs; host: ops at the ShardTensor
    rate when the fields are split, and each collective call and halo round as issuing it
    costs, with the bytes it brings; halos: rounds of latency plus bytes; the slowest class is
    the step's."""
    plan = _plan(4, 1, [_class(10**9, 100, 10**6, 0), _class(10**9, 100, 10**6, 0, 10**8)])
    p = project(plan, MACHINE)
    assert p.compute == pytest.approx(2.0)
    # 4 halo rounds of one ring step, one gradient all-reduce of 2 (P - 1) = 6 steps.
    # The halos' 10^6 bytes at 1 ns each.
    issued = 4 * (1000 + 500) + (1000 + 6 * 500)
    assert p.host == pytest.approx(100 * 100e-6 + issued * 1e-6 + 10**6 * 1e-9)
    assert p.collectives["p2p"] == pytest.approx(4 * 1e-4 + 1e-3)
    assert p.step == pytest.approx(p.compute + p.host + p.communication)
    replicated = project(_plan(4, 4, [_class(10**9, 100, 0, 0)]), MACHINE)
    assert replicated.host == pytest.approx(100 * 10e-6 + 4000e-6)  # nothing split: plain ops
    spectral = _class(10**9, 100, 10**6, 0)
    spectral.complex_matmul_flops = 10**7  # NOTE [Complex matmuls are counted apart]
    at_own_rate = dataclasses.replace(MACHINE, complex_matmul_flops_per_s=1e6)
    assert project(_plan(4, 1, [spectral]), at_own_rate).compute == pytest.approx(1.0 + 10.0)
    overlapped = Machine(sustained_flops=1e9, host_us_per_op=10**5)
    # max(host, device): the ops, and 5 calls at NCCL's 10 µs each.
    assert project(plan, overlapped).step == pytest.approx(100 * 0.1 + 5 * 10e-6)


def test_a_halo_sent_as_one_all_to_all_costs_the_host_by_its_group() -> None:
    """NOTE [What an all-to-all posts]: rank 1 of a 4-rank slab sends its halos as one
    all-to-all over the axis's group of 4 with pieces for ranks 0 and 2 only: its device
    time is priced over those 3 ranks, its host time per other rank of the group (3), not of
    its span (2) nor as ring steps."""
    machine = dataclasses.replace(
        MACHINE, host_us_per_all_to_all=300.0, host_us_per_all_to_all_peer=100.0
    )
    halo = _class(0, 0, 0, 0)
    halo.spans = [SpanFigures("all_to_all", [0, 1, 2], 10, 10**6, 4)]
    p = project(_plan(4, 1, [halo]), machine)
    assert p.host == pytest.approx(10 * (300 + 3 * 100) * 1e-6 + 10**6 * 1e-9)
    assert p.collectives == {
        "all_to_all over 3": pytest.approx(collective_s(machine, "all_to_all", 3, 10, 10**6, 10))
    }


def _candidate(label: str, step: float, host: float, halo: float) -> Candidate:
    projection = Projection(step - host - halo, halo, host, step, {"halo": halo})
    return Candidate(Decomposition(1, (("H", 4),)), label, 2**30, projection)


def test_the_table_ranks_by_step_and_says_why_each_lost() -> None:
    ranked = [
        _candidate("fast", 1.0, 0.1, 0.1),
        _candidate("chatty", 1.5, 0.1, 0.6),
        _candidate("busy host", 2.0, 1.1, 0.1),
    ]
    dropped = [Candidate(Decomposition(4, ()), "dp=4", 3 * 2**30, problem="over the budget")]
    choice = Choice(4, 2.0, "parallel.memory_gib", "cpu", ranked, dropped)
    table = format_choice(choice)
    rows = table.splitlines()[3:]
    assert [row.split()[1] for row in rows[:2]] == ["fast", "chatty"]
    assert rows[0].endswith("chosen")
    assert rows[1].endswith("500 ms slower: halo 600 ms against 100 ms (x1.50)")
    assert rows[2].endswith("1e+03 ms slower: host 1.1e+03 ms against 100 ms (x2.00)")
    assert rows[3].endswith("dropped: over the budget") and "3.000" in rows[3]
    written = json.loads(json.dumps(choice.as_dict()))  # what dry_run.json holds
    assert [c["decomposition"] for c in written["candidates"]] == [
        "fast", "chatty", "busy host", "dp=4"
    ]  # fmt: skip
    assert [c["verdict"] for c in written["candidates"]] == [
        row.split("  ")[-1].strip() for row in rows
    ]
    assert written["candidates"][1]["projection"]["collectives"] == {"halo": 0.6}
    assert written["candidates"][3]["projection"] is None
    assert written["candidates"][0]["parallel"]["domain"] == {"domain_h": "H"}


# ---------------------------------------------------------------------------- the budget
SMALL = [
    "+recipe=cfd",
    "model=fno",
    "model.width=8",
    "model.modes=[4,4]",
    "logger=none",
    "data.dataset.solver.resolution=128",
]


def test_splitting_the_field_leaves_each_ranks_work_alone(tmp_path: Path) -> None:
    """Two ranks, two samples: one sample per replica or half of both per slab is the same
    work per rank, FFTs included; shape probes (on the whole field's shape) add none. Counted,
    they made an 8-way slab's FNO compute 1.5x data parallelism's. Nor does the slab's memory
    traffic without FLOPs (NOTE [Kernels without FLOPs]) grow beyond the replica's: the ops
    dispatched on ShardTensors add none (counted, with their whole field's bytes, they made
    it 1.7x here, 2.5x on 8 ranks)."""
    cfg = _compose([*SMALL, "data.dataset.solver.resolution=32", "train.global_batch=2",
                    f"run_dir={tmp_path}"])  # fmt: skip
    work, traffic = {}, {}
    for decomposition in (Decomposition(2, ()), Decomposition(1, (("H", 2),))):
        plan = plan_run(chosen_config(cfg, decomposition))
        work[decomposition.describe(2)] = {(c.flops, c.fft_flops) for c in plan.classes}
        traffic[decomposition.describe(2)] = max(c.flop_free_bytes for c in plan.classes)
    assert work["slab H=2"] == work["dp=2"]
    assert all(fft > 0 for _, fft in work["dp=2"])
    assert 0 < traffic["slab H=2"] < 1.2 * traffic["dp=2"]


def test_a_blocks_collectives_are_priced_over_their_own_axis(tmp_path: Path) -> None:
    """A 2x4 block (rank r in row r // 4 along W's 4 ranks, column r % 4 along H's 2; 4 GPUs
    per node: a row is a node). The dry run's collectives connect one row, one column, or
    ranks of both (the transposes between H and W); each is priced over the ranks it
    connects and the nodes they span (NOTE [Collectives priced over their own ranks]): a
    column's over 2 ranks on 2 nodes, a row's over 4 on one. Costed over the whole domain
    group, as before, a column's all-reduce of a few bytes cost 8 ranks' latency."""
    cfg = _compose([*SMALL, "data.dataset.solver.resolution=32", "train.global_batch=1",
                    f"run_dir={tmp_path}"])  # fmt: skip
    plan = plan_run(chosen_config(cfg, Decomposition(1, (("H", 2), ("W", 4)))))
    grid = torch.arange(8).view(2, 4)
    machine = Machine(gpus_per_node=4)
    for rank_class in plan.classes:
        me = rank_class.representative
        row, column = grid[me // 4].tolist(), grid[:, me % 4].tolist()
        by_ranks = defaultdict(list)
        for span in rank_class.spans:
            assert me in span.ranks
            by_ranks[len(span.ranks)].append(span)
        assert [s.ranks for s in by_ranks[2]] and all(s.ranks == column for s in by_ranks[2])
        assert [s.ranks for s in by_ranks[4]] and all(s.ranks == row for s in by_ranks[4])
        priced = project(_plan(8, 1, [rank_class]), machine).collectives
        for kind in {s.kind for s in by_ranks[2]}:
            spans = [s for s in by_ranks[2] if s.kind == kind]
            expected = sum(
                collective_s(machine, kind, 2, s.calls, s.received, s.calls, nodes=2) for s in spans
            )
            assert priced[f"{kind} over 2"] == pytest.approx(expected)
            over_the_block = sum(
                collective_s(machine, kind, 8, s.calls, s.received, s.calls) for s in spans
            )
            assert over_the_block > 1.5 * expected


def test_a_w_split_is_priced_above_an_h_split_by_its_strided_copies(tmp_path: Path) -> None:
    """NOTE [Strided copies]: the FNO's slabs of 2 ranks along H and along W do the same FLOPs,
    but the W slab's copies read pieces narrowed along the last dim, ``B C H`` runs each: more
    runs than the H slab's, priced as compute at this machine's measured rate per run
    (``gloo_cpu``), and at none on a machine that has no such cost."""
    cfg = _compose([*SMALL, "data.dataset.solver.resolution=32", "train.global_batch=1",
                    f"run_dir={tmp_path}"])  # fmt: skip
    plans = {dim: plan_run(chosen_config(cfg, Decomposition(1, ((dim, 2),)))) for dim in "HW"}
    runs = {dim: max(c.strided_runs for c in plan.classes) for dim, plan in plans.items()}
    assert runs["W"] > 1.2 * runs["H"] > 0
    flops = {dim: {(c.flops, c.fft_flops) for c in plan.classes} for dim, plan in plans.items()}
    assert flops["W"] == flops["H"]
    # The memory traffic apart (the W slab's transposes move other bytes), every family's too.
    families = {f"{family}_bytes_per_s": None for family in FLOP_FREE_FAMILIES}
    machine = dataclasses.replace(gloo_cpu(2), memory_bytes_per_s=math.inf, **families)
    assert machine.strided_copy_s_per_run > 0
    w, h = (project(plans[dim], machine) for dim in "WH")
    extra = (runs["W"] - runs["H"]) * machine.strided_copy_s_per_run
    assert w.compute - h.compute == pytest.approx(extra)
    free = dataclasses.replace(machine, strided_copy_s_per_run=0.0)
    assert project(plans["W"], free).compute == pytest.approx(project(plans["H"], free).compute)


def test_dp_inside_nodes_is_listed_and_priced_over_the_nodes_its_domain_spans(
    tmp_path: Path,
) -> None:
    """On several nodes every dp x domain decomposition comes twice: dp outermost, and dp the
    mesh's last axis (replicas inside a node). 8 ranks, 4 a node: ``dp=4 x slab H=2`` keeps
    each domain pair on one node (ranks 0, 1); ``slab H=2 x dp=4`` puts it across the two
    (ranks 0, 4), and its domain collectives cost more; the gradient all-reduce spans all 8
    in both."""
    names = {d.describe(2): (d.mesh, d.parallel().axis_names)
             for d in decompositions(8, ("H", "W"), dp_inside_nodes=True)}  # fmt: skip
    assert names["slab H=2 x dp=4"] == ("2x4", ["domain_h", "dp"])
    assert names["dp=4 x slab H=2"] == ("4x2", ["dp", "domain_h"])
    assert "slab H=8 x dp=1" not in names and len(names) == 10 + 5
    assert len(decompositions(8, ("H", "W"))) == 10
    cfg = _compose([*SMALL, "data.dataset.solver.resolution=32", "train.global_batch=4",
                    f"run_dir={tmp_path}"])  # fmt: skip
    machine = Machine(gpus_per_node=4)
    projected = {}
    for inside in (False, True):
        plan = plan_run(chosen_config(cfg, Decomposition(4, (("H", 2),), inside)))
        domain = {tuple(s.ranks) for s in plan.classes[0].spans if len(s.ranks) == 2}
        assert domain == {(0, 4) if inside else (0, 1)}
        projected[inside] = project(plan, machine).collectives
    for kind in ("all_to_all over 2", "all_gather over 2"):
        assert projected[True][kind] > projected[False][kind]
    assert projected[True]["all_reduce over 8"] == pytest.approx(
        projected[False]["all_reduce over 8"]
    )


@pytest.mark.slow  # seven dry runs: 8 s at load 12 (pytest -m slow tests/test_parallel_auto.py)
def test_a_field_too_large_for_one_device_gets_a_domain_decomposition(tmp_path: Path) -> None:
    """A budget below one whole sample's step (what every replica of pure data parallelism
    holds) and above half of one: with a global batch of 1 the choice splits the field; with
    a batch of 2 over 2 ranks every decomposition holds one sample per rank, and the error
    says so in one line."""
    whole = plan_run(_compose([*SMALL, "mesh=1", "train.global_batch=1", f"run_dir={tmp_path}"]))
    whole_gib = whole.classes[0].memory.peak / 2**30
    budget = 0.9 * whole_gib
    overrides = [*SMALL, "mesh=2", f"parallel.memory_gib={budget}", f"run_dir={tmp_path}"]
    choice = choose(_compose([*overrides, "train.global_batch=1"]), 2)
    assert choice.best.decomposition.splits and choice.best.decomposition.dp == 1
    assert dry_run(_compose([*overrides, "train.global_batch=1"])) == 0
    written = json.loads((tmp_path / PLAN_FILE).read_text())
    assert written["choice"] == json.loads(json.dumps(choice.as_dict()))
    assert written["mesh"] == choice.best.decomposition.mesh
    assert all(c.peak_bytes <= budget * 2**30 for c in choice.ranked)
    assert {c.label: c.problem for c in choice.dropped} == {
        "dp=2": "train.global_batch=1 does not split over 2 replicas"
    }
    with pytest.raises(ConfigError) as error:
        choose(_compose([*overrides, "train.global_batch=2"]), 2)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(
        "parallel=auto: none of the 3 decompositions of 2 ranks fits 0.9"[:52]
    )
    assert "a train.global_batch below 2 lets a domain decomposition split a sample" in message


def test_the_machine_and_its_overrides_from_the_command_line(tmp_path: Path) -> None:
    from shardsci.planning._dry_run import planned_machine
    from shardsci.training import ParallelConfig, config_from

    override = 'parallel.machine_overrides=["ib_bytes_per_s=25e9","gpus_per_node=4"]'
    cfg = _compose(["+recipe=cfd", "parallel.machine=h100", override, f"run_dir={tmp_path}"])
    machine, name = planned_machine(config_from(ParallelConfig, cfg.parallel), 8)
    assert (name, machine.ib_bytes_per_s, machine.gpus_per_node) == ("h100", 25e9, 4)
    cpu, _ = planned_machine(ParallelConfig(machine="cpu"), 4)
    assert not cpu.host_overlaps_device and cpu.gpus_per_node == 4
    with pytest.raises(ConfigError, match=r"parallel.machine_overrides: 'ib=1': expected"):
        planned_machine(ParallelConfig(machine="h100", machine_overrides=["ib=1"]), 8)
    with pytest.raises(ConfigError, match=r"parallel\.machine='tpu': expected 'h100', 'cpu'"):
        planned_machine(ParallelConfig(machine="tpu"), 8)


# ---------------------------------------------------------------------------- the benchmark
def test_a_runs_step_times_are_read_back_from_the_throughput_its_trainer_logs(monkeypatch):
    """``benchmarks.parallel_auto`` times each step of a run from the cumulative throughput
    ``train.py`` logs after every step: the trainer's own ``Progress`` on a clock whose steps
    last known times gives them back, the first step's warm-up apart."""
    durations = [4.0, 1.5, 0.5, 0.75, 0.5, 2.0]
    clock = itertools.accumulate([10.0, *durations])
    monkeypatch.setattr(_progress, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    progress = _progress.Progress(len(durations), 0, cells_per_step=16 * 64**2, enabled=False)
    logged = [progress.step(loss=0.0) for _ in durations]
    assert step_times(logged, 16 * 64**2) == pytest.approx(durations)


def test_the_rounds_alternate_and_stop_before_one_would_overrun_the_budget(
    monkeypatch, capsys, tmp_path: Path
):
    """``parallel_auto`` on stubbed runs of 10 s each on a stepped clock: two candidates, 3
    rounds asked, 45 s of budget: a second round (ending at 40 s) runs, in the reverse order,
    a third (60 s) does not; the choice is judged on the rounds run and says how many."""
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(parallel_auto, "time", SimpleNamespace(monotonic=lambda: clock.now))
    candidates = [
        SimpleNamespace(
            label=label,
            projection=SimpleNamespace(compute=0.1, communication=0.0, host=0.0, step=0.1),
            decomposition=SimpleNamespace(mesh="8"),
            peak_bytes=0,
        )
        for label in ("dp=8", "slab H=8")
    ]
    choice = SimpleNamespace(ranked=candidates, dropped=[], best=candidates[0])
    monkeypatch.setattr(parallel_auto, "choose", lambda cfg, world, prune: choice)
    monkeypatch.setattr(parallel_auto, "candidate_overrides", lambda c, configs: [c.label])
    seconds = {"dp=8": 1.05, "slab H=8": 1.0}

    def run_steps(overrides, run_dir, args):
        clock.now += 10.0
        return {"step_s": seconds[overrides[-1]], "run_cpu_s": 1.0, "others_cores": 0.1}

    monkeypatch.setattr(parallel_auto, "run_steps", run_steps)
    args = argparse.Namespace(model="fno", batch=16, resolution=64, steps=6, rounds=3, replay=[])
    goal = parallel_auto.measure_world(8, args, tmp_path, deadline=45.0)
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    runs = [(r["round"], r["label"]) for r in records if r["record"] == "run"]
    assert runs == [(0, "dp=8"), (0, "slab H=8"), (1, "slab H=8"), (1, "dp=8")]
    (choice_record,) = [r for r in records if r["record"] == "choice"]
    assert choice_record["rounds"] == 2 and choice_record["ratio"] == pytest.approx(1.05)
    assert goal.met


# ---------------------------------------------------------------------------- the search
class _StubbedPlan:
    """A started dry run of made-up rank classes: ``start_plan``'s interface (NOTE [A dry run's
    first rank bounds the whole plan]), the budget problems computed as ``so_far`` does."""

    def __init__(self, world: int, classes: list[RankClassPlan], budget: float, log: list):
        self.world, self.classes, self.budget, self.log = world, classes, budget, log
        self.simulated = 1

    @property
    def classes_left(self) -> int:
        return len(self.classes) - self.simulated

    def so_far(self) -> RunPlan:
        plan = _plan(self.world, 1, self.classes[: self.simulated])
        plan.problems = [
            f"rank class {n} over the budget"
            for n, c in enumerate(plan.classes, start=1)
            if c.memory.peak > self.budget * 2**30
        ]
        plan.simulated_ranks = self.simulated
        return plan

    def finished(self) -> RunPlan:
        self.log.append("finished")
        self.simulated = len(self.classes)
        return self.so_far()


def _stub_search(monkeypatch, world: int, seed: int, state_gib: float = 0.0) -> list:
    """Give every decomposition 1-5 rank classes of random work, a few ties and some classes
    after the first over a 1 GiB budget; returns the log of simulations."""
    import random

    from shardsci.planning import _choose

    generator = random.Random(seed)
    log = []

    def start_plan(cfg, budget):
        log.append(cfg.mesh)
        classes = []
        for _ in range(generator.randint(1, 5)):
            c = _class(generator.choice([1, 2, 3]) * 10**9, generator.choice([10, 20]), 0, 0)
            c.memory.peak = generator.choice([2**29, 2**29, 2**29, 2**31])
            c.memory.parameters = int(state_gib * 2**30)
            classes.append(c)
        classes[0].memory.peak = min(classes[0].memory.peak, 2**29)
        for c in classes:
            c.memory.peak = max(c.memory.peak, c.memory.parameters)
        return _StubbedPlan(world, classes, budget, log)

    monkeypatch.setattr(_choose, "start_plan", start_plan)
    return log


@pytest.mark.parametrize("world", [8, 16])
def test_pruning_keeps_the_full_searchs_choice(monkeypatch, tmp_path: Path, world: int) -> None:
    """NOTE [Pruning the search], on stubbed dry runs of random work with ties: the pruned
    search chooses what planning every candidate in full chooses (the same projection, ties
    broken by the enumeration alike), ranks what it plans as the full search does, and plans
    fewer in full. ``tests/test_parallel_auto.py::test_pruning_keeps_a_real_searchs_choice``
    does the same on real dry runs (slow)."""
    cfg = _compose(["+recipe=cfd", "parallel.memory_gib=1", "train.global_batch=16",
                    f"run_dir={tmp_path}"])  # fmt: skip
    for seed in range(6):
        choices, finished = {}, {}
        for prune in (False, True):
            log = _stub_search(monkeypatch, world, seed)
            choices[prune] = choose(cfg, world, prune=prune)
            finished[prune] = log.count("finished")
        full, pruned = choices[False], choices[True]
        assert pruned.best.label == full.best.label
        assert pruned.best.projection == full.best.projection
        ranked = {c.label: c.projection for c in full.ranked}
        assert all(ranked[c.label] == c.projection for c in pruned.ranked)
        assert all(c.bound.step >= pruned.best.projection.step for c in pruned.pruned)
        assert {c.label for c in pruned.listed} == {c.label for c in full.listed}
        assert not full.pruned and finished[True] < finished[False]


def test_a_model_too_large_for_the_budget_is_dropped_before_simulating(
    monkeypatch, tmp_path: Path
) -> None:
    """Parameters and optimiser state over the budget: the first candidate simulated shows it
    (over the budget at its peak), every later one is dropped before any simulation."""
    cfg = _compose(["+recipe=cfd", "parallel.memory_gib=1", "train.global_batch=16",
                    f"run_dir={tmp_path}"])  # fmt: skip
    log = _stub_search(monkeypatch, 8, 0, state_gib=2.0)
    with pytest.raises(ConfigError, match="none of the 10 decompositions of 8 ranks fits 1 GiB"):
        choose(cfg, 8)
    assert len(log) == 1


def test_the_search_says_how_far_it_is_on_stderr(monkeypatch, capsys, tmp_path: Path) -> None:
    """A line at most every ``PROGRESS_EVERY_S`` seconds and one at the end, whose counts add
    up to the table's."""
    from shardsci.planning import _choose

    cfg = _compose(["+recipe=cfd", "parallel.memory_gib=1", "train.global_batch=4",
                    f"run_dir={tmp_path}"])  # fmt: skip
    monkeypatch.setattr(_choose, "PROGRESS_EVERY_S", 1e9)
    _stub_search(monkeypatch, 8, 3)
    choose(cfg, 8)
    assert capsys.readouterr().err.count("\n") == 1  # the last line only
    monkeypatch.setattr(_choose, "PROGRESS_EVERY_S", 0.0)
    _stub_search(monkeypatch, 8, 3)
    choice = choose(cfg, 8)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) > 10 and all(
        line.startswith("parallel=auto: 10 candidates: ") for line in lines
    )
    r, p, d = len(choice.ranked), len(choice.pruned), len(choice.dropped)
    assert lines[-1].startswith(
        f"parallel=auto: 10 candidates: 10 with a first rank simulated or dropped, {r} planned "
        f"in full, {d} dropped, {p} pruned, 0 left; "
    )
    assert d > 0 and p > 0  # dp=8 (the batch does not split), and some pruned


@pytest.mark.slow  # two searches of 8 ranks: 79 s at load 16-30 (pytest -m slow)
def test_pruning_keeps_a_real_searchs_choice(tmp_path: Path) -> None:
    """NOTE [Pruning the search] on real dry runs: 8 ranks of a small FNO, the pruned search
    chooses what planning every candidate in full chooses, and simulates fewer ranks."""
    from shardsci.planning import _dry_run

    cfg = _compose([*SMALL, "data.dataset.solver.resolution=32", "train.global_batch=8",
                    "parallel.machine=h100", f"run_dir={tmp_path}"])  # fmt: skip
    simulate, simulated = _dry_run._simulate, []
    choices = {}
    for prune in (False, True):
        simulated.clear()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(_dry_run, "_simulate", lambda *a: simulated.append(a) or simulate(*a))
            choices[prune] = choose(cfg, 8, prune=prune)
        choices[prune, "simulated"] = len(simulated)
    assert choices[True].best.label == choices[False].best.label
    assert choices[True].best.projection == choices[False].best.projection
    assert choices[True, "simulated"] < choices[False, "simulated"]
