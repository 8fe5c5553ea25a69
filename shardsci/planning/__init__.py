"""Dry runs: what a run on any mesh will hold and move, found on one machine in seconds.

``plan_run(cfg)`` simulates one steady-state training step of a composed run config per rank
class, on a fake process group with ``meta`` tensors, executing shardsci itself (NOTE [A dry
run executes the library on one simulated rank at a time]); ``dry_run(cfg)`` is what
``python train.py ... dry_run=true`` calls: it prints the report, writes ``dry_run.json`` to
the run directory and returns the exit status; under ``parallel=auto`` with a one-number mesh
it first prints the ranked decompositions (``choose``, NOTE [How parallel=auto chooses]) and
reports the chosen one. ``measure_step`` watches any step the same
way on real ranks (how ``tests/test_dry_run.py`` checks the predictions).
"""

from pathlib import Path

from omegaconf import DictConfig

from shardsci.planning._choose import (
    Candidate,
    Choice,
    Decomposition,
    Projection,
    choice_applies,
    choose,
    choose_for_launch,
    chosen_config,
    format_choice,
)
from shardsci.planning._dry_run import plan_run
from shardsci.planning._measure import StepMeasurement, measure_step, steady_state
from shardsci.planning._memory import Category, LiveMemory
from shardsci.planning._plan import (
    CollectiveFigures,
    GradientReductionPlan,
    LayerPlan,
    MemoryPlan,
    RankClassPlan,
    RunPlan,
    SpanFigures,
)
from shardsci.planning._report import PLAN_FILE, format_plan, write_plan

__all__ = [
    "PLAN_FILE",
    "Candidate",
    "Category",
    "Choice",
    "CollectiveFigures",
    "Decomposition",
    "GradientReductionPlan",
    "LayerPlan",
    "LiveMemory",
    "MemoryPlan",
    "Projection",
    "RankClassPlan",
    "RunPlan",
    "SpanFigures",
    "StepMeasurement",
    "choice_applies",
    "choose",
    "choose_for_launch",
    "chosen_config",
    "dry_run",
    "format_choice",
    "format_plan",
    "measure_step",
    "plan_run",
    "steady_state",
    "write_plan",
]


def dry_run(cfg: DictConfig) -> int:
    """Plan ``cfg`` (its chosen decomposition under ``parallel=auto``), print the report, write
    it (with the ranked candidates when it chose) to the run directory; 0 when no problems."""
    world_size = choice_applies(cfg, None)
    choice = None
    if world_size is not None:
        choice = choose(cfg, world_size)
        print(format_choice(choice), end="\n\n", flush=True)
        cfg = chosen_config(cfg, choice.best.decomposition)
    plan = plan_run(cfg, device_memory_gib=cfg.get("device_memory_gib"))
    written = None if choice is None else choice.as_dict()
    path = write_plan(plan, Path(str(cfg.run_dir)), written)
    print(format_plan(plan))
    print(f"plan written to {path}", flush=True)
    return 1 if plan.problems else 0
