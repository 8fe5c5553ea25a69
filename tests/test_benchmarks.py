"""Every benchmark runs at a tiny size: its records are JSON lines ending with a ``summary``, and
under ``--check`` a missed goal exits with status 1 (NOTE [A benchmark's goals and --check]).

Each runs in this process on the suite's rank pools (their shutdown at the benchmark's end is
switched off), with a goal made unreachable by patching what the benchmark compares with (a
threshold or a lower bound, read in this process only); a benchmark without goals must exit
0 under ``--check``. The figures of such tiny runs mean nothing. A real run of the CFD recipe
(``recipe_throughput``) and of the 3-D one (``cfd3d_recipe``), the compiled steps
(``compile``), eight 3-D solver ranks (``ns3d_generation``), two steps of the 3-D FNO on eight
ranks (``cfd3d_meshes``) and four of it (``memory_3d``) cost more than the rest together:
those six are ``slow``; ``recipe_throughput``'s and ``cfd3d_recipe``'s goals are also checked
here on stubbed runs.
"""

from __future__ import annotations

import importlib
import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from benchmarks import _common
from tests.test_cfd3d_recipe import SMALL_FNO as CFD3D_SMALL_FNO
from tests.test_cfd3d_recipe import TINY_DATA as CFD3D_TINY_DATA
from tests.test_cost_model import synthetic_measurement


@dataclass(frozen=True)
class Smoke:
    """A tiny run of ``benchmarks.<module>``: its arguments (as typed in a shell), what to patch
    on the module (or on another benchmark module, ``"module:name"``) to miss a goal, and the
    goals it then misses (statements' beginnings; none for a benchmark without goals)."""

    arguments: str
    patches: dict[str, Callable[[Any], Any]] = field(default_factory=dict)
    missed: tuple[str, ...] = ()


def _one_byte_more(bound: Callable) -> Callable:
    """``bound`` with one byte more to receive on every rank: no run meets it."""

    def more(*args: Any) -> Any:
        sent, received = bound(*args)
        return sent, [n + 1 for n in received]

    return more


def _one_halo_byte_more(bound: Callable) -> Callable:
    def more(*args: Any) -> dict[str, list[int]]:
        bounds = bound(*args)
        return {**bounds, "received": [n + 1 for n in bounds["received"]]}

    return more


SMOKES = {
    # 2 ranks, one call of each kind.
    "call_waiting": Smoke("--rounds 1 --calls 1 --channels 8 --tile 4"),
    "halo_collective": Smoke("--meshes 2 --work pad ring --tiles 4 --rounds 1 --steps 1"),
    "dispatch_overhead": Smoke(
        "--rounds 3 --warmup 1",
        {"GOAL_RATIO": lambda _: 0.0},
        ("ShardTensor pointwise op time",),
    ),
    "communication_volume": Smoke(
        r"--cases '^Shard\(2\)->Shard\(3\)$|round trip'",
        {"redistribution_bound": _one_byte_more},
        ("every case at the byte lower bound",),
    ),
    "halo_and_conv": Smoke(
        "--shrink 16 --rounds 1",
        {
            "halo_bytes:lower_bounds": _one_halo_byte_more,
            # At 16 rows a 3x3 convolution's halo rows are an eighth of a rank's input.
            "activation_memory:GOAL_RATIO": lambda _: 10.0,
        },
        ("every halo exchange correct and at the byte lower bound",),
    ),
    "model_step": Smoke(
        "--sizes 32 --rounds 1 --steps 1",
        {"GOALS": lambda _: {0: (1e9, 0.0)}},
        ("unet 32²: 2 ranks at least", "unet 32²: ShardTensor on 1 rank at most"),
    ),
    "large_field": Smoke(
        "--size 32 --ranks 2",
        {"AGREEMENT": lambda _: -1.0},
        ("2 ranks agree with 1 rank",),
    ),
    "scaling_model": Smoke("--tile 8"),
    # The projection on a synthetic measurement (its fit and measurement: test_cost_model.py).
    "cost_model": Smoke(
        "--models fno",
        {
            "measure_model": lambda _: lambda name, backend: synthetic_measurement(),
            "WEAK_GOAL": lambda _: 2.0,
        },
        ("fno: weak-scaling efficiency at 512 GPUs",),
    ),
    "graph_halo": Smoke(
        "--spacing 0.1 --steps 1 --warmup 0 --worlds 1 2",
        {"lower_bound_bytes": lambda bound: lambda nodes: bound(nodes) + 1},
        ("halo bytes per layer at the lower bound",),
    ),
    "unmoved_strategy": Smoke(
        "--rounds 1 --cases sin",
        {"GOAL_SPEEDUP": lambda _: 1e9},
        ("the unmoved route at least",),
    ),
    "first_call": Smoke(
        "--limit 1 --rounds 1 --warm 1",
        {"GOAL_MS": lambda _: -1.0},
        ("no op plans for more than",),
    ),
}
SLOW_SMOKES = {
    "ns3d_generation": Smoke(
        "--sizes 16 --steps 2 --layout slab",
        {"AGREEMENT": lambda _: -1.0},
        ("16³: 8 ranks agree with 1",),
    ),
    # 123 s at load average ~50 (two models built, one step each, a 1-rank pool).
    "host_overhead": Smoke(
        "--models unet --worlds 1 --rounds 1 --steps 1",
        {"GOAL_RATIO": lambda _: 0.0},
        ("unet on 1 rank(s): ShardTensor step at most",),
    ),
    # One rank, four variants of the ViT built, one step each (DTensor's fails: recorded).
    "host_floor": Smoke(
        "--models vit --rounds 1 --steps 1 --per-op",
        {"GOAL_RATIO": lambda _: 0.0},
        ("vit, 1 rank: wrapper step at most", "vit, 1 rank: shardtensor step at most"),
    ),
    "compiled_step_profile": Smoke(
        "--models fno --ranks 1 --warmup 1 --steps 1",
        {"COMPILED_GOAL_RATIO": lambda _: 0.0},
        ("fno on 1 rank(s), aot_eager: compiled ShardTensor step at most",),
    ),
    # Two 8-rank FNO 3-D steps at 16³ (tiny figures; the byte goal is patched to be missed).
    "cfd3d_meshes": Smoke(
        "--size 16 --batch 1 --rounds 1 --steps 1",
        {"PENCIL_BYTES_FACTOR": lambda _: 0.0},
        ("the pencil receives at most 0x",),
    ),
    "memory_3d": Smoke(
        "--sizes 16 24 --ranks 1 2 --budget-gib 0",
        # A tiny field's peaks are fixed costs, not the field's: only the agreement is checked;
        # a budget of 0 stops every search at its first size.
        {"GOAL_FACTOR": lambda _: 1e9, "AGREEMENT": lambda _: -1.0},
        ("train: 2 ranks agree with 1 rank", "predict: 2 ranks agree with 1 rank"),
    ),
    "compile": Smoke("--models unet --worlds 1 2 --rounds 1 --size 32 --backend eager"),
    # The 3-D recipe's command on 2 ranks at 8³ (its data generated in the run), 2 steps.
    "cfd3d_recipe": Smoke(
        "--fresh-data --overrides mesh=2 train.steps=2 train.global_batch=2 "
        + " ".join([*CFD3D_TINY_DATA, *CFD3D_SMALL_FNO]),
        {"CPU_BUDGET_S": lambda _: 0.0, "ERROR_RATIO": lambda _: 1e9},
        ("the command's CPU seconds",),
    ),
    # 35 s at load 11: every collective on 2 and 4 ranks, the kernels, a host_overhead step.
    # Not smoked: calibrate_steps (it reads calibrate's and cost_model's saved files;
    # tests/test_calibration.py checks its logic) and calibrate_bandwidth (root, namespaces).
    "calibrate": Smoke("--repeats 1"),
    # One run of calibrate's host measurement (UNet at 16², 1 rank); no goals.
    "calibrate_host": Smoke("--runs 1 --repeats 1"),
    # 2 ranks, 1 batch per size; the ratio goal patched to be missed.
    "oversubscribed_allreduce": Smoke(
        "--worlds 2 --repeats 1",
        {"GOAL_RATIO": lambda _: 0.5},
        ("2 ranks: latency-bound all-reduces priced within",),
    ),
    # No goals: the per-path figures and one model's step against them (1 rank).
    "calibrate_dispatch": Smoke("--repeats 1 --models fno --steps 1"),
    "core_share": Smoke("--world 2 --rounds 1 --chunks 2 --per-chunk 1"),
    "step_profile": Smoke("--models fno --ranks 1 2 --size 32 --rounds 1 --steps 1"),
    "recipe_throughput": Smoke(
        "--meshes 1 1x2 --rounds 1 --steps 2 --resolution 32 --batch 2",
        {"GOALS": lambda _: {"1x2": 1e9}},
        ("mesh 1x2 at least",),
    ),
}


def _patch(monkeypatch: pytest.MonkeyPatch, module: Any, patches: dict) -> None:
    for target, change in patches.items():
        owner, name = target.split(":") if ":" in target else (None, target)
        where = importlib.import_module(f"benchmarks.{owner}") if owner else module
        monkeypatch.setattr(where, name, change(getattr(where, name)))


def _run(name: str, smoke: Smoke, monkeypatch, capsys) -> list[dict]:
    """Run the smoke with ``--check``; its records. Asserts the exit status and the goals."""
    monkeypatch.setattr(_common, "shutdown_pools", lambda: None)  # keep the suite's pools
    module = importlib.import_module(f"benchmarks.{name}")
    _patch(monkeypatch, module, smoke.patches)
    argv = [*shlex.split(smoke.arguments), "--check"]
    if smoke.missed:
        with pytest.raises(SystemExit) as exit_status:
            module.main(argv)
        assert exit_status.value.code == 1
    else:
        module.main(argv)
    out, err = capsys.readouterr()
    records = [json.loads(line) for line in out.splitlines()]
    summary = records[-1]
    assert summary["record"] == "summary", summary
    conditions = {"cores", "load_average_before", "load_average_after", "wall_s"}
    assert conditions <= summary.keys(), f"{name}'s summary says nothing of its machine"
    missed = [goal["goal"] for goal in summary["goals"] if not goal["met"]]
    assert summary["goals_met"] == (not missed)
    assert len(missed) == len(smoke.missed), missed
    for statement, beginning in zip(missed, smoke.missed):
        assert statement.startswith(beginning), missed
        assert statement in err
    return records


@pytest.mark.parametrize("name", list(SMOKES))
def test_benchmark_runs_tiny_and_check_fails_on_a_missed_goal(name, monkeypatch, capsys):
    records = _run(name, SMOKES[name], monkeypatch, capsys)
    assert len(records) > 1


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_SMOKES))
def test_slow_benchmark_runs_tiny(name, monkeypatch, capsys):
    records = _run(name, SLOW_SMOKES[name], monkeypatch, capsys)
    assert len(records) > 1


def test_recipe_throughput_goals_on_stubbed_runs(monkeypatch, capsys):
    """mesh 1x2 at half mesh 1's steps per second misses issue 7's 0.7x (its real runs are
    in the slow test)."""
    from benchmarks import recipe_throughput

    rates = {"1": 2.0, "1x2": 1.0, "4x2": 1.0}
    monkeypatch.setattr(
        recipe_throughput, "steps_per_second", lambda mesh, run_dir, args: rates[mesh]
    )
    smoke = Smoke("--meshes 1 1x2 4x2 --rounds 2", {}, ("mesh 1x2 at least",))
    records = _run("recipe_throughput", smoke, monkeypatch, capsys)
    ratios = {r["mesh"]: r["ratio_to_first"] for r in records if r["record"] != "summary"}
    assert ratios == {"1": 1.0, "1x2": 0.5, "4x2": 0.5}


def test_cfd3d_recipe_goals_on_stubbed_runs(monkeypatch, capsys):
    """Runs of 1,300, 1,100 and 1,250 CPU seconds (median 1,250) miss the 10 minutes of two
    cores; a held-out error of 0.05 against persistence's 0.2 meets 0.3x; each record shows
    the rollout after its first, middle and last step (its real run is in the slow test)."""
    from benchmarks import cfd3d_recipe

    metrics = {
        "step": 400,
        "eval_relative_l2": 0.05,
        "persistence_relative_l2": 0.2,
        **{f"rollout_relative_l2_step{k}": k / 10 for k in range(1, 11)},
        "persistence_rollout_relative_l2_step10": 1.0,
    }
    cpu = iter([1300.0, 1100.0, 1250.0])
    monkeypatch.setattr(
        cfd3d_recipe,
        "run_recipe",
        lambda run_dir, args: cfd3d_recipe.RecipeRun(next(cpu), 0.0, 1.0, 1.0, metrics),
    )
    smoke = Smoke("--repeats 3", {}, ("the command's CPU seconds",))
    records = _run("cfd3d_recipe", smoke, monkeypatch, capsys)
    assert records[-1]["cpu_s"] == 1250.0 and records[-1]["error_ratio"] == 0.25
    shown = {k for k in records[0] if k.startswith("rollout_step")}
    assert shown == {"rollout_step1", "rollout_step6", "rollout_step10"}
    assert records[0]["rollout_step6"] == 0.6 and records[0]["persistence_rollout_step10"] == 1.0
