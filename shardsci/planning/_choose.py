"""``parallel=auto``: choose how a run's ranks split the work, by planning every choice.

NOTE [How parallel=auto chooses]
Given ``P`` ranks (a one-number ``mesh``, or torchrun's or srun's world), ``decompositions``
lists every way to write ``P = dp x n_1 x ... x n_k``: ``dp`` data-parallel replicas (a
divisor of the global batch) and a domain decomposition splitting ``k`` of the fields'
spatial dims, outermost first (``k = 0``: pure data parallelism; one dim: slabs; two of a 3-D
field: pencils; all of them: blocks), ``n_i`` ranks along dim ``i``, uneven where the cells
do not divide (the library's ``chunk`` sizes); on ranks of several nodes (``P >
gpus_per_node``) each decomposition of dp and a domain is listed twice: dp the mesh's first
axis (a domain group of consecutive ranks, inside a node when it fits) and its last (``slab
H=2 x dp=4``: the replicas inside nodes, the domain axes across them), priced alike over the
ranks each collective connects. Each candidate is dry-run as the run itself
would be (``plan_run``: the model, the trainer's step, every byte, every layer's peak memory
on every rank class; NOTE [A dry run executes the library on one simulated rank at a time]);
a candidate with a problem (a rank over the memory budget, ranks left without cells, a step
that fails) is dropped with that problem as its reason, and one that cannot win is pruned
before all its rank classes are simulated (NOTE [Pruning the search]). The others are ranked
by the projected time of their slowest rank class on ``Machine`` (NOTE [One machine model]):

- compute: the class's kernels (``WorkCounter``: its own shard's) as ``compute_s`` prices them
  (NOTE [One price per op]): the longer of its FLOPs' time (at ``sustained_flops``, its FFTs'
  at ``fft_flops_per_s``, its complex matmuls' at ``complex_matmul_flops_per_s``) and its
  FLOP-counting ops' memory traffic at ``memory_bytes_per_s``, plus the traffic of its ops
  without FLOPs, each family at its rate (NOTE [Kernels without FLOPs by family]), and the
  runs of its strided copies (NOTE [Strided copies]);
- communication: every collective the dry run counted (``count_traffic``), by kind over the
  ranks it connects and the nodes they span (``collective_s``, NOTE [Collectives priced over
  their own ranks]): an all-reduce over one axis of a block over that axis's ranks, the
  gradient all-reduces over the whole mesh; the rounds of messages (halos) as one term;
  an all-to-all's device time over the ranks it connects, its host time over its whole group
  (NOTE [What an all-to-all posts]: a halo sent as one all-to-all);
- host: the class's aten ops as ``ops_host_s`` prices them (NOTE [One price per op]: every op
  of an unsplit step at ``plain_host_us_per_op``, its communication modules' ops at
  ``host_us_per_communication_op``, the ShardTensor step's others at ``plain_host_us_per_op``
  and its ShardTensor calls by dispatch path, NOTE [Host time by dispatch path]), and
  its collectives and halo rounds as
  issuing them costs the host (``collective_host_s``, each over its own ranks);
- step: ``max(host, compute + communication)`` on a GPU, their sum on a CPU.

Ties keep the enumeration's order, data parallelism first. Memory rarely tells the candidates
apart: without gradient accumulation every one holds ``global_batch / P`` samples' worth of
activations per rank (a replica of ``dp`` holds ``global_batch / dp`` samples of ``1 / (P /
dp)`` of the field), so they differ by halos, gathers and buffers only; a field too large for
one device under pure data parallelism is one whose single sample does not fit, and a domain
decomposition fits it only with fewer samples than ranks (``global_batch < P``), which the
error for "nothing fits" says. The printed table
(``format_choice``) gives every candidate's memory, projected parts and why it lost: the part
that costs it most over the winner, or its problem.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from shardsci.distributed import LaunchEnv, init_distributed
from shardsci.planning._dry_run import StartedPlan, planned_machine, start_plan
from shardsci.planning._machine import (
    HALO_KINDS,
    Machine,
    collective_host_s,
    collective_s,
    compute_s,
    halo_s,
    ops_host_s,
    span_nodes,
)
from shardsci.planning._plan import RankClassPlan, RunPlan
from shardsci.training import (
    ConfigError,
    ParallelConfig,
    config_from,
    get_recipe,
    max_local_ranks,
)

__all__ = [
    "Candidate",
    "Choice",
    "Decomposition",
    "Projection",
    "choice_applies",
    "choose",
    "chosen_config",
    "decompositions",
    "format_choice",
    "project",
    "searched_once",
]

_GIB = 2**30


@dataclass(frozen=True)
class Decomposition:
    """``dp`` replicas times a domain decomposition ``splits``: (spatial dim, ranks) pairs,
    outermost dim first, every ranks > 1; the dp axis the mesh's first (each domain group
    consecutive ranks, inside a node when it fits one), or with ``dp_inside_nodes`` its last
    (each replica group consecutive ranks, the domain axes across nodes)."""

    dp: int
    splits: tuple[tuple[str, int], ...]
    dp_inside_nodes: bool = False

    def _dp_first(self, dp: list, domain: list) -> list:
        return domain + dp if self.dp_inside_nodes else dp + domain

    @property
    def world_size(self) -> int:
        return self.dp * math.prod(n for _, n in self.splits)

    @property
    def mesh(self) -> str:
        """The ``mesh`` value: ``"2x2"`` (dp, then one axis per split dim; the other way round
        with ``dp_inside_nodes``)."""
        sizes = self._dp_first([self.dp] if self.dp > 1 else [], [n for _, n in self.splits])
        return "x".join(str(n) for n in sizes) or "1"

    def parallel(self) -> ParallelConfig:
        """The ``parallel`` group that gives the mesh's axes these roles."""
        domain = {f"domain_{dim.lower()}": dim for dim, _ in self.splits}
        names = self._dp_first(["dp"] if self.dp > 1 or not domain else [], list(domain))
        dp = "dp" if "dp" in names else None
        return ParallelConfig(axis_names=names, data_parallel=dp, domain=domain)

    def describe(self, ndim: int) -> str:
        """``dp=2 x slab H=2``, ``block H=2 x W=2``, ``dp=4``; the mesh's axes outermost
        first (``slab H=2 x dp=2``: dp inside nodes)."""
        kind = {0: "", 1: "slab", ndim: "block"}.get(len(self.splits), "pencil")
        domain = " x ".join(f"{dim}={n}" for dim, n in self.splits)
        parts = self._dp_first(
            [f"dp={self.dp}"] if self.dp > 1 or not domain else [],
            [f"{kind} {domain}"] if domain else [],
        )
        return " x ".join(parts)


def decompositions(
    world_size: int, spatial_dims: tuple[str, ...], dp_inside_nodes: bool = False
) -> list[Decomposition]:
    """Every decomposition of ``world_size`` ranks (NOTE [How parallel=auto chooses]), data
    parallelism first, then by fewer split dims, then by more replicas; with
    ``dp_inside_nodes`` (ranks on several nodes), each of dp and a domain also with dp the
    mesh's last axis, after its twin."""
    found = []
    for dp in _divisors(world_size):
        rest = world_size // dp
        for k in range(len(spatial_dims) + 1):
            for dims in itertools.combinations(spatial_dims, k):
                for sizes in _factorizations(rest, k):
                    splits = tuple(zip(dims, sizes))
                    found.append(Decomposition(dp, splits))
                    if dp_inside_nodes and dp > 1 and splits:
                        found.append(Decomposition(dp, splits, dp_inside_nodes=True))
    return sorted(found, key=lambda d: (len(d.splits), -d.dp))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _factorizations(n: int, parts: int) -> list[tuple[int, ...]]:
    """Ordered tuples of ``parts`` factors > 1 whose product is ``n``."""
    if parts == 0:
        return [()] if n == 1 else []
    return [
        (first, *rest)
        for first in _divisors(n)
        if first > 1
        for rest in _factorizations(n // first, parts - 1)
    ]


@dataclass(frozen=True)
class Projection:
    """Seconds of one step of a rank class: ``compute``, ``communication`` (by kind in
    ``collectives``), ``host``, and the ``step`` they make (NOTE [How parallel=auto
    chooses])."""

    compute: float
    communication: float
    host: float
    step: float
    collectives: dict[str, float] = field(hash=False)


def project(plan: RunPlan, machine: Machine) -> Projection:
    """The projected step of ``plan``: that of its slowest rank class."""
    replicas = plan.gradient_reduction.replicas if plan.gradient_reduction else 1
    sharded = plan.world_size > replicas
    return max((_project_class(c, machine, sharded) for c in plan.classes), key=lambda p: p.step)


def _project_class(plan: RankClassPlan, machine: Machine, sharded: bool) -> Projection:
    """Every collective over the ranks it connects and the nodes they span (NOTE
    [Collectives priced over their own ranks]), an all-to-all's host time over its whole
    group (NOTE [What an all-to-all posts]); the rounds of messages as one halo term, over
    every peer, at the slowest link's."""
    collectives: dict[str, float] = defaultdict(float)
    issued = 0.0
    messages = [span for span in plan.spans if span.kind in HALO_KINDS]
    for span in plan.spans:
        if span.kind in HALO_KINDS:
            continue
        ranks, nodes = len(span.ranks), span_nodes(machine, span.ranks)
        collectives[f"{span.kind} over {ranks}"] += collective_s(
            machine, span.kind, ranks, span.calls, span.received, span.calls, nodes
        )
        posted = span.group if span.kind == "all_to_all" else ranks
        issued += collective_host_s(machine, span.kind, posted, span.calls, span.received)
    if messages:
        peers = sorted({rank for span in messages for rank in span.ranks})
        nodes = max(span_nodes(machine, span.ranks) for span in messages)
        received = sum(span.received for span in messages)
        collectives["p2p"] = halo_s(machine, len(peers), plan.p2p_rounds, received, nodes)
        issued += collective_host_s(machine, "p2p", len(peers), plan.p2p_rounds, received)
    compute = compute_s(
        machine,
        flops=plan.flops,
        fft_flops=plan.fft_flops,
        complex_matmul_flops=plan.complex_matmul_flops,
        memory_bytes=plan.memory_bytes,
        flop_free_bytes=plan.flop_free_bytes,
        flop_free_bytes_by_family=plan.flop_free_bytes_by_family,
        strided_runs=plan.strided_runs,
    )
    communication = sum(collectives.values())
    host = ops_host_s(machine, plan.aten_ops, plan.communication_ops, sharded, plan.dispatch_calls)
    host += issued
    device = compute + communication
    step = max(host, device) if machine.host_overlaps_device else host + device
    return Projection(compute, communication, host, step, dict(collectives))


@dataclass
class Candidate:
    """A decomposition, its plan's peak memory per rank, and its projection, or the bound that
    prunes it (its first rank class's projection, NOTE [A dry run's first rank bounds the
    whole plan]; ``peak_bytes`` then that class's), or the problem that drops it."""

    decomposition: Decomposition
    label: str
    peak_bytes: int | None = None
    projection: Projection | None = None
    problem: str | None = None
    bound: Projection | None = None
    classes_left: int = 0


@dataclass
class Choice:
    """Every candidate, the ranked (fastest first) apart from the dropped, for ``world_size``
    ranks under a budget of ``budget_gib`` per device on ``machine``."""

    world_size: int
    budget_gib: float
    budget_source: str
    machine_name: str
    ranked: list[Candidate]
    dropped: list[Candidate]
    pruned: list[Candidate] = field(default_factory=list)

    @property
    def best(self) -> Candidate:
        return self.ranked[0]

    @property
    def listed(self) -> list[Candidate]:
        """The ranked, the pruned, the dropped: the table's rows in order."""
        return [*self.ranked, *self.pruned, *self.dropped]

    def as_dict(self) -> dict[str, Any]:
        """The table of ``format_choice`` for programs: every candidate, fastest first, then
        the pruned (by their bound), then the dropped, each with its verdict (``"chosen"``,
        why it lost, or why it was pruned or dropped); times in seconds."""
        candidates = []
        for candidate, verdict in zip(self.listed, _verdicts(self)):
            p, b = candidate.projection, candidate.bound
            candidates.append({
                "decomposition": candidate.label,
                "mesh": candidate.decomposition.mesh,
                "parallel": asdict(candidate.decomposition.parallel()),
                "peak_bytes": candidate.peak_bytes,
                "projection": None if p is None else asdict(p),
                "bound": None if b is None else asdict(b),
                "verdict": verdict,
            })  # fmt: skip
        return {
            "world_size": self.world_size,
            "budget_gib": self.budget_gib,
            "budget_source": self.budget_source,
            "machine": self.machine_name,
            "candidates": candidates,
        }


def choice_applies(cfg: DictConfig, env: LaunchEnv | None) -> int | None:
    """The ranks to choose a decomposition for, or None when ``cfg`` does not ask for a
    choice: ``parallel.choose`` set and ``mesh`` one number (``-1``: the launcher's world)."""
    if not cfg.parallel.get("choose", False):
        return None
    mesh = str(cfg.mesh)
    launched = env is not None and env.launcher != "single"
    if mesh == "-1" and launched:
        world = env.world_size
    elif mesh.isdigit():
        world = int(mesh)
    else:
        return None
    return world if world > 1 else None


def choose(
    cfg: DictConfig, world_size: int, ranks_here: int | None = None, prune: bool = True
) -> Choice:
    """Plan every decomposition of ``world_size`` ranks for ``cfg`` and rank them (NOTE [How
    parallel=auto chooses]), a line of progress on stderr at most every
    ``PROGRESS_EVERY_S`` seconds.

    Parameters
    ----------
    ranks_here : int or None
        Ranks that will share this host (a CPU machine's memory and cores); None: all.
    prune : bool
        Prune candidates that cannot fit or cannot win before simulating all their rank
        classes (NOTE [Pruning the search]); False: plan every candidate in full.

    Raises
    ------
    ConfigError
        If no candidate fits (naming the closest and why), or the machine settings are bad.
    """
    parallel = config_from(ParallelConfig, cfg.parallel)
    machine, machine_name = planned_machine(parallel, ranks_here or world_size)
    budget, source = _budget(parallel, cfg, machine, machine_name)
    recipe = get_recipe(cfg.recipe)
    batch = int(cfg.train.global_batch)
    several_nodes = world_size > machine.gpus_per_node
    candidates = [
        Candidate(decomposition, decomposition.describe(len(recipe.spatial_dims)))
        for decomposition in decompositions(world_size, tuple(recipe.spatial_dims), several_nodes)
    ]
    progress = _Progress(candidates)
    state_bytes = None  # every rank's parameters and optimiser state, in every decomposition
    started = []
    for candidate in candidates:
        dp = candidate.decomposition.dp
        if batch % dp:
            candidate.problem = f"train.global_batch={batch} does not split over {dp} replicas"
        elif prune and state_bytes is not None and state_bytes > budget * _GIB:
            candidate.problem = (
                f"its parameters and optimiser state alone, {state_bytes / _GIB:.3g} GiB on "
                f"every rank of every decomposition, are over the budget"
            )
        else:
            try:
                plan = start_plan(chosen_config(cfg, candidate.decomposition), budget)
            except ConfigError as error:
                candidate.problem = str(error)
            else:
                candidate.classes_left = plan.classes_left
                _judge(candidate, plan.so_far(), machine)
                if candidate.bound is not None:
                    started.append((candidate, plan))
                first = plan.so_far().classes
                if state_bytes is None and first:
                    state_bytes = first[0].memory.parameters + first[0].memory.optimizer
        progress.show()
    _finish_best_first(started, machine, prune, progress)
    progress.show(last=True)
    ranked = sorted(
        (c for c in candidates if c.projection is not None), key=lambda c: c.projection.step
    )
    pruned = sorted(
        (c for c in candidates if c.projection is None and c.problem is None),
        key=lambda c: c.bound.step,
    )
    dropped = [c for c in candidates if c.problem is not None]
    choice = Choice(world_size, budget, source, machine_name, ranked, dropped, pruned)
    if not ranked:
        raise ConfigError(_nothing_fits(choice, batch))
    return choice


# NOTE [Pruning the search]
# At 512 ranks ``parallel=auto`` has some 180 candidates and a candidate up to 25 rank classes
# of 0.5-5 s of CPU each. The search is branch and bound, and gives the full search's choice:
# - before simulating, a candidate is dropped when every rank's parameters and optimiser state
#   (the same in every decomposition, measured on the first candidate simulated) are over the
#   budget: its peak holds them all step long;
# - then each candidate's first rank class is simulated (NOTE [A dry run's first rank bounds
#   the whole plan]): its problems are the whole plan's, its peak and projected step are lower
#   bounds of the plan's; a candidate with a problem is dropped;
# - the rest are planned in full in the order of their bounds (ties in enumeration order), and
#   one whose bound is above the best step planned in full so far (or equal to it, after it in
#   the enumeration) is pruned: its step cannot be below the bound, so it cannot win.
# A pruned candidate would have ranked below the choice in the full search, or been dropped by
# a problem of a class not simulated (a later class over the budget); its row shows its bound.
# A bound from the shard sizes alone, before simulating, would not prune here: every
# decomposition does the same work per rank (``global_batch / P`` samples' worth, NOTE [How
# parallel=auto chooses]) and the same gradient all-reduce over all ``P`` ranks, so such a
# bound is nearly equal for every candidate and below the best step; the candidates differ by
# their halos, transposes and dispatch, which the first rank's simulation measures.
def _judge(candidate: Candidate, plan: RunPlan, machine: Machine) -> None:
    """Record ``plan``'s peak memory and its problem, or its projection: ``candidate``'s
    bound, and its projection when every rank class is simulated."""
    if plan.classes:
        candidate.peak_bytes = max(c.memory.peak for c in plan.classes)
    if plan.problems:
        candidate.problem, candidate.bound, candidate.projection = plan.problems[0], None, None
        return
    candidate.bound = project(plan, machine)
    if not candidate.classes_left:
        candidate.projection = candidate.bound


def _finish_best_first(
    started: list[tuple[Candidate, StartedPlan]],
    machine: Machine,
    prune: bool,
    progress: _Progress,
) -> None:
    """Plan the started candidates in full, best bound first, pruning those that cannot win
    (NOTE [Pruning the search])."""
    order = {id(candidate): number for number, (candidate, _) in enumerate(started)}
    best: tuple[float, int] | None = None
    for candidate, plan in sorted(started, key=lambda item: item[0].bound.step):
        key = (candidate.bound.step, order[id(candidate)])
        if candidate.classes_left:
            if prune and best is not None and key > best:
                progress.pruned += 1
                continue
            candidate.classes_left = 0
            _judge(candidate, plan.finished(), machine)
        if candidate.projection is not None:
            mine = (candidate.projection.step, order[id(candidate)])
            best = mine if best is None else min(best, mine)
        progress.show()


PROGRESS_EVERY_S = 5.0
"""Seconds between two of the search's progress lines."""


class _Progress:
    """The search's progress, one line on stderr at most every ``PROGRESS_EVERY_S`` seconds:
    the candidates whose first rank class is simulated, planned in full, dropped, pruned and
    left, and the time spent."""

    def __init__(self, candidates: list[Candidate]) -> None:
        self.candidates = candidates
        self.started = time.perf_counter()
        self.cpu_started = time.process_time()
        self.shown = self.started
        self.pruned = 0

    def show(self, last: bool = False) -> None:
        now = time.perf_counter()
        if not last and now - self.shown < PROGRESS_EVERY_S:
            return
        self.shown = now
        cs = self.candidates
        planned = sum(c.projection is not None for c in cs)
        dropped = sum(c.problem is not None for c in cs)
        bounded = sum(c.bound is not None for c in cs)
        pruned = self.pruned
        print(
            f"parallel=auto: {len(cs)} candidates: {bounded + dropped} with a first rank "
            f"simulated or dropped, {planned} planned in full, {dropped} dropped, {pruned} "
            f"pruned, {len(cs) - planned - dropped - pruned} left; {now - self.started:.0f} s "
            f"({time.process_time() - self.cpu_started:.0f} s CPU)",
            file=sys.stderr,
            flush=True,
        )


def choose_for_launch(cfg: DictConfig, env: LaunchEnv) -> DictConfig:
    """``cfg`` as it will run: with the chosen decomposition when it asks for a choice
    (``choice_applies``), one line saying which (on rank 0); else ``cfg`` itself. Runs before
    any rank starts, in every process that checks the config (NOTE [A run is planned once]);
    under torchrun or srun only rank 0 searches and every rank takes its choice (NOTE [One
    rank searches for a launched job]). A local mesh larger than this machine allows is left
    to ``check_run``'s error.

    Raises
    ------
    ConfigError
        If no decomposition can run (``choose``), on every rank.
    """
    world_size = choice_applies(cfg, env)
    launched = env.launcher != "single"
    if world_size is None or (not launched and world_size > max_local_ranks()[0]):
        return cfg
    ranks_here = env.local_world_size if launched else world_size
    if launched:
        best = searched_once(
            lambda: _best(cfg, world_size, ranks_here), env, cfg.launcher.timeout_s
        )
    else:
        best = _best(cfg, world_size, ranks_here)
    return chosen_config(cfg, best)


# NOTE [One rank searches for a launched job]
# Under torchrun or srun every rank runs the command, and every rank would make the same
# choice (it depends on the config and the world only), each paying the search: dozens of dry
# runs, 30 s of CPU for the cfd recipe on 8 ranks. Instead rank 0 searches while the other
# ranks wait to join the run's process group, which they would join next anyway (the
# trainer's ``init_distributed`` finds it and keeps it); rank 0 joins once it has chosen and
# sends the choice, or its one-line refusal, to all (one small object broadcast). The search
# runs before the group exists because a dry run simulates its ranks in a process without one
# (``simulated_rank``), and it must end within the group's rendezvous timeout
# (``launcher.timeout_s``).
def searched_once(
    search: Callable[[], Decomposition], env: LaunchEnv, timeout_s: float
) -> Decomposition:
    """``search()`` run on rank 0 only, its result (or its ``ConfigError``) on every rank of
    the launched job ``env`` (NOTE [One rank searches for a launched job])."""
    outcome: Decomposition | str | None = None
    if env.rank == 0:
        try:
            outcome = search()
        except ConfigError as error:
            outcome = str(error)
    if not dist.is_initialized():
        init_distributed(timeout_s=timeout_s)
    box = [outcome]
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise ConfigError(box[0])
    return box[0]


def _best(cfg: DictConfig, world_size: int, ranks_here: int) -> Decomposition:
    """The fastest decomposition, said in one line."""
    choice = choose(cfg, world_size, ranks_here)
    best = choice.best
    print(
        f"parallel=auto chose {best.label} (mesh={best.decomposition.mesh}), projected "
        f"{_ms(best.projection.step)} ms per step on {choice.machine_name}, the fastest of "
        f"{len(choice.ranked)} that fit {choice.budget_gib:.3g} GiB per device "
        f"({len(choice.dropped)} dropped); dry_run=true prints them all",
        flush=True,
    )
    return best.decomposition


def chosen_config(cfg: DictConfig, decomposition: Decomposition) -> DictConfig:
    """``cfg`` with the mesh and axis roles of ``decomposition`` (and no further choice)."""
    chosen = cfg.copy()
    parallel = decomposition.parallel()
    OmegaConf.update(chosen, "mesh", decomposition.mesh)
    OmegaConf.update(chosen, "parallel.axis_names", parallel.axis_names)
    OmegaConf.update(chosen, "parallel.data_parallel", parallel.data_parallel)
    OmegaConf.update(chosen, "parallel.domain", parallel.domain, merge=False)
    OmegaConf.update(chosen, "parallel.choose", False)
    return chosen


def _budget(
    parallel: ParallelConfig, cfg: DictConfig, machine: Machine, machine_name: str
) -> tuple[float, str]:
    if parallel.memory_gib is not None:
        if not parallel.memory_gib > 0:
            raise ConfigError(
                f"parallel.memory_gib={parallel.memory_gib}: expected a positive number of GiB"
            )
        return parallel.memory_gib, "parallel.memory_gib"
    if cfg.get("device_memory_gib") is not None:
        return float(cfg.device_memory_gib), "device_memory_gib"
    if machine_name == "cpu":
        return machine.memory_gib, "this host's memory over the ranks it runs"
    return machine.memory_gib, "an H100's memory"


def _nothing_fits(choice: Choice, batch: int) -> str:
    sized = [c for c in choice.dropped if c.peak_bytes is not None]
    closest = min(sized, key=lambda c: c.peak_bytes) if sized else choice.dropped[0]
    hint = "a larger budget (parallel.memory_gib), more ranks or a smaller model"
    if batch >= choice.world_size:
        # NOTE [How parallel=auto chooses]: without gradient accumulation every decomposition
        # holds global_batch / ranks samples' worth of activations per rank.
        hint = (
            f"every decomposition holds train.global_batch / ranks = {batch / choice.world_size:g}"
            f" sample(s) of activations per rank: a train.global_batch below {choice.world_size}"
            f" lets a domain decomposition split a sample, or {hint}"
        )
    return (
        f"parallel=auto: none of the {len(choice.dropped)} decompositions of "
        f"{choice.world_size} ranks fits {choice.budget_gib:.3g} GiB per device "
        f"({choice.budget_source}); the closest, {closest.label} (mesh="
        f"{closest.decomposition.mesh}): {closest.problem}; expected {hint}"
    )


# ---------------------------------------------------------------------------- the table
def format_choice(choice: Choice) -> str:
    """The ranked candidates as a table: memory, projected parts, why each loser lost; a
    pruned candidate's figures are its bound's (``>=``, NOTE [Pruning the search])."""
    lines = [
        f"parallel=auto: {len(choice.listed)} decompositions of {choice.world_size} ranks, "
        f"projected on {choice.machine_name}; budget {choice.budget_gib:.3g} GiB per device "
        f"({choice.budget_source})",
        "",
    ]
    header = ("#", "decomposition", "mesh", "peak GiB", "compute ms", "comm ms", "host ms",
              "step ms", "why not chosen")  # fmt: skip
    rows = [header]
    verdicts = _verdicts(choice)
    for number, (candidate, verdict) in enumerate(zip(choice.listed, verdicts), start=1):
        p = candidate.projection or candidate.bound
        at_least = ">=" if candidate.projection is None else ""
        times = ("", "", "", "") if p is None else (
            f"{at_least}{_ms(p.compute)}", f"{at_least}{_ms(p.communication)}",
            f"{at_least}{_ms(p.host)}", f"{at_least}{_ms(p.step)}",
        )  # fmt: skip
        peak = _gib(candidate.peak_bytes)
        rows.append((
            str(number) if number <= len(choice.ranked) else "-", candidate.label,
            candidate.decomposition.mesh, f"{at_least}{peak}" if peak else "", *times, verdict,
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths)]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    return "\n".join(lines)


def _verdicts(choice: Choice) -> list[str]:
    """Why each of ``choice.listed`` was or was not chosen."""
    best = choice.best.projection
    return (
        [
            "chosen" if number == 0 else _why_slower(candidate.projection, best)
            for number, candidate in enumerate(choice.ranked)
        ]
        + [
            f"pruned: its first rank class alone projects {_ms(c.bound.step)} ms, no faster "
            f"than the chosen's {_ms(best.step)} ms ({c.classes_left} rank classes not "
            f"simulated)"
            for c in choice.pruned
        ]
        + [f"dropped: {candidate.problem}" for candidate in choice.dropped]
    )


def _why_slower(p: Projection, best: Projection) -> str:
    """The part that costs ``p`` most over ``best``, and by how much."""
    parts = {"compute": (p.compute, best.compute), "host": (p.host, best.host)}
    for kind in set(p.collectives) | set(best.collectives):
        parts[kind] = (p.collectives.get(kind, 0.0), best.collectives.get(kind, 0.0))
    name, (mine, theirs) = max(parts.items(), key=lambda item: item[1][0] - item[1][1])
    return (
        f"{_ms(p.step - best.step)} ms slower: {name} {_ms(mine)} ms against {_ms(theirs)}"
        f" ms (x{p.step / best.step:.2f})"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}" if seconds >= 1e-3 else f"{seconds * 1e3:.2g}"


def _gib(nbytes: int | None) -> str:
    return "" if nbytes is None else f"{nbytes / _GIB:.3f}"
