"""The result of a dry run: per rank class, per layer, per step; plain data, JSON-ready."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from shardsci.planning._measure import StepMeasurement
from shardsci.planning._memory import Category
from shardsci.planning._observe import (
    OUTSIDE,
    GatherEvent,
    LayerRecord,
    StepObserver,
    _layout_text,
    describe_sizes,
)

__all__ = [
    "CollectiveFigures",
    "GradientReductionPlan",
    "LayerPlan",
    "MemoryPlan",
    "RankClassPlan",
    "RunPlan",
    "SpanFigures",
    "class_plan",
    "layer_plans",
]


@dataclass
class CollectiveFigures:
    """Collectives of one kind on one rank: calls and bytes (NOTE [What a byte count means]);
    ``message_batches`` of the calls were batches of point-to-point messages (a halo
    exchange on a backend where it does not go as one all-to-all)."""

    calls: int = 0
    sent: int = 0
    received: int = 0
    message_batches: int = 0


@dataclass
class SpanFigures:
    """Collectives of one kind over the same ranks on one rank, as issued (``count_traffic``,
    NOTE [The span of a collective]): what ``parallel=auto`` prices, each over its own ranks
    and the nodes they span.

    Attributes
    ----------
    kind : str
        The kind torch issued (an uneven all-gather is an all-to-all; ``"p2p"``: messages).
    ranks : list of int
        The global ranks they connect this rank with, itself included.
    calls : int
        Collectives (messages, for ``"p2p"``).
    received : int
        Bytes this rank received through them (NOTE [What a byte count means]).
    group : int
        Ranks of the process group they were issued over: what an all-to-all's host time
        grows with (NOTE [What an all-to-all posts]).
    """

    kind: str
    ranks: list[int]
    calls: int
    received: int
    group: int


@dataclass
class MemoryPlan:
    """Bytes of one rank (NOTE [What the memory figures count]).

    ``peak`` is the largest total of live tensor memory during a steady-state step (the
    previous step's gradients and the optimiser state included); ``peak_activations`` the
    largest memory of everything the step itself creates but the gradients and the batch.
    """

    parameters: int
    gradients: int
    optimizer: int
    grad_buckets: int
    batch: int
    peak_activations: int
    peak: int
    peak_at: str


@dataclass
class RankClassPlan:
    """Ranks that do the same work, and what one of them does in a step.

    Attributes
    ----------
    ranks : int
        Number of ranks in the class.
    representative : int
        The simulated rank (the class's lowest).
    members : list of int
        Every rank of the class, ascending.
    coordinate : list of int
        The representative's mesh coordinate.
    memory : MemoryPlan
    collectives : dict
        Kind -> figures, for every collective shardsci issues in the step (``comm_counter``:
        the library's names, ``"halo"`` and ``"grad_all_reduce"`` among them).
    local_shapes : dict
        Layer -> this class's shard of the layer's output.
    flops, aten_ops, fft_flops, communication_ops : int
        FLOPs, aten ops, FFT FLOPs, and the aten ops a communication module dispatched, of
        the representative's step (``WorkCounter``): what projects its compute and host time
        (``parallel=auto``, NOTE [One price per op]).
    strided_runs : int
        Runs of the strided tensors its copies read and write (NOTE [Strided copies]).
    complex_matmul_flops : int
        FLOPs of its complex matmuls (NOTE [Complex matmuls are counted apart]), not in
        ``flops``.
    memory_bytes, flop_free_bytes : int
        Bytes its non-view ops read and write, and those of them of ops without FLOPs (NOTE
        [Kernels without FLOPs]).
    flop_free_bytes_by_family : dict or None
        ``flop_free_bytes`` by family (NOTE [Kernels without FLOPs by family]); ``None`` where
        not counted.
    dispatch_calls : dict or None
        Its ShardTensor calls by dispatch path (NOTE [Host time by dispatch path]); ``None``
        where not counted.
    spans : list of SpanFigures
        The same step's collectives and messages as issued, by kind and the ranks they
        connect (``count_traffic``); ``p2p_rounds``: its rounds of messages posted together.
    """

    ranks: int
    representative: int
    members: list[int]
    coordinate: list[int]
    memory: MemoryPlan
    collectives: dict[str, CollectiveFigures]
    local_shapes: dict[str, list[int] | None]
    flops: int = 0
    aten_ops: int = 0
    fft_flops: int = 0
    communication_ops: int = 0
    spans: list[SpanFigures] = field(default_factory=list)
    p2p_rounds: int = 0
    strided_runs: int = 0
    complex_matmul_flops: int = 0
    memory_bytes: int = 0
    flop_free_bytes: int = 0
    flop_free_bytes_by_family: dict[str, int] | None = None
    dispatch_calls: dict[str, int] | None = None


@dataclass
class LayerPlan:
    """One module: its output layout and the communication it causes.

    ``forward``/``backward`` map a collective kind to ``[calls, bytes sent]`` of the
    representative of the first rank class; ``redistributions`` lists the layer's layout
    changes, equal ones counted together: ``"backward: source -> target x2, 1.5 KiB sent"``;
    ``gathers`` those of them (and attention's gathers of keys and values) that an op made
    without being asked (NOTE [Gathers an op was not asked to make]), equal ones counted
    together: ``"forward: aten.sort.default gathered float32 (8, 64, 512, 512) [domain:
    S(2)] -> [domain: R] x1, 536870912 B per rank"`` (bytes the most loaded rank holds after).
    """

    name: str
    kind: str
    shape: list[int] | None
    placements: str
    sizes: dict[str, str]
    forward: dict[str, list[int]] = field(default_factory=dict)
    backward: dict[str, list[int]] = field(default_factory=dict)
    redistributions: list[str] = field(default_factory=list)
    gathers: list[str] = field(default_factory=list)


@dataclass
class GradientReductionPlan:
    """How parameter gradients are reduced (NOTE [Why shardsci reduces gradients itself
    instead of DDP]): summed over the domain ranks and averaged over the ``replicas``, in
    ``buckets`` all-reduces per step over the ``ranks`` of the combined group, launched during
    backward; their calls and bytes are every rank class's ``grad_all_reduce`` collectives.
    The buckets hold one more copy of the gradients for the whole run (``bucket_memory``, in
    every class's peak). With ``mode="fsdp2"`` FSDP2 reduce-scatters over dp itself (torch's
    collectives, not in the counts) and there are no buckets."""

    mode: str
    replicas: int
    ranks: int
    gradient_bytes: int
    buckets: int
    bucket_memory: int


@dataclass
class RunPlan:
    """Everything a dry run found, JSON-ready (``as_dict``)."""

    recipe: str
    mesh: str
    axes: str
    world_size: int
    model: str
    parameters: int
    samples_per_replica: int
    classes: list[RankClassPlan]
    layers: list[LayerPlan]
    gradient_reduction: GradientReductionPlan | None
    problems: list[str]
    notes: list[str]
    simulated_ranks: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def class_plan(ranks: list[int], coordinate: list[int], measured: StepMeasurement) -> RankClassPlan:
    """The plan of a rank class from the watched step of its representative."""
    memory, traffic = measured.memory, measured.traffic
    layer, phase = memory.peak_where or ("", "")
    collectives: dict[str, CollectiveFigures] = {}
    for kind, calls in measured.comm.calls.items():
        collectives[kind] = CollectiveFigures(
            calls,
            measured.comm.sent[kind],
            measured.comm.received[kind],
            measured.comm.message_batches[kind],
        )
    return RankClassPlan(
        ranks=len(ranks),
        representative=ranks[0],
        members=ranks,
        coordinate=coordinate,
        memory=MemoryPlan(
            parameters=measured.parameters,
            gradients=measured.gradients,
            optimizer=measured.optimizer,
            grad_buckets=measured.grad_buckets,
            batch=memory.peak_live[Category.batch],
            peak_activations=memory.peak_activations,
            peak=memory.peak,
            peak_at=f"{phase} of {layer or '(the model)'}",
        ),
        collectives=dict(sorted(collectives.items())),
        local_shapes={
            name: list(record.local_shape) if record.local_shape is not None else None
            for name, record in measured.observer.layers.items()
        },
        flops=measured.flops,
        aten_ops=measured.aten_ops,
        communication_ops=measured.communication_ops,
        fft_flops=measured.fft_flops,
        complex_matmul_flops=measured.complex_matmul_flops,
        spans=[
            SpanFigures(
                span.kind, list(span.ranks), calls, traffic.received_by_span[span], span.group
            )
            for span, calls in sorted(traffic.calls_by_span.items())
        ],
        p2p_rounds=traffic.p2p_rounds,
        strided_runs=measured.strided_runs,
        memory_bytes=measured.memory_bytes,
        flop_free_bytes=measured.flop_free_bytes,
        flop_free_bytes_by_family=dict(measured.flop_free_bytes_by_family),
        dispatch_calls=dict(measured.dispatch_calls),
    )


def layer_plans(observer: StepObserver) -> list[LayerPlan]:
    """Per layer, in the order of the forward pass."""
    traffic: dict[tuple[str, str], dict[str, list[int]]] = defaultdict(dict)
    for event in observer.events:
        figures = traffic[(event.layer, event.phase)].setdefault(event.kind, [0, 0])
        figures[0] += 1
        figures[1] += event.sent
    grouped: dict[tuple[str, str, str, str], list[int]] = defaultdict(lambda: [0, 0])
    for move in observer.redistributions:
        figures = grouped[(move.layer, move.phase, move.source, move.target)]
        figures[0] += 1
        figures[1] += move.sent
    moves: dict[str, list[str]] = defaultdict(list)
    for (layer, phase, source, target), (count, sent) in grouped.items():
        moves[layer].append(f"{phase}: {source} -> {target} x{count}, {sent} B sent")
    gathers = _gathers_by_layer(observer.gathers)
    records = sorted(observer.layers.values(), key=lambda r: observer.order[r.name])
    if any(layer == OUTSIDE for layer, _ in traffic) or OUTSIDE in moves or OUTSIDE in gathers:
        records.append(LayerRecord(OUTSIDE, "loss, optimiser"))
    return [_layer_plan(record, traffic, moves, gathers) for record in records]


def _gathers_by_layer(events: list[GatherEvent]) -> dict[str, list[str]]:
    counted: dict[tuple[str, str], int] = defaultdict(int)
    for event in events:
        g = event.gather
        op = g.op if g.within is None else f"{g.op} (inside {g.within})"
        what = "" if g.what == "a tensor" else f"{g.what}, keys "
        counted[
            (
                event.layer,
                f"{event.phase}: {op} gathered {what}{str(g.source.dtype).removeprefix('torch.')} "
                f"{tuple(g.source.shape)} {_layout_text(g.source)} -> {_layout_text(g.target)}",
                g.bytes_per_rank,
            )
        ] += 1
    found: dict[str, list[str]] = defaultdict(list)
    for (layer, text, per_rank), count in counted.items():
        found[layer].append(f"{text} x{count}, {per_rank} B per rank")
    return found


def _layer_plan(
    record: LayerRecord,
    traffic: dict[tuple[str, str], dict[str, list[int]]],
    moves: dict[str, list[str]],
    gathers: dict[str, list[str]],
) -> LayerPlan:
    return LayerPlan(
        name=record.name or "(model)",
        kind=record.kind,
        shape=list(record.shape) if record.shape is not None else None,
        placements=record.placements,
        sizes={str(dim): describe_sizes(sizes) for dim, sizes in record.sizes.items()},
        forward=traffic.get((record.name, "forward"), {}),
        backward=traffic.get((record.name, "backward"), {}),
        redistributions=moves.get(record.name, []),
        gathers=gathers.get(record.name, []),
    )
