"""The dry run's predictions against real runs of the same step on 2, 4 and 8 gloo ranks.

Each real rank builds the CFD recipe's model and the dry run's task (``random_next_step`` on the
CPU, real random data), runs one ``Trainer`` step to reach the steady state and measures the next
``Trainer._optimiser_step`` with ``measure_step``: its collectives (``comm_counter``) and
its live tensor memory (NOTE [What the memory figures count]). The dry run of the same
config, in this process on a fake process group and ``meta`` tensors, must predict for every
rank, through its rank class, the same collectives and bytes exactly and the peak within 10%.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import shardsci.train  # noqa: F401  registers the config schemas and the recipes
from shardsci.distributed import LaunchEnv
from shardsci.planning import RunPlan, measure_step, plan_run
from shardsci.recipes.cfd.task import random_next_step
from shardsci.testing import run_on_ranks
from shardsci.training import (
    ParallelConfig,
    Parallelism,
    ParallelPlan,
    RunContext,
    StopRequests,
    Trainer,
    config_from,
    instantiate,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
CPU = torch.device("cpu")
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


def _measured_step(overrides: list[str]) -> dict:
    """On every rank: one steady-state Trainer step, measured."""
    import torch.distributed as dist

    cfg = _compose(overrides)
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = ParallelPlan.of(str(cfg.mesh), config_from(ParallelConfig, cfg.parallel), ("H", "W"))
    env = LaunchEnv(rank, world, rank, world, "127.0.0.1", 0, "single")
    context = RunContext(env, Parallelism.build(plan, "cpu"), Path(str(cfg.run_dir)), CPU)
    model, task = instantiate(cfg.model), random_next_step(cfg, context)
    trainer = Trainer(context, cfg, model, task)
    with StopRequests() as requests:
        trainer._optimiser_step(requests)
        trainer.step += 1
        measured = measure_step(
            trainer.trained,
            trainer.optimizer,
            task,
            lambda: trainer._optimiser_step(requests),
            "cpu",
        )
    return {
        "comm": measured.comm.as_dict(),
        "peak": measured.memory.peak,
        "parameters": measured.parameters,
        "gradients": measured.gradients,
        "optimizer": measured.optimizer,
        "grad_buckets": measured.grad_buckets,
    }


def _class_of(plan: RunPlan, rank: int):
    return next(c for c in plan.classes if rank in c.members)


@pytest.mark.parametrize(
    ("world_size", "mesh"),
    [
        (2, ["mesh=2", "parallel=slab"]),
        (4, ["mesh=2x2", "parallel=block"]),
        (8, ["mesh=8", "parallel=slab", "data.dataset.solver.resolution=72"]),
        (8, ["mesh=2x4", "data.dataset.solver.resolution=72"]),
    ],
    ids=["2-slab", "2x2-block", "8-slab-uneven", "8-dp2-x-slab4"],
)
def test_predictions_match_measured_runs(world_size: int, mesh: list[str], tmp_path: Path) -> None:
    overrides = [*SMALL, *mesh, f"run_dir={tmp_path}"]
    plan = plan_run(_compose(overrides))
    assert not plan.problems, plan.problems
    measured = run_on_ranks(world_size, _measured_step, overrides, timeout_s=300)
    for rank, figures in enumerate(measured):
        predicted = _class_of(plan, rank)
        calls = {k: v.calls for k, v in predicted.collectives.items()}
        sent = {k: v.sent for k, v in predicted.collectives.items()}
        received = {k: v.received for k, v in predicted.collectives.items()}
        assert figures["comm"]["calls"] == calls, f"rank {rank}"
        assert figures["comm"]["sent"] == sent, f"rank {rank}"
        assert figures["comm"]["received"] == received, f"rank {rank}"
        memory = predicted.memory
        assert (memory.parameters, memory.gradients, memory.optimizer, memory.grad_buckets) == (
            figures["parameters"],
            figures["gradients"],
            figures["optimizer"],
            figures["grad_buckets"],
        ), f"rank {rank}"
        assert abs(memory.peak - figures["peak"]) <= 0.1 * figures["peak"], (
            f"rank {rank}: predicted peak {memory.peak} B, measured {figures['peak']} B"
        )


# ---------------------------------------------------------------------------- the dry run alone
def test_a_downsampling_that_leaves_ranks_without_cells_is_named(tmp_path: Path) -> None:
    """16 rows over 4 ranks: the third pooling leaves 2 rows, so 2 ranks hold none."""
    overrides = [*SMALL, "mesh=4", "parallel=slab", "data.dataset.solver.resolution=16"]
    plan = plan_run(_compose([*overrides, f"run_dir={tmp_path}"]))
    assert plan.problems == [
        "layer downs.2.pool (AvgPool2d) leaves ranks without cells: its output (2, 64, 2, 2) "
        "has 2 cells in dim 2 over 4 ranks of mesh axes (domain), split 1,0,1,0, so 2 ranks "
        "hold none; use at most 2 ranks there or a larger field (and 10 later layers)"
    ]


def test_too_many_ranks_for_the_field_and_a_batch_that_does_not_split(tmp_path: Path) -> None:
    overrides = [*SMALL, "mesh=2x4", "model.depth=1", "data.dataset.solver.resolution=2"]
    plan = plan_run(_compose([*overrides, "train.global_batch=3", f"run_dir={tmp_path}"]))
    assert plan.problems == [
        "train.global_batch=3 does not split over the 2 data-parallel replicas: expected a "
        "multiple of 2 (planned with 1 sample per replica)",
        "the input (1, 1, 2, 2) has 2 cells in dim 2 over 4 ranks of mesh axes (domain), "
        "split 1(x2),0(x2), so 2 ranks hold none; use at most 2 ranks there or a larger field: "
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
