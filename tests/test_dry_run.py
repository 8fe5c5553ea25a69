"""The dry run alone: problems it names, its report and JSON, configurations it refuses.

Its predictions are checked against real runs, measured by means the planner does not share,
in ``tests/test_dry_run_validation.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import shardsci.train  # noqa: F401  registers the config schemas and the recipes
from shardsci.planning import plan_run
from shardsci.planning._dry_run import start_plan

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SMALL = [
    "+recipe=cfd",
    "model=unet",
    "logger=none",
    "train.global_batch=2",
    "data.dataset.solver.resolution=32",
]


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose("config", overrides=overrides)


# ---------------------------------------------------------------------------- the dry run alone
@pytest.mark.parametrize("rank", [0, 1])
def test_a_launched_dry_run_plans_on_rank_0_only(monkeypatch, rank: int) -> None:
    import shardsci.planning
    from shardsci.train import launch

    planned = []
    monkeypatch.setattr(shardsci.planning, "dry_run", lambda cfg: planned.append(cfg) or 7)
    torchrun = {"RANK": rank, "WORLD_SIZE": 2, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": 2}
    for name, value in {**torchrun, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500}.items():
        monkeypatch.setenv(name, str(value))
    status = launch(_compose([*SMALL, "mesh=2x2", "dry_run=true"]))
    assert (status, len(planned)) == ((7, 1) if rank == 0 else (0, 0))


POOLED_TO_NOTHING = [*SMALL, "mesh=4", "parallel=slab", "data.dataset.solver.resolution=16"]
POOLED_TO_NOTHING_PROBLEM = (
    "layer downs.2.pool (AvgPool2d) leaves ranks without cells: its output (2, 64, 2, 2) "
    "has 2 cells in dim 2 over 4 ranks of mesh axes (domain), split 1,0,1,0, so 2 ranks "
    "hold none; use at most 2 ranks there or a larger field (and 10 later layers)"
)


def test_a_downsampling_that_leaves_ranks_without_cells_is_named(tmp_path: Path) -> None:
    """16 rows over 4 ranks: the third pooling leaves 2 rows, so 2 ranks hold none. NOTE [A
    dry run's first rank bounds the whole plan]: the first rank class alone shows the whole
    plan's problem, and ``finished`` simulates the other classes."""
    started = start_plan(_compose([*POOLED_TO_NOTHING, f"run_dir={tmp_path}"]))
    first = started.so_far()
    assert first.problems == [POOLED_TO_NOTHING_PROBLEM]
    left = started.classes_left
    assert first.simulated_ranks == len(first.classes) == 1 and left > 0
    plan = started.finished()
    assert plan.problems == [POOLED_TO_NOTHING_PROBLEM]
    assert plan.simulated_ranks == len(plan.classes) == 1 + left
    assert started.classes_left == 0
    assert plan.classes[0] == first.classes[0]


def test_too_many_ranks_for_the_field_and_a_batch_that_does_not_split(tmp_path: Path) -> None:
    overrides = [*SMALL, "mesh=2x8", "model.depth=1", "data.dataset.solver.resolution=4"]
    plan = plan_run(_compose([*overrides, "train.global_batch=3", f"run_dir={tmp_path}"]))
    assert plan.problems == [
        "train.global_batch=3 does not split over the 2 data-parallel replicas: expected a "
        "multiple of 2 (planned with 1 sample per replica)",
        "the input (1, 1, 4, 4) has 4 cells in dim 2 over 8 ranks of mesh axes (domain), "
        "split 1(x4),0(x4), so 4 ranks hold none; use at most 4 ranks there or a larger field: "
        "too many ranks for the field",
    ]


def test_cli_prints_the_report_and_writes_json_and_checks_the_budget(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    root = CONFIGS.parent
    command = [
        sys.executable,
        "train.py",
        *SMALL,
        "mesh=2x2",
        "parallel=block",
        "model.depth=1",
        "dry_run=true",
        "device_memory_gib=0.001",
        f"run_dir={tmp_path}",
    ]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "rank class 1: 1 rank(s) like rank 0" in done.stdout
    assert "per layer" in done.stdout and "encoder.0.conv" in done.stdout
    assert "over the device budget of 0.001 GiB" in done.stdout
    plan = json.loads((tmp_path / "dry_run.json").read_text())
    assert [c["members"] for c in plan["classes"]] == [[0], [1], [2], [3]]
    assert plan["classes"][0]["collectives"]["halo"]["calls"] > 0


def test_fsdp2_over_replicas_is_refused_naming_the_alternative(tmp_path: Path) -> None:
    from shardsci.training import ConfigError

    cfg = _compose([*SMALL, "mesh=2x2", "train.dp_mode=fsdp2", f"run_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"fsdp2 over 2 data-parallel replicas.*dp_mode=ddp"):
        plan_run(cfg)


@pytest.mark.parametrize(
    ("machine", "as_messages"),
    [("cpu", False), ("h100", True), ('h100 parallel.machine_overrides=["backend=gloo"]', False)],
    ids=["cpu", "h100", "h100-on-gloo"],
)
def test_halos_are_counted_as_the_target_issues_them(tmp_path: Path, machine, as_messages):
    """The dry run's process groups stand in for the target's backend (``Machine.backend``):
    planned for an H100 cluster, a 4-rank slab's halos are message batches (NCCL), planned
    for this CPU one all-to-all each (gloo, NOTE [An exchange of messages as one all-to-all
    where messages are slow]); the mesh is on this CPU either way. The bytes agree. Each
    all-to-all is kept with its group of 4, which prices its host time (NOTE [What an
    all-to-all posts]), and the ranks it connects: a rank and its neighbours. A machine's
    ``backend`` overridden is followed (``planned_machine``). Every class carries its
    ShardTensor calls by dispatch path, the convolutions' function handlers among them (NOTE
    [Host time by dispatch path])."""
    name, *more = machine.split()
    overrides = [*SMALL, "mesh=4", "parallel=slab", f"parallel.machine={name}", *more]
    plan = plan_run(_compose([*overrides, f"run_dir={tmp_path}"]))
    for plan_class in plan.classes:
        halo = plan_class.collectives["halo"]
        assert halo.calls > 0
        assert halo.message_batches == (halo.calls if as_messages else 0)
        kinds = {span.kind for span in plan_class.spans}
        assert ("p2p" in kinds) is as_messages
        all_to_alls = [span for span in plan_class.spans if span.kind == "all_to_all"]
        assert sum(span.calls for span in all_to_alls) == (0 if as_messages else halo.calls)
        assert all(span.group == 4 and len(span.ranks) <= 3 for span in all_to_alls)
        calls = plan_class.dispatch_calls
        assert calls["function"] > 0 and calls["fast"] > 0
        assert set(calls) <= {"fast", "propagation", "handler", "function"}


@pytest.mark.parametrize(("machine", "as_messages"), [("cpu", False), ("h100", True)])
def test_ring_hops_are_counted_as_the_target_issues_them(tmp_path: Path, machine, as_messages):
    """A ViT's ring attention on a 2-rank slab follows the same rule as halos: planned for an
    H100 cluster each hop is a batch of messages (NCCL), for this CPU one all-to-all (gloo);
    the library counts them as ``"p2p"`` either way."""
    from shardsci import attention_exchange

    overrides = [*SMALL, "model=vit", "mesh=2", "parallel=slab", f"parallel.machine={machine}"]
    with attention_exchange("ring"):
        plan = plan_run(_compose([*overrides, f"run_dir={tmp_path}"]))
    hops = plan.classes[0].collectives["p2p"]
    assert hops.calls > 0
    assert hops.message_batches == (hops.calls if as_messages else 0)
    kinds = {span.kind for span in plan.classes[0].spans}
    assert ("p2p" in kinds) is as_messages
