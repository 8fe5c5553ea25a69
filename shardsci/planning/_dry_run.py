"""Plan a run without running it: ``python train.py +recipe=cfd mesh=64x8 dry_run=true``.

The run is planned as a real one is (``ParallelPlan``, once; NOTE [A run is planned once]); the
model is ``cfg.model`` and the recipe supplies data-free batches (``Recipe.dry_run_task``); one
steady-state training step, the trainer's (NOTE [One training step]), is simulated per rank
class (NOTE [A dry run executes the library on one
simulated rank at a time]) and watched (NOTE [How a dry run observes the library], NOTE
[What the memory figures count]), the gathers its ops make without being asked listed per
layer (NOTE [Gathers an op was not asked to make]). Whatever would stop the run becomes a
problem naming what and where: a data-parallel split the batch does not allow, a layer that
leaves ranks without cells, a step that fails (a gather under gather policy ``"error"``
included), memory over a stated device budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from shardsci.distributed import LaunchEnv
from shardsci.planning._machine import Machine, gloo_cpu, override
from shardsci.planning._measure import (
    StepFailed,
    StepMeasurement,
    gradient_reducer,
    measure_step,
    steady_state,
)
from shardsci.planning._observe import describe_sizes
from shardsci.planning._plan import (
    GradientReductionPlan,
    RankClassPlan,
    RunPlan,
    class_plan,
    layer_plans,
)
from shardsci.planning._rank_classes import rank_classes
from shardsci.planning._world import META, simulated_rank
from shardsci.tensor import ShardTensorSpec, gather_policy
from shardsci.tensor._spec import DimSharding
from shardsci.training import (
    ConfigError,
    DataParallelMode,
    ParallelConfig,
    Parallelism,
    ParallelPlan,
    Recipe,
    RunContext,
    Task,
    TrainConfig,
    config_from,
    get_recipe,
    instantiate,
    parallelize,
    training_step,
)

__all__ = ["StartedPlan", "plan_run", "start_plan"]

_GIB = 2**30


@dataclass
class _Simulation:
    """One simulated rank: its watched step and what only the first simulation provides."""

    measured: StepMeasurement
    coordinate: list[int]
    classes: list[list[int]]
    dp_size: int
    model_name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer


def plan_run(cfg: DictConfig, device_memory_gib: float | None = None) -> RunPlan:
    """Dry-run the composed run config ``cfg`` (recipe, mesh, model, data, train, optim): every
    rank class simulated (``start_plan(cfg, device_memory_gib).finished()``).

    Parameters
    ----------
    device_memory_gib : float, optional
        Memory of one device; a rank class whose peak exceeds it is a problem.

    Raises
    ------
    ConfigError
        If the recipe has no ``dry_run_task``, the mesh cannot be planned (an axis size left
        to infer, axis roles that do not fit), or FSDP2 would shard parameters over a
        data-parallel axis.
    """
    return start_plan(cfg, device_memory_gib).finished()


# NOTE [A dry run's first rank bounds the whole plan]
# ``start_plan`` simulates the first rank class only (rank 0's); ``finished`` simulates the
# others. What the first simulation finds already bounds the whole plan, so ``parallel=auto``
# decides most candidates from it (NOTE [How parallel=auto chooses]):
# - a step that leaves ranks without cells is decided by the step's global layouts, the same on
#   every rank (``_empty_shard_problems`` reads the first rank's only), and of 512 ranks on a
#   64² field most candidates have it (a slab of 128 ranks, the FNO's 12 retained modes over
#   16 ranks);
# - a step that fails, or a first class over the memory budget, is a problem of the whole plan;
# - the whole plan's peak memory and projected step are those of its largest and slowest class
#   (``project`` takes the maximum over classes), so the first class's are lower bounds of
#   them.
# Simulating the other classes (up to 25 on a 2-D block whose shards are narrower than four
# cells) adds nothing to those verdicts; it is what the full plan's figures need.
@dataclass
class StartedPlan:
    """A dry run whose first rank class is simulated (NOTE [A dry run's first rank bounds
    the whole plan]); ``so_far`` is its plan of the classes simulated, ``finished`` simulates
    the rest."""

    cfg: DictConfig
    recipe: Recipe
    plan: ParallelPlan
    train: TrainConfig
    backend: str
    device_memory_gib: float | None
    simulations: list[_Simulation]
    failures: list[str]
    wall_s: float
    cpu_s: float

    @property
    def classes_left(self) -> int:
        """Rank classes not simulated yet (none after a failed step)."""
        if self.failures or not self.simulations:
            return 0
        return len(self.simulations[0].classes) - len(self.simulations)

    def finished(self) -> RunPlan:
        """The plan of every rank class, simulating those left."""
        started, cpu_started = time.perf_counter(), time.process_time()
        first = self.simulations[0] if self.simulations else None
        try:
            for ranks in first.classes[len(self.simulations) :] if first else []:
                self.simulations.append(
                    _simulate(self.cfg, self.recipe, ranks[0], self.plan, self.train, self.backend)
                )
        except StepFailed as failure:
            self.failures.append(str(failure))
        self.wall_s += time.perf_counter() - started
        self.cpu_s += time.process_time() - cpu_started
        return self.so_far()

    def so_far(self) -> RunPlan:
        """The plan of the rank classes simulated so far, and the problems they show."""
        problems = list(self.failures)
        if not self.simulations:
            return _failed_plan(self, problems)
        first = self.simulations[0]
        classes = [  # zip: the classes simulated so far, the first ones
            class_plan(ranks, sim.coordinate, sim.measured)
            for ranks, sim in zip(first.classes, self.simulations)
        ]
        per_replica = _samples_per_replica(self.train, first.dp_size, problems)
        problems += _empty_shard_problems(first.measured)
        if self.device_memory_gib is not None:
            problems += _budget_problems(classes, self.device_memory_gib)
        notes = []
        if self.train.precision.value != "fp32":
            notes.append(
                f"train.precision={self.train.precision.value}: the dry run plans activations "
                f"in float32 (autocast does not act on meta tensors), an upper bound"
            )
        return RunPlan(
            recipe=self.recipe.name,
            mesh=str(self.cfg.mesh),
            axes=self.plan.describe(),
            world_size=self.plan.world_size,
            model=first.model_name,
            parameters=sum(p.numel() for p in first.model.parameters()),
            samples_per_replica=per_replica,
            classes=classes,
            layers=layer_plans(first.measured.observer),
            gradient_reduction=_gradient_reduction_plan(first, self.train),
            problems=problems,
            notes=notes,
            simulated_ranks=len(self.simulations),
            wall_s=self.wall_s,
            cpu_s=self.cpu_s,
        )


def start_plan(cfg: DictConfig, device_memory_gib: float | None = None) -> StartedPlan:
    """Begin the dry run of ``cfg`` (``plan_run``'s arguments): simulate its first rank class
    (NOTE [A dry run's first rank bounds the whole plan]).

    Raises
    ------
    ConfigError
        As ``plan_run``.
    """
    started, cpu_started = time.perf_counter(), time.process_time()
    recipe = get_recipe(cfg.recipe)
    if recipe.dry_run_task is None:
        raise ConfigError(f"recipe {recipe.name!r} cannot be dry-run: it registers no dry_run_task")
    try:
        parallel = config_from(ParallelConfig, cfg.parallel)
        plan = ParallelPlan.of(str(cfg.mesh), parallel, recipe.spatial_dims)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"a dry run needs a mesh it can plan: {error}") from error
    train: TrainConfig = OmegaConf.to_object(cfg.train)
    # The target's backend (``Machine.backend``: NCCL on an H100 cluster, gloo on CPUs): the
    # simulated process groups stand in for it (``simulated_rank``), so a halo is counted as
    # the target issues it (messages on NCCL, one all-to-all on gloo), though the simulated
    # mesh is on this process's CPU.
    backend = planned_machine(parallel, 1)[0].backend
    simulations, failures = [], []
    try:
        simulations.append(_simulate(cfg, recipe, 0, plan, train, backend))
    except StepFailed as failure:
        failures.append(str(failure))
    return StartedPlan(
        cfg, recipe, plan, train, backend, device_memory_gib, simulations, failures,
        wall_s=time.perf_counter() - started, cpu_s=time.process_time() - cpu_started,
    )  # fmt: skip


def target_machine(configured: str | None) -> str:
    """The machine a run is planned for: ``parallel.machine`` (``"h100"`` or ``"cpu"``), by
    default ``"h100"`` where CUDA is available, else ``"cpu"``."""
    return configured or ("h100" if torch.cuda.is_available() else "cpu")


def planned_machine(parallel: ParallelConfig, ranks_here: int) -> tuple[Machine, str]:
    """The ``Machine`` a run is planned for and its name: ``parallel.machine``'s preset (an
    H100 cluster, or ``gloo_cpu`` with ``ranks_here`` ranks on this machine) with
    ``parallel.machine_overrides``.

    Raises
    ------
    ConfigError
        One line naming an unknown machine or an override that is not ``name=value`` of a
        ``Machine`` field.
    """
    name = target_machine(parallel.machine)
    if name not in ("h100", "cpu"):
        raise ConfigError(f"parallel.machine={name!r}: expected 'h100', 'cpu' or null")
    machine = Machine() if name == "h100" else gloo_cpu(ranks_here)
    try:
        return override(machine, list(parallel.machine_overrides)), name
    except ValueError as error:
        raise ConfigError(f"parallel.machine_overrides: {error}") from None


def _simulate(
    cfg: DictConfig,
    recipe: Recipe,
    rank: int,
    plan: ParallelPlan,
    train: TrainConfig,
    backend: str,
) -> _Simulation:
    """Simulate ``rank``'s step: its model, parallelised as the trainer does it (its gradient
    reducer is this rank's), and its optimiser, in steady state, on process groups standing
    in for ``backend``'s."""
    with simulated_rank(rank, plan.world_size, backend):
        parallelism = Parallelism.build(plan, device_type="cpu")
        if train.dp_mode is DataParallelMode.fsdp2 and plan.dp_size > 1:
            raise ConfigError(
                f"a dry run cannot plan train.dp_mode=fsdp2 over {plan.dp_size} data-parallel "
                f"replicas: FSDP2 refuses to train parameters on the meta device; plan with "
                f"train.dp_mode=ddp (the same activations and halos; FSDP2 holds 1/"
                f"{plan.dp_size} of the parameters, gradients and optimiser state and adds "
                f"its all-gathers and reduce-scatters over dp)"
            )
        env = LaunchEnv(rank, plan.world_size, rank, plan.world_size, "dry-run", 0, "single")
        context = RunContext(env, parallelism, Path(str(cfg.run_dir)), META)
        with torch.device(META):
            model = instantiate(cfg.model)
            task = recipe.load_dry_run_task()(cfg, context)
        model_name = type(model).__name__
        model = parallelize(model, parallelism, train.dp_mode)
        optimizer = instantiate(cfg.optim)(model.parameters())
        steady_state(model, optimizer)
        step = planned_step(model, optimizer, task, train, parallelism.device)
        with gather_policy(_simulated_policy()):
            measured = measure_step(model, optimizer, task, step, META.type)
        specs = [spec for record in measured.observer.layers.values() for spec in record.specs]
        return _Simulation(
            measured=measured,
            coordinate=list(parallelism.mesh.get_coordinate() or []),
            classes=rank_classes(parallelism.mesh, specs) if rank == 0 else [],
            dp_size=plan.dp_size,
            model_name=model_name,
            model=model,
            optimizer=optimizer,
        )


def _simulated_policy() -> str:
    """The gather policy a simulated step runs under: the run's own when it is ``"error"`` (a
    gather stops the step there, and attention takes the ring as it will), else ``"allow"``:
    the report lists every gather per layer rather than warn about it."""
    return "error" if gather_policy.current() == "error" else "allow"


def planned_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    task: Task,
    train: TrainConfig,
    device: torch.device,
) -> Callable[[], Any]:
    """The step a dry run simulates: the trainer's ``training_step`` of batch 1, with the run's
    precision and clipping (NOTE [One training step]). Autocast acts on no meta tensor; it is
    entered for ``device``, the mesh's device."""
    return lambda: training_step(
        model, optimizer, task, 1, train.precision, train.grad_clip, device
    )


# ---------------------------------------------------------------------------- problems
def _samples_per_replica(train: TrainConfig, dp_size: int, problems: list[str]) -> int:
    if train.global_batch % dp_size == 0:
        return train.global_batch // dp_size
    planned = max(1, train.global_batch // dp_size)
    problems.append(
        f"train.global_batch={train.global_batch} does not split over the {dp_size} "
        f"data-parallel replicas: expected a multiple of {dp_size} (planned with {planned} "
        f"sample{'s' if planned > 1 else ''} per replica)"
    )
    return planned


def _empty_shard_problems(measured: StepMeasurement) -> list[str]:
    """The input, or else the first layer (to finish), whose output leaves ranks without
    cells."""
    for spec in measured.batch_specs:
        for sharding in spec.shardings:
            if 0 in sharding.sizes:
                return [f"the input {_cells_text(spec, sharding)}: too many ranks for the field"]
    offenders = [
        (record, spec, sharding)
        for record in measured.observer.layers.values()
        for spec in record.specs
        for sharding in spec.shardings
        if 0 in sharding.sizes
    ]
    if not offenders:
        return []
    record, spec, sharding = offenders[0]
    later = len({r.name for r, _, _ in offenders}) - 1
    return [
        f"layer {record.name or '(model)'} ({record.kind}) leaves ranks without cells: its "
        f"output {_cells_text(spec, sharding)}" + (f" (and {later} later layers)" if later else "")
    ]


def _cells_text(spec: ShardTensorSpec, sharding: DimSharding) -> str:
    names = spec.mesh.mesh_dim_names
    axes = ", ".join(names[a] if names else str(a) for a in sharding.axes)
    usable = sum(1 for size in sharding.sizes if size)
    return (
        f"{tuple(spec.shape)} has {spec.shape[sharding.dim]} cells in dim {sharding.dim} over "
        f"{len(sharding.sizes)} ranks of mesh axes ({axes}), split "
        f"{describe_sizes(sharding.sizes)}, so {sharding.sizes.count(0)} ranks hold none; "
        f"use at most {usable} ranks there or a larger field"
    )


def _budget_problems(classes: list[RankClassPlan], budget_gib: float) -> list[str]:
    problems = []
    for number, plan in enumerate(classes, start=1):
        if plan.memory.peak > budget_gib * _GIB:
            problems.append(
                f"rank class {number} (rank {plan.representative}, {plan.ranks} ranks) needs "
                f"{plan.memory.peak / _GIB:.2f} GiB at its peak ({plan.memory.peak_at}), over "
                f"the device budget of {budget_gib:g} GiB"
            )
    return problems


# ---------------------------------------------------------------------------- gradients
def _gradient_reduction_plan(first: _Simulation, train: TrainConfig) -> GradientReductionPlan:
    reducer = gradient_reducer(first.model)
    group = reducer.reduction.size if reducer is not None else 1
    return GradientReductionPlan(
        mode=train.dp_mode.value,
        replicas=first.dp_size,
        ranks=group,
        gradient_bytes=sum(
            p.numel() * p.element_size() for p in first.model.parameters() if p.requires_grad
        ),
        buckets=len(reducer.buckets) if reducer is not None else 0,
        bucket_memory=first.measured.grad_buckets,
    )


def _failed_plan(started: StartedPlan, problems: list[str]) -> RunPlan:
    return RunPlan(
        recipe=started.recipe.name,
        mesh=str(started.cfg.mesh),
        axes="",
        world_size=started.plan.world_size,
        model="",
        parameters=0,
        samples_per_replica=0,
        classes=[],
        layers=[],
        gradient_reduction=None,
        problems=problems,
        notes=[],
        wall_s=started.wall_s,
        cpu_s=started.cpu_s,
    )
