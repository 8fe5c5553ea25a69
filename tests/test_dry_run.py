"""The dry run's predictions against real runs of the same step on 2, 4 and 8 gloo ranks.

Each real rank builds the CFD recipe's model and task (``recipes.cfd.plan`` on the CPU, real
random data), runs one ``Trainer`` step to reach the steady state and measures the next
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

import train  # noqa: F401  registers the config schemas and the recipes
from recipes.cfd.plan import planned_task
from shardsci.distributed import LaunchEnv
from shardsci.planning import RunPlan, measure_step, plan_run
from shardsci.testing import run_on_ranks
from shardsci.training import ParallelConfig, ParallelLayout, RunContext, Trainer, config_from

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SMALL = ["+recipe=cfd", "logger=none", "train.global_batch=2", "data.dataset.solver.resolution=32"]


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose("config", overrides=overrides)


def _measured_step(overrides: list[str]) -> dict:
    """On every rank: one steady-state Trainer step, measured."""
    import torch.distributed as dist

    cfg = _compose(overrides)
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = ParallelLayout.build(str(cfg.mesh), config_from(ParallelConfig, cfg.parallel), "cpu")
    env = LaunchEnv(rank, world, rank, world, "127.0.0.1", 0, "single")
    context = RunContext(env, layout, Path(str(cfg.run_dir)))
    model, task = planned_task(cfg, context, torch.device("cpu"))
    trainer = Trainer(context, cfg, model, task)
    trainer._optimiser_step()
    trainer.step += 1
    measured = measure_step(
        trainer.trained, trainer.optimizer, task, trainer._optimiser_step, "cpu"
    )
    return {
        "comm": measured.comm.as_dict(),
        "peak": measured.memory.peak,
        "parameters": measured.parameters,
        "gradients": measured.gradients,
        "optimizer": measured.optimizer,
    }


def _class_of(plan: RunPlan, rank: int):
    return next(c for c in plan.classes if rank in c.members)


@pytest.mark.parametrize(
    ("world_size", "mesh"),
    [
        (2, ["mesh=2", "parallel=slab"]),
        (4, ["mesh=2x2", "parallel=block"]),
        (8, ["mesh=8", "parallel=slab", "data.dataset.solver.resolution=72"]),
    ],
    ids=["2-slab", "2x2-block", "8-slab-uneven"],
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
        assert (memory.parameters, memory.gradients, memory.optimizer) == (
            figures["parameters"],
            figures["gradients"],
            figures["optimizer"],
        ), f"rank {rank}"
        assert abs(memory.peak - figures["peak"]) <= 0.1 * figures["peak"], (
            f"rank {rank}: predicted peak {memory.peak} B, measured {figures['peak']} B"
        )
