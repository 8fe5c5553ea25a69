"""The machine a step is projected on: one dataclass of parameters with their sources, and the
time of each collective on it.

NOTE [One machine model]
``Machine`` and the collective costs below are the one description of a cluster that shardsci
projects on: ``parallel=auto`` ranks decompositions with them (``_choose``), and the scaling
projections of ``benchmarks/cost_model.py`` and ``benchmarks/scaling_model.py`` import them
from here (library code never imports ``benchmarks/``). ``Machine()`` is an H100 SXM cluster;
``gloo_cpu(ranks)`` this kind of machine (ranks sharing a few CPU cores, gloo over loopback).
Change a parameter here and every projection moves with it.

NOTE [One price per op]
A step is priced the same way wherever it is projected (the dry run's ``parallel=auto`` and
``benchmarks/cost_model.py`` alike): its kernels by ``compute_s`` (FLOPs and memory traffic,
NOTE [Kernels without FLOPs] in ``_work``), its host time by ``ops_host_s``: a step on plain
tensors (nothing split: data parallelism) pays ``plain_host_us_per_op`` per aten op; a
ShardTensor step's aten ops pay the same, and its ShardTensor calls what each adds by its
dispatch path (NOTE [Host time by dispatch path]); where a step's calls were not counted by
path (a measurement saved before they were), its aten ops pay ``host_us_per_op`` (its average
over a whole UNet step: the handlers' Python included). Either way except for the ops a
communication module dispatches (``_work.COMMUNICATION_MODULES``: slicing,
packing and unpacking each peer's piece, halos), which are plain ops on local pieces with the
modules' own Python around them and pay ``host_us_per_communication_op`` (``benchmarks.calibrate``
fits it from halo exchanges on 2 and 4 ranks). These grow with the peers of a collective (NOTE
[Ops per peer] in ``benchmarks/cost_model.py``: the FNO's 250 more per added peer).

NOTE [Host time by dispatch path]
What a ShardTensor call adds to the host's time over the same call on plain tensors depends
on the way it takes (``benchmarks.calibrate_dispatch``: on this machine fast 21, propagation
38, handler 55 µs an aten op, a function handler's call 88): an aten op on ShardTensors takes
the ``fast``, ``propagation`` or ``handler`` path (NOTE [Dispatch paths] in
``shardsci.tensor._dispatch``), and a torch function with a function handler (``function``)
runs that handler's Python. ``WorkCounter`` counts a step's calls by path (``dispatch_calls``);
``ops_host_s`` charges each path's calls ``host_us_per_<path>`` times
``host_calls_in_step_factor``, on top of every aten op at ``plain_host_us_per_op``. The
factor is measured, not assumed: the per-path figures come from calls timed in a loop, and
in a step the same calls cost more (2.3-2.7x on the UNet's step here, 3.5x on the H200
host's), so it is the UNet's 1-rank
step's CPU time less its aten ops at the plain rate of the same run, over its calls at the
run's per-path figures (``benchmarks.calibrate_dispatch``'s ``in_step_factor``). The UNet's
host term is then its measurement; the other models' are the check
(``benchmarks.calibrate_dispatch --worlds 1 2``: ``host_ratio_by_path`` beside
``host_ratio_flat``).
Why a call costs more in a step, tested (2026-11-30, load 50-118,
``benchmarks/records/2026-11-30-predicted-vs-measured``, ``in_step_cache.py``): with 16 MiB
(4x this core's L2) written between calls, what a ShardTensor call adds over the plain call
rose 3.2-5.0x over back to back (median 3.7, eight ops of every path), read only 2.1-5.2x; with
1 MiB (within L2) 1.05-1.7x. A step's working set evicting the dispatch path's code and data
from the caches is a cause of the factor's size; the attribution of autograd's time to calls
was not tested.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

__all__ = [
    "DISPATCH_PATHS",
    "DISPATCH_PRICES",
    "HALO_KINDS",
    "Machine",
    "all_gather_s",
    "all_reduce_s",
    "all_to_all_s",
    "collective_host_s",
    "collective_s",
    "compute_s",
    "dispatch_prices",
    "flop_free_rate",
    "flop_free_s",
    "gloo_cpu",
    "halo_s",
    "ops_host_s",
    "override",
    "path_us",
    "ring_steps",
    "span_nodes",
    "strided_copy_s",
]


DISPATCH_PATHS = ("fast", "propagation", "handler", "function")
"""The ways a ShardTensor call takes, each priced apart (NOTE [Host time by dispatch path]):
an aten op's three dispatch paths, and a function handler's call."""


HALO_KINDS = ("p2p", "halo")
"""Kinds of traffic that are rounds of point-to-point messages, not collectives."""


GLOO_HOST_US_PER_OP = 18.5
"""Measured here (``benchmarks.calibrate``'s ``host_us_per_op``, a ShardTensor UNet step at a
16² tile on 1 rank, CPU time over its aten ops; three runs on 2026-11-29, 18.5 / 23.3 / 18.1 µs
at 21:51-21:54 / 21:56-22:00 / 22:00-22:03 UTC, load 1.4-20.9 / 12.2-14.2 / 14.2-16.2): the
median (``benchmarks/records/2026-11-29-host-per-op``). The runs of 18:45 and 18:50 that day
read 16.2 and 26.9, and 15:58 read 15.8. It was 53 until then, from an older measurement."""


GLOO_PLAIN_HOST_US_PER_OP = 8.7
"""Measured here with ``GLOO_HOST_US_PER_OP`` (the same runs, the plain step beside it): 8.3 /
10.7 / 8.7 µs an aten op, the median (``benchmarks/records/2026-11-29-host-per-op``). 7.4 and
12.2 at 18:45 and 18:50 UTC; 25 until then."""


GLOO_HOST_US_PER_COMMUNICATION_OP = 23.85
"""Measured here (``benchmarks.calibrate``'s ``host_us_per_communication_op``: a periodic halo
exchange's forward and backward of a ``(1, 16, 32, 32)`` shard on 2 ranks and on 2x2, its CPU
time between computations less its all-to-alls' as the same run's collective fit prices them,
over its 43 and 91 ops, all dispatched by communication modules, five alternated rounds, the
median over the two meshes; runs 2 and 3 of ``GLOO_HOST_US_PER_OP``): 26.3 and 21.4 µs, the
median (``benchmarks/records/2026-11-29-host-per-op``); 2 ranks read 19.2 and 20.8, 2x2 33.3
and 22.1. A profile of the 4-rank UNet's step (2026-11-29 18:58 UTC) put about 20 µs on each of
its communication ops, which were charged the plain 7.4 until then."""


GLOO_HOST_US_PER_FAST_OP = 21.0
"""Measured here (NOTE [Host time by dispatch path]): what an aten op on the ``fast`` path adds
over the plain op, three runs: 18.4 / 37.7 / 21.0 µs, the median
(benchmarks/records/2026-11-29-host-by-path)."""


GLOO_HOST_US_PER_PROPAGATION_OP = 38.3
"""Measured here as ``GLOO_HOST_US_PER_FAST_OP``, the ``propagation`` path: 38.3 / 42.4 / 31.0
µs, the median (benchmarks/records/2026-11-29-host-by-path)."""


GLOO_HOST_US_PER_HANDLER_OP = 55.1
"""Measured here as ``GLOO_HOST_US_PER_FAST_OP``, the ``handler`` path: 55.1 / 67.5 / 50.5 µs,
the median (benchmarks/records/2026-11-29-host-by-path)."""


GLOO_HOST_US_PER_FUNCTION_CALL = 88.0
"""Measured here as ``GLOO_HOST_US_PER_FAST_OP``, a function handler's call: 88.0 / 106.8 /
76.8 µs, the median (benchmarks/records/2026-11-29-host-by-path)."""


GLOO_HOST_CALLS_IN_STEP_FACTOR = 2.41
"""Measured here (NOTE [Host time by dispatch path], ``in_step_factor`` of the same three
runs): 2.27 / 2.67 / 2.41, the median (benchmarks/records/2026-11-29-host-by-path)."""


H200_HOST_US_PER_FAST_OP = 15.8
"""Measured on the H200 machine's host CPU (16 cores of an Intel Xeon, one rank, load 1.5,
2026-11-29 22:26-22:33 UTC): ``benchmarks.calibrate_dispatch --repeats 5 --steps 5``, one
run: 15.8 µs (benchmarks/records/2026-11-29-gpu-h200/after)."""


H200_HOST_US_PER_PROPAGATION_OP = 41.5
"""As ``H200_HOST_US_PER_FAST_OP``, the ``propagation`` path: 41.5 µs
(benchmarks/records/2026-11-29-gpu-h200/after)."""


H200_HOST_US_PER_HANDLER_OP = 51.0
"""As ``H200_HOST_US_PER_FAST_OP``, the ``handler`` path: 51.0 µs
(benchmarks/records/2026-11-29-gpu-h200/after)."""


H200_HOST_US_PER_FUNCTION_CALL = 72.8
"""As ``H200_HOST_US_PER_FAST_OP``, a function handler's call: 72.8 µs
(benchmarks/records/2026-11-29-gpu-h200/after)."""


H200_HOST_CALLS_IN_STEP_FACTOR = 3.51
"""As ``H200_HOST_US_PER_FAST_OP``, ``in_step_factor`` of the same run: 3.51
(benchmarks/records/2026-11-29-gpu-h200/after)."""


@dataclass(frozen=True)
class Machine:
    """H100 SXM nodes, 8 GPUs on NVLink 4 / NVSwitch, one 400 Gb/s InfiniBand NIC per GPU."""

    sustained_flops: float = 100e12
    """Assumed: 20 % of the H100 SXM's 494.7 TFLOP/s dense TF32 (NVIDIA H100 datasheet)."""
    memory_bytes_per_s: float = 2.7e12
    """Assumed: 80 % of the H100 SXM's 3.35 TB/s HBM3 (H100 datasheet). ``compute_s`` prices
    a step's compute as the longer of its FLOPs' time and the memory traffic of its ops that
    count FLOPs at this rate, plus the traffic of its ops that count none (NOTE [Kernels
    without FLOPs] in ``_work``)."""
    fft_flops_per_s: float = 8e12
    """Derived: single-precision FFTs are bound by HBM bandwidth on an H100. Counted at ``5 n
    log2 n`` FLOPs (NOTE [FFT FLOPs are counted apart]), a large transform (``n = 2^20``) in
    two passes that each read and write 8-byte complex values moves 32 bytes per point for
    100 FLOPs per point: ``100 / 32 x memory_bytes_per_s`` = 8.4e12, rounded down."""
    complex_matmul_flops_per_s: float = 2.7e12
    """Derived: an FNO's spectral contraction (NOTE [Complex matmuls are counted apart]) is one
    small complex product per retained mode, ``(B, C_in) x (C_in, C_out)``, bound by reading
    that mode's weight (8 bytes per complex entry) for ``2 B`` FLOPs per entry at torch's
    count: ``B / 4`` FLOPs a byte, 1 at a batch of 4 per rank: ``memory_bytes_per_s``."""
    nvlink_bytes_per_s: float = 370e9
    """Assumed achievable per GPU and direction: 82 % of NVLink 4's 450 GB/s (H100 datasheet)."""
    ib_bytes_per_s: float = 45e9
    """Assumed achievable: 90 % of NDR's 50 GB/s per direction (DGX H100 user guide)."""
    base_latency_s: float = 3.6e-6
    """NCCL ``src/graph/tuning.cc``, ring LL: base latency of a collective or message."""
    nvlink_step_latency_s: float = 0.47e-6
    """NCCL tuning.cc, ring LL: per-step latency over NVLink."""
    net_step_latency_s: float = 2.7e-6
    """NCCL tuning.cc, ring LL: per-step latency over the network."""
    tree_base_latency_s: float = 4.4e-6
    """NCCL tuning.cc, tree LL: base latency."""
    ll_bandwidth_fraction: float = 0.25
    """NCCL tuning.cc: the LL protocol moves a quarter of the Simple protocol's bandwidth; the
    Simple protocol's latencies are those above times ``simple_latency_factor``."""
    simple_latency_factor: float = 3.0
    """NCCL tuning.cc: Simple's base 8.4 µs and NVLink step 3.4 µs against LL's 3.6 and 0.47
    (the network step 9.6 against 2.7): about 3x, rounded."""
    gpus_per_node: int = 8
    """DGX H100 / HGX H100."""
    host_us_per_op: float = GLOO_HOST_US_PER_OP
    """What a ShardTensor step's aten op costs where its calls were not counted by dispatch
    path (a measurement saved before they were; else NOTE [Host time by dispatch path]).
    Assumed: an H100 node's host core as fast as this machine's, so the figure measured here
    (``GLOO_HOST_US_PER_OP``: a ShardTensor step's CPU time over the aten ops it dispatches, a
    UNet at a 16² tile on 1 rank, none of them by communication modules, which ``ops_host_s``
    prices apart, NOTE [One price per op]). Until 2026-11-29 it was 53, from an older
    measurement that ``benchmarks.calibrate`` no longer reproduced. A cluster's host core may be
    faster or slower: ``benchmarks.calibrate_host`` measures one; override with ``--set
    host_us_per_op=...``."""
    plain_host_us_per_op: float = GLOO_PLAIN_HOST_US_PER_OP
    """Assumed as ``host_us_per_op``: ``GLOO_PLAIN_HOST_US_PER_OP``, a plain torch step's CPU
    time over its aten ops; what an op on plain tensors costs the host (a data-parallel
    replica's whole step). 25 until 2026-11-29. A GPU host also launches each op's kernel
    (``benchmarks.calibrate_host --device cuda`` measures that)."""
    host_us_per_communication_op: float = GLOO_HOST_US_PER_COMMUNICATION_OP
    """Assumed as ``host_us_per_op``: ``GLOO_HOST_US_PER_COMMUNICATION_OP``, what an op a
    communication module dispatches costs the host, the modules' Python around it included
    (slicing, packing and unpacking a halo's or a collective's pieces; NOTE [One price per
    op]). Until 2026-11-29 these ops were charged ``plain_host_us_per_op``."""
    host_us_per_fast_op: float = H200_HOST_US_PER_FAST_OP
    """Measured on an H200 machine's host CPU (``H200_HOST_US_PER_FAST_OP``): what an aten op
    on ShardTensors that takes the ``fast`` path adds over the plain op (NOTE [Host time by
    dispatch path]). ``benchmarks.calibrate_dispatch`` measures another host's."""
    host_us_per_propagation_op: float = H200_HOST_US_PER_PROPAGATION_OP
    """As ``host_us_per_fast_op``, the ``propagation`` path (``H200_HOST_US_PER_PROPAGATION_OP``)."""
    host_us_per_handler_op: float = H200_HOST_US_PER_HANDLER_OP
    """As ``host_us_per_fast_op``, the ``handler`` path (``H200_HOST_US_PER_HANDLER_OP``)."""
    host_us_per_function_call: float = H200_HOST_US_PER_FUNCTION_CALL
    """As ``host_us_per_fast_op``, a function handler's call (``H200_HOST_US_PER_FUNCTION_CALL``)."""
    host_calls_in_step_factor: float = H200_HOST_CALLS_IN_STEP_FACTOR
    """What a step's ShardTensor calls cost over the same calls at the per-path figures
    (``H200_HOST_CALLS_IN_STEP_FACTOR``, the H200 host's; NOTE [Host time by dispatch path])."""
    host_us_per_collective: float = 10.0
    """Assumed: the host CPU time of issuing one collective or one round of halo messages
    through NCCL (argument checks, stream ordering, a kernel launch: several µs each).
    ``collective_host_s`` charges it per call, plus ``host_us_per_collective_step`` per ring
    step."""
    host_us_per_collective_step: float = 0.0
    """NCCL's kernels run the ring's ``P - 1`` steps on the device: none on the host. Gloo runs
    them on the host's CPU, each step's copies and sends (``benchmarks.calibrate`` fits both
    figures from the CPU time a call costs on 2 and 4 ranks)."""
    host_us_per_all_to_all: float = 10.0
    """Assumed, as ``host_us_per_collective``: the host CPU time of issuing one all-to-all
    (NOTE [What an all-to-all posts]); ``collective_host_s`` charges it per call, plus
    ``host_us_per_all_to_all_peer`` per other rank of its group."""
    host_us_per_all_to_all_peer: float = 0.0
    """NCCL posts an all-to-all's sends and receives in one group that its kernels run on the
    device: none on the host. Gloo posts and waits for each on the host's CPU, one pair per
    other rank of the group whether its piece is empty or not (NOTE [What an all-to-all
    posts]; ``benchmarks.calibrate`` fits it with ``host_us_per_all_to_all`` from the CPU time
    of all-to-alls over groups of 2, 4 and 8 ranks, whole and to neighbours only)."""
    host_s_per_byte_received: float = 0.0
    """NCCL's kernels move a collective's bytes on the device: none on the host. Gloo moves
    them through the host's CPU (over loopback TCP a byte is copied into the socket and out
    of it, and reduced there for an all-reduce), so a call's CPU time grows with the bytes a
    rank receives (``count_traffic``'s figure): ``benchmarks.calibrate`` fits this with the
    two figures above from every call up to 4 MiB."""
    pointwise_contiguous_bytes_per_s: float | None = None
    """The rate of the bytes of flop-free pointwise ops on contiguous tensors of one shape
    (NOTE [Kernels without FLOPs by family] in ``_work``); None: ``memory_bytes_per_s``. The
    H100 preset's one assumption for every family: no family is measured on a GPU, and an
    elementwise kernel streams HBM at about the rate of any other."""
    pointwise_broadcast_bytes_per_s: float | None = None
    """As ``pointwise_contiguous_bytes_per_s``, a pointwise op with an input of fewer
    elements than its output (a broadcast)."""
    pointwise_strided_bytes_per_s: float | None = None
    """As ``pointwise_contiguous_bytes_per_s``, a pointwise op with a non-contiguous tensor."""
    reduction_bytes_per_s: float | None = None
    """As ``pointwise_contiguous_bytes_per_s``, reductions and normalizations (sums, layer and
    group norms, softmaxes, forward and backward)."""
    copy_bytes_per_s: float | None = None
    """As ``pointwise_contiguous_bytes_per_s``, copies and indexing (``copy_``, ``clone``,
    ``cat``, gathers and scatters, a slice's backward)."""
    strided_copy_s_per_run: float = 0.0
    """Assumed 0: a GPU's copy kernels read and write a strided piece's rows (``W / n`` of a
    field's row, hundreds of bytes at the tiles the zoo recommends) at about the bandwidth of
    a contiguous one. On a CPU each run of a strided copy costs a few ns more than its bytes
    (NOTE [Strided copies] in ``_work``; ``benchmarks.calibrate`` measures it)."""
    backend: str = "nccl"
    """The collective library the machine's runs use. How a halo exchange is issued depends on
    it (messages on NCCL, one all-to-all on gloo: ``messages_in_one_collective``), so a step
    measured on gloo ranks here is measured as this backend issues it (``issued_as``) before
    it is projected onto this machine (``benchmarks.cost_model``)."""
    host_overlaps_device: bool = True
    """A GPU's kernels run while the host launches the next ones: a step costs ``max(host,
    device)``. On a CPU the same core does both: ``host + device``."""
    memory_gib: float = 80.0
    """HBM3 of one H100 SXM (H100 datasheet): ``parallel=auto``'s default memory budget."""


def override(machine: Machine, settings: list[str]) -> Machine:
    """``machine`` with ``name=value`` settings applied.

    Raises
    ------
    ValueError
        One line naming a setting that is not ``name=value`` of a ``Machine`` field.
    """
    known = {f.name: f.type for f in fields(Machine)}
    changes: dict[str, float | int | bool | str] = {}
    for setting in settings:
        name, _, value = setting.partition("=")
        if name not in known or not value:
            raise ValueError(f"{setting!r}: expected name=value, name one of {list(known)}")
        kind = known[name]
        try:
            if kind in (str, "str"):
                changes[name] = value
            elif kind in (bool, "bool"):
                if value not in ("true", "false"):
                    raise ValueError(value)
                changes[name] = value == "true"
            else:
                changes[name] = int(value) if kind in (int, "int") else float(value)
        except ValueError:
            raise ValueError(f"{setting!r}: {name} expects a {kind}") from None
    return dataclasses.replace(machine, **changes)


# --------------------------------------------------------------------------- collectives
# NOTE [Collectives priced over their own ranks]
# Every function below prices collectives over a group of ``ranks`` that spans ``nodes``
# nodes: the ranks a collective connects (NOTE [The span of a collective] in
# ``shardsci/testing/_traffic.py``), which for one axis of a block are that axis's, not the
# whole domain group's. ``nodes=None`` is a group of consecutive ranks (``span_nodes``): the
# fewest nodes that hold it.
def span_nodes(machine: Machine, ranks: Sequence[int]) -> int:
    """Nodes the global ``ranks`` span, ranks numbered node by node (torchrun's and srun's
    order)."""
    return len({rank // machine.gpus_per_node for rank in ranks})


def _nodes(machine: Machine, ranks: int, nodes: int | None) -> int:
    return nodes if nodes is not None else max(1, math.ceil(ranks / machine.gpus_per_node))


def _link(machine: Machine, nodes: int) -> tuple[float, float]:
    """(per-step latency, bytes/s) of the slowest link a group over ``nodes`` crosses."""
    if nodes == 1:
        return machine.nvlink_step_latency_s, machine.nvlink_bytes_per_s
    return machine.net_step_latency_s, machine.ib_bytes_per_s


def _ring_s(machine: Machine, steps: int, ranks: int, nbytes: float, nodes: int) -> float:
    """A ring of ``steps`` steps moving ``nbytes`` per link: the cheaper of LL and Simple.
    The ring visits the ranks node by node, so of its steps only the share ``nodes / P``
    crosses the network (NCCL's tuning.cc counts intra- and inter-node steps apart); its
    bandwidth is the slowest link's."""
    _, bandwidth = _link(machine, nodes)
    crossing = nodes / ranks if nodes > 1 else 0.0
    step = (1 - crossing) * machine.nvlink_step_latency_s + crossing * machine.net_step_latency_s
    latency = machine.base_latency_s + steps * step
    ll = latency + nbytes / (bandwidth * machine.ll_bandwidth_fraction)
    simple = machine.simple_latency_factor * latency + nbytes / bandwidth
    return min(ll, simple)


def all_reduce_s(machine: Machine, ranks: int, nbytes: float, nodes: int | None = None) -> float:
    """Ring (``2 (P - 1)`` steps, ``2 (P - 1) / P`` of the buffer per link) or tree (``2 log2
    P`` hops, twice the buffer at LL bandwidth), whichever is cheaper."""
    if ranks == 1:
        return 0.0
    nodes = _nodes(machine, ranks, nodes)
    ring = _ring_s(machine, 2 * (ranks - 1), ranks, nbytes * 2 * (ranks - 1) / ranks, nodes)
    step, bandwidth = _link(machine, nodes)
    tree = machine.tree_base_latency_s + 2 * math.log2(ranks) * step
    tree += 2 * nbytes / (bandwidth * machine.ll_bandwidth_fraction)
    return min(ring, tree)


def all_gather_s(machine: Machine, ranks: int, piece: float, nodes: int | None = None) -> float:
    """Ring all-gather (or reduce-scatter) of ``piece`` bytes per rank: ``P - 1`` steps."""
    if ranks == 1:
        return 0.0
    return _ring_s(machine, ranks - 1, ranks, piece * (ranks - 1), _nodes(machine, ranks, nodes))


def all_to_all_s(machine: Machine, ranks: int, volume: float, nodes: int | None = None) -> float:
    """``P - 1`` messages posted together, ``(P - 1) / P`` of the local ``volume``; bytes
    to ranks on other nodes go over InfiniBand (a group over ``nodes`` nodes has ``P /
    nodes`` ranks on each)."""
    if ranks == 1:
        return 0.0
    local = math.ceil(ranks / _nodes(machine, ranks, nodes)) - 1
    remote = ranks - 1 - local
    piece = volume / ranks
    latency = machine.base_latency_s + local * machine.nvlink_step_latency_s
    latency += remote * machine.net_step_latency_s
    return latency + piece * (local / machine.nvlink_bytes_per_s + remote / machine.ib_bytes_per_s)


def halo_s(
    machine: Machine, ranks: int, rounds: float, nbytes: float, nodes: int | None = None
) -> float:
    """Every round of messages waits for its slowest: NVLink among ranks on one node, else
    InfiniBand. Without ``nodes`` (the nodes a rank and its neighbours span), a group of
    ``2 x gpus_per_node`` ranks or more is taken to give every rank a neighbour on another
    node."""
    if ranks == 1:
        return 0.0
    if nodes is None:
        nodes = 2 if ranks >= 2 * machine.gpus_per_node else _nodes(machine, ranks, None)
    step, bandwidth = _link(machine, nodes)
    return rounds * (machine.base_latency_s + step) + nbytes / bandwidth


def ring_steps(kind: str, ranks: int) -> int:
    """Steps of one call of ``kind`` over ``ranks`` as a ring runs it: one for a round of
    messages to neighbours, ``2 (P - 1)`` for an all-reduce, ``P - 1`` for the others."""
    if kind in HALO_KINDS:
        return 1
    return 2 * (ranks - 1) if kind.endswith("all_reduce") else ranks - 1


def strided_copy_s(machine: Machine, runs: float) -> float:
    """Device seconds the ``runs`` of a step's strided copies add to their bytes (NOTE
    [Strided copies] in ``_work``): compute, in both projections."""
    return runs * machine.strided_copy_s_per_run


def flop_free_rate(machine: Machine, family: str) -> float:
    """Bytes per second of the flop-free kernels of ``family`` (one of ``_work``'s
    ``FLOP_FREE_FAMILIES``): its ``<family>_bytes_per_s``, else ``memory_bytes_per_s``."""
    rate = getattr(machine, f"{family}_bytes_per_s")
    return machine.memory_bytes_per_s if rate is None else rate


def flop_free_s(
    machine: Machine, flop_free_bytes: float, by_family: Mapping[str, float] | None = None
) -> float:
    """Device seconds of a step's kernels without FLOPs (NOTE [Kernels without FLOPs by
    family] in ``_work``): each family's bytes of ``by_family`` at its rate
    (``flop_free_rate``), the rest of ``flop_free_bytes`` (all of it where the families were
    not counted) at ``memory_bytes_per_s``."""
    by_family = by_family or {}
    rest = flop_free_bytes - sum(by_family.values())
    return rest / machine.memory_bytes_per_s + sum(
        nbytes / flop_free_rate(machine, family) for family, nbytes in by_family.items()
    )


def compute_s(
    machine: Machine,
    *,
    flops: float,
    fft_flops: float,
    complex_matmul_flops: float,
    memory_bytes: float,
    flop_free_bytes: float,
    strided_runs: float,
    flop_free_bytes_by_family: Mapping[str, float] | None = None,
) -> float:
    """Device seconds of a rank's kernels (NOTE [One price per op]): the longer of its
    ``flops`` at ``sustained_flops``, ``fft_flops`` at ``fft_flops_per_s`` (NOTE [FFT FLOPs
    are counted apart] in ``_work``) and ``complex_matmul_flops`` at
    ``complex_matmul_flops_per_s`` (NOTE [Complex matmuls are counted apart]), and the
    traffic of the ops that count FLOPs (``memory_bytes - flop_free_bytes``) at
    ``memory_bytes_per_s``; plus the traffic of those that count none (NOTE [Kernels without
    FLOPs]) by family where counted so (``flop_free_s``) and the runs of the strided copies
    (``strided_copy_s``)."""
    flop_s = (
        flops / machine.sustained_flops
        + fft_flops / machine.fft_flops_per_s
        + complex_matmul_flops / machine.complex_matmul_flops_per_s
    )
    flop_bound_traffic_s = (memory_bytes - flop_free_bytes) / machine.memory_bytes_per_s
    return (
        max(flop_s, flop_bound_traffic_s)
        + flop_free_s(machine, flop_free_bytes, flop_free_bytes_by_family)
        + strided_copy_s(machine, strided_runs)
    )


DISPATCH_PRICES = (
    "host_us_per_fast_op",
    "host_us_per_propagation_op",
    "host_us_per_handler_op",
    "host_us_per_function_call",
    "host_calls_in_step_factor",
)
"""The ``Machine`` fields that price a ShardTensor call by its dispatch path."""


def dispatch_prices(machine: Machine) -> dict[str, float]:
    """``machine``'s ``DISPATCH_PRICES``, by field."""
    return {name: getattr(machine, name) for name in DISPATCH_PRICES}


def path_us(machine: Machine, path: str) -> float:
    """µs a ShardTensor call on dispatch ``path`` (one of ``DISPATCH_PATHS``) adds, as a loop
    measures it (NOTE [Host time by dispatch path])."""
    if path == "function":
        return machine.host_us_per_function_call
    return getattr(machine, f"host_us_per_{path}_op")


def ops_host_s(
    machine: Machine,
    ops: float,
    communication_ops: float,
    sharded: bool,
    dispatch_calls: Mapping[str, float] | None = None,
) -> float:
    """Host CPU seconds of a step's ``ops`` aten ops, ``communication_ops`` of them dispatched
    by communication modules, on ShardTensors (``sharded``) or plain tensors (NOTE [One price
    per op]); ``dispatch_calls``: its ShardTensor calls by dispatch path (``DISPATCH_PATHS``,
    NOTE [Host time by dispatch path]), ``None`` where they were not counted."""
    if not sharded:
        return ops * machine.plain_host_us_per_op * 1e-6
    own = ops - communication_ops
    communication = communication_ops * machine.host_us_per_communication_op
    if dispatch_calls is None:
        return (own * machine.host_us_per_op + communication) * 1e-6
    calls = sum(n * path_us(machine, path) for path, n in dispatch_calls.items())
    added = calls * machine.host_calls_in_step_factor
    return (own * machine.plain_host_us_per_op + added + communication) * 1e-6


# NOTE [What an all-to-all posts]
# An all-to-all's pieces to some ranks may be empty: a halo sent as one all-to-all over a mesh
# axis's group (NOTE [An exchange of messages as one all-to-all where messages are slow] in
# ``shardsci/tensor/_collectives.py``) has a piece for each neighbour only. Its host cost still
# grows with its whole group: gloo's ``alltoallv`` (gloo/alltoallv.cc) posts a send and a
# receive to every other rank of the group, empty ones included, and waits for them all; so
# does torch's NCCL all-to-all with NCCL 2.14 or later (``_nccl_should_send_recv`` in
# torch/csrc/cuda/nccl.cpp: zero-byte messages are sent), though there the device runs them.
# So ``collective_host_s`` prices an all-to-all by its group (``count_traffic``'s
# ``Span.group``) and bytes: ``host_us_per_all_to_all`` a call, ``host_us_per_all_to_all_peer``
# per other rank of the group, ``host_s_per_byte_received`` per byte; not by the ring steps
# of the collectives whose ``P - 1`` steps run one after another. The device's time
# (``collective_s``) stays priced over the ranks it connects: an empty piece moves nothing.
def collective_host_s(
    machine: Machine, kind: str, ranks: int, calls: float, received: float
) -> float:
    """Host CPU seconds of ``calls`` calls of ``kind`` (rounds of messages for a halo) over
    groups of ``ranks``, the busiest rank receiving ``received`` bytes in all: each
    ``host_us_per_collective`` plus ``host_us_per_collective_step`` per ring step, an
    all-to-all ``host_us_per_all_to_all`` plus ``host_us_per_all_to_all_peer`` per other rank
    of its group (NOTE [What an all-to-all posts]: ``ranks`` is its group's size), and
    ``host_s_per_byte_received`` per byte."""
    if ranks == 1:
        return 0.0
    if kind == "all_to_all":
        each = machine.host_us_per_all_to_all + machine.host_us_per_all_to_all_peer * (ranks - 1)
    else:
        steps = ring_steps(kind, ranks)
        each = machine.host_us_per_collective + machine.host_us_per_collective_step * steps
    return calls * each * 1e-6 + received * machine.host_s_per_byte_received


def collective_s(
    machine: Machine,
    kind: str,
    ranks: int,
    calls: float,
    received: float,
    rounds: float,
    nodes: int | None = None,
) -> float:
    """Seconds of ``calls`` collectives of ``kind`` over groups of ``ranks``, the busiest rank
    receiving ``received`` bytes in all (``count_traffic``'s and ``comm_counter``'s figure:
    an all-reduce counted at its ring's ``2 (P - 1) / P`` of the buffer, an all-gather as the
    ``P - 1`` pieces received, an all-to-all as ``(P - 1) / P`` of the volume); ``rounds``:
    rounds of point-to-point messages (halos; ``calls`` for other kinds); ``nodes``: those
    the group spans (NOTE [Collectives priced over their own ranks])."""
    if ranks == 1 or calls == 0:
        return 0.0
    if kind in HALO_KINDS:
        return halo_s(machine, ranks, rounds, received, nodes)
    each = received / calls
    if kind in ("all_reduce", "gradient_all_reduce", "grad_all_reduce"):
        return calls * all_reduce_s(machine, ranks, each * ranks / (2 * (ranks - 1)), nodes)
    if kind == "all_to_all":
        return calls * all_to_all_s(machine, ranks, each * ranks / (ranks - 1), nodes)
    # all_gather, reduce_scatter, broadcast and the rest: rings of P - 1 steps
    return calls * all_gather_s(machine, ranks, each / (ranks - 1), nodes)


STRIDED_COPY_S_PER_RUN = 2.5e-9
"""Measured here (``benchmarks.calibrate.measure_strided_copy``, 2026-11-28 17:47 UTC, load
23-39, one core, CPU time): 2.3-2.6 ns a run (three runs' medians) more than the same bytes
copied from an H-narrowed piece, for ``(4, 32-64, 64-128, 16-128)`` fields narrowed 2-8 ways
along W."""


GLOO_HOST_S_PER_BYTE = 5.8e-10
"""Measured here (``benchmarks.calibrate``'s fit of every call's CPU time, 2026-11-29 03:24
UTC, load 0.5, 35 calls of 256 B-4 MiB on 2 and 4 gloo ranks): 607 µs of CPU per MiB a rank
receives (0 per call, 283 µs per ring step beside it). Kept though later fits read more: 613
µs at load 16-21 (2026-11-29 15:58 UTC), 972 and 919 at load 11-24 and 17-48 (18:45, 18:50):
a copy's CPU grows with the other processes' load, which this figure, taken on a quiet
machine, leaves out (``calibrate_steps`` scales it with the load it meets, NOTE [Host terms
paired with the steps])."""


GLOO_HOST_US_PER_COLLECTIVE_STEP = 243.0
"""Measured here (``benchmarks.calibrate``'s fit of every call's CPU time, three fits on
2026-11-29: 15:58 UTC at load 16-21, 18:45 at load 11-24 and 18:50 at load 17-48): a
collective's CPU time is 0 / 0 / 29 µs a call plus 250 / 243 / 189 µs per ring step (the
median of each), fitted with its bytes and with the all-to-alls' own terms
(``benchmarks/records/2026-11-29-cost-model-remeasured``). The figures of 2026-11-28 (251 µs
a call plus 375 µs a step, at load 7-11) came from a fit to calls up to 16 KiB without a term
for bytes or for an all-to-all's peers: they priced a small all-reduce on 2 ranks at 1.0 ms
where it costs 0.38-0.49 ms."""


GLOO_HOST_US_PER_ALL_TO_ALL_PEER = 48.0
"""Measured here (``benchmarks.calibrate``'s fit of every call's CPU time, 2026-11-29 16:03
UTC, load 16-21): an all-to-all's CPU time is 0 a call plus 47.7 µs per other rank of its
group (NOTE [What an all-to-all posts]), from halo all-to-alls (a face to each neighbour) over
2, 4 and 8 gloo ranks, median of 5 alternated rounds: 65 / 155 / 553 µs a call with 256 B
faces (rounds 65-74 / 128-185 / 339-951, one round of the first -4), and whole all-to-alls on
2 and 4 ranks; ring steps were priced 250 µs each by the same fit. Refitted at 18:45 and 18:50
UTC (load 11-24 and 17-48): 45 µs a call plus 40.7 µs a peer, and 0 plus 58.0; the halo
all-to-alls' rounds spread as widely (4 ranks, 256 B faces: 119-469 and 169-349 µs a call).
Before it, a halo
all-to-all over 4 ranks was priced as ring steps over the 3 ranks it connects (2 x 197 µs by
the old fit on the same calls) and a round of halo messages 197 µs."""


COMPLEX_MATMUL_FLOPS_PER_S = 0.42e9
"""Measured here (``benchmarks/records/2026-11-29-cost-model/fno_kernels.py``,
2026-11-29 06:31 UTC, load 27, one rank):
the FNO's spectral contraction at its step's shapes (128², 12 complex ``bmm`` calls a step),
0.42 GFLOP/s at torch's count against 28 for the step's 1x1 convolutions."""


GLOO_FLOP_FREE_BYTES_PER_S = {
    "pointwise_contiguous": 12.01e9,
    "pointwise_broadcast": 11.81e9,
    "pointwise_strided": 2.07e9,
    "reduction": 7.07e9,
    "copy": 12.05e9,
}
"""Measured here by ``benchmarks.calibrate``'s ``measure_flop_free_families`` (NOTE
[Calibrating the machine]: a few forward kernels of each family at the zoo's step shapes,
bytes as ``WorkCounter`` counts them, over their CPU seconds in a loop, one thread), 3
runs on 2026-11-30 (06:29 UTC, load 25-26), the
median (``benchmarks/records/2026-11-30-predicted-vs-measured``, ``families_1.jsonl``):
12.01, 11.81, 2.07, 7.07, 12.05 GB/s. Until then the rates of the Transolver's
own flop-free ops inside its step (9.5 / 7.3 / 3.9 / 4.7 / 7.9, planner21's
``2026-11-30-flop-free-families``), which priced the UNet's flop-free time at 1.52 of measured
inside its step where these give 1.07 (the Transolver's 0.95 against 0.96, the FNO's 1.21
against 1.17, the ViT's 0.68 against 0.77; ``cross_check.py`` of the same record). Held
against the zoo's timed steps on 1, 2 and 4 ranks (``benchmarks.calibrate_steps``, each call
probing the families): 10 of 15 within 25 %, 9 at one flop-free rate, 12 at the Transolver's
in-step rates (the same record)."""


def gloo_cpu(ranks_here: int, cores: int | None = None, memory_bytes: int | None = None) -> Machine:
    """This kind of machine: ``ranks_here`` CPU ranks sharing ``cores`` cores (default: those
    this process may use) and ``memory_bytes`` of RAM (default: ``MemTotal``), gloo over
    loopback, one host. Compute and memory are shared equally by the ranks.

    Sources: the host figures are measured here (an aten op: ``GLOO_HOST_US_PER_OP``,
    ``GLOO_PLAIN_HOST_US_PER_OP``, ``GLOO_HOST_US_PER_COMMUNICATION_OP``; a ShardTensor call by
    its dispatch path: ``GLOO_HOST_US_PER_FAST_OP`` and the three beside it, times
    ``GLOO_HOST_CALLS_IN_STEP_FACTOR``; issuing a
    collective: ``GLOO_HOST_US_PER_COLLECTIVE_STEP`` a ring step and nothing a call; an
    all-to-all per rank of its group: ``GLOO_HOST_US_PER_ALL_TO_ALL_PEER``; the bytes:
    ``GLOO_HOST_S_PER_BYTE``); the kernels without FLOPs by family
    (``GLOO_FLOP_FREE_BYTES_PER_S``, measured); FLOP/s and gloo's latency and bandwidth are assumptions of the right order
    for one core of a 2020s x86 server (float32 convolutions through oneDNN on one thread; a
    loopback TCP message), FFTs at a fifth of the convolutions' rate as ``benchmarks.calibrate``
    measured (4.7 against 22.7 GFLOP/s), complex matmuls at ``COMPLEX_MATMUL_FLOPS_PER_S``
    (measured). ``benchmarks.calibrate`` fits all of them; the choice
    of a decomposition on this machine is checked against measured step times by
    ``benchmarks/parallel_auto.py``.
    """
    cores = cores or len(os.sched_getaffinity(0))
    memory_bytes = memory_bytes or _mem_total_bytes()
    share = min(1.0, cores / ranks_here)
    return Machine(
        sustained_flops=5e9 * share,
        fft_flops_per_s=1e9 * share,
        complex_matmul_flops_per_s=COMPLEX_MATMUL_FLOPS_PER_S * share,
        memory_bytes_per_s=5e9 * share,
        nvlink_bytes_per_s=1e9 * share,
        ib_bytes_per_s=1e9 * share,
        base_latency_s=100e-6,
        nvlink_step_latency_s=50e-6,
        net_step_latency_s=50e-6,
        tree_base_latency_s=100e-6,
        ll_bandwidth_fraction=1.0,
        simple_latency_factor=1.0,
        gpus_per_node=max(ranks_here, 1),
        host_us_per_op=GLOO_HOST_US_PER_OP / share,
        plain_host_us_per_op=GLOO_PLAIN_HOST_US_PER_OP / share,
        host_us_per_communication_op=GLOO_HOST_US_PER_COMMUNICATION_OP / share,
        host_us_per_fast_op=GLOO_HOST_US_PER_FAST_OP / share,
        host_us_per_propagation_op=GLOO_HOST_US_PER_PROPAGATION_OP / share,
        host_us_per_handler_op=GLOO_HOST_US_PER_HANDLER_OP / share,
        host_us_per_function_call=GLOO_HOST_US_PER_FUNCTION_CALL / share,
        host_calls_in_step_factor=GLOO_HOST_CALLS_IN_STEP_FACTOR,
        host_us_per_collective=0.0,
        host_us_per_collective_step=GLOO_HOST_US_PER_COLLECTIVE_STEP / share,
        host_us_per_all_to_all=0.0,
        host_us_per_all_to_all_peer=GLOO_HOST_US_PER_ALL_TO_ALL_PEER / share,
        host_s_per_byte_received=GLOO_HOST_S_PER_BYTE / share,
        strided_copy_s_per_run=STRIDED_COPY_S_PER_RUN / share,
        **{
            f"{family}_bytes_per_s": rate * share
            for family, rate in GLOO_FLOP_FREE_BYTES_PER_S.items()
        },
        backend="gloo",
        host_overlaps_device=False,
        memory_gib=memory_bytes / ranks_here / 2**30,
    )


def _mem_total_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemTotal line")
