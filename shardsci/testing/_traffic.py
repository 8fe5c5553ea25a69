"""Count the bytes a rank moves from the collectives it issues, independently of the library.

shardsci counts its own traffic (``record_comm`` beside each collective it calls): a count
that cannot see what goes around it. :func:`count_traffic` counts at the dispatcher instead:
every ``torch.distributed`` collective, point-to-point message and functional collective
reaches the dispatcher as a ``c10d`` or ``_c10d_functional`` op, whoever issues it (shardsci,
DTensor's own redistribution, a ``funcol`` call, an autograd backward), so a
``TorchDispatchMode`` sees them all. Bytes follow NOTE [What a byte count means] in
``shardsci/tensor/_comm_stats.py``, worked out here from each op's buffers and group, and are
also kept by the kind of collective torch ran (``KINDS``: what was issued, which need not be
what the library calls it: an uneven all-gather is issued as an all-to-all), and by where it
ran (``Traffic.by_span``, NOTE [The span of a collective]).

# NOTE [The span of a collective]
What a collective costs depends on the ranks it connects, not only on its kind and bytes: an
all-reduce over one axis of a 2x4 block has 2 or 4 ranks, not 8, and whether they share a
node decides its link. Each collective is kept under its ``Span``: its kind and the global
ranks it connects this rank with, this rank included: its process group's ranks, except for
an all-to-all, whose ranks are those this rank sends a non-empty piece to or receives one from
(the library issues a transpose over one axis of a block as an all-to-all over the whole
domain group whose pieces to the other ranks are empty: they move no byte), and a message,
which connects its two ends. It also keeps the ``group``: the size of the process group the op
was issued over, which is what an all-to-all's host time grows with, since gloo (and torch's
NCCL all-to-all on NCCL 2.14 or later) posts a message to every rank of its group, empty
pieces included (NOTE [What an all-to-all posts] in ``shardsci/planning/_machine.py``): a halo
sent as one all-to-all over a 4-rank axis connects a rank with its 2 neighbours but is posted
to all 4.

With ``watch``, the counter also keeps the order of events (``Traffic.log``): each collective
and message as it is posted, the first op that reads each received message or all-to-all
output (which cannot run before it arrived), and every call of the watched ops. That is how a test sees
whether compute ran while messages were in flight, without timing anything.

:func:`counted_comm` runs both counts side by side and fails, on every rank, when they
disagree: the byte tests use it so that traffic the library does not record fails them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from shardsci.tensor import CommStats, comm_counter
from shardsci.tensor._torch_compat import (
    DispatchKey,
    DispatchKeySet,
    OpOverload,
    TorchDispatchMode,
    _resolve_process_group,
    is_traceable_wrapper_subclass_type,
    tree_leaves,
    with_effects,
)
from shardsci.testing._collective_asserts import assert_all_ranks

__all__ = [
    "KINDS",
    "Event",
    "Span",
    "Traffic",
    "count_traffic",
    "counted_comm",
    "traffic_problems",
]

_NAMESPACES = ("c10d", "_c10d_functional")
# Ops of those namespaces that move no payload.
_SILENT = frozenset(
    {
        "c10d::barrier",
        "c10d::monitored_barrier_",
        "_c10d_functional::wait_tensor",
        "_c10d_functional::_wrap_tensor_autograd",
    }
)


class Event(NamedTuple):
    """One entry of :attr:`Traffic.log`.

    Attributes
    ----------
    what : str
        ``"post"`` (a collective or message issued), ``"read"`` (the first op reading a
        received message) or ``"op"`` (a call of a watched op).
    op : str
        The op's name: ``"c10d::send"``, ``"c10d::recv_"``, a collective's, or an aten op's
        (``"aten::convolution"``).
    message : int or None
        For a receive's post and its read: the index of that receive among this counter's
        receives, so that a read can be matched with its post.
    """

    what: str
    op: str
    message: int | None = None


class Span(NamedTuple):
    """Where one collective ran (NOTE [The span of a collective]).

    Attributes
    ----------
    kind : str
        The kind of collective issued (``KINDS``; ``"p2p"`` for a message).
    ranks : tuple of int
        The global ranks it connects this rank with, this rank included, ascending.
    group : int
        Ranks in the process group it was issued over (a message's: its group's).
    """

    kind: str
    ranks: tuple[int, ...]
    group: int


@dataclass
class Traffic:
    """What this rank moved while :func:`count_traffic` was active.

    Attributes
    ----------
    sent, received : int
        Payload bytes sent to and received from other ranks.
    collectives : Counter
        Collective op name (``"c10d::alltoall_base_"``) -> calls.
    messages : int
        Point-to-point sends and receives.
    sent_by_kind, received_by_kind : Counter
        Kind of collective issued (``KINDS``; ``"p2p"`` for messages) -> bytes.
    calls_by_kind : Counter
        Kind -> collectives issued; for ``"p2p"``, messages.
    p2p_rounds : int
        Runs of messages posted back to back, with no other op between them: one per batch
        of ``batch_isend_irecv`` (all of whose messages are in flight together).
    unknown : list of str
        Ops of the collective namespaces this counter has no byte model for.
    largest_received : int
        The most bytes received by one collective or message.
    calls_by_span, received_by_span : Counter
        ``Span`` -> collectives issued (messages, for ``"p2p"``), and bytes received (NOTE
        [The span of a collective]).
    log : list of Event
        The order of events, kept only when :func:`count_traffic` watches ops.
    """

    sent: int = 0
    received: int = 0
    collectives: Counter = field(default_factory=Counter)
    messages: int = 0
    sent_by_kind: Counter = field(default_factory=Counter)
    received_by_kind: Counter = field(default_factory=Counter)
    calls_by_kind: Counter = field(default_factory=Counter)
    p2p_rounds: int = 0
    unknown: list[str] = field(default_factory=list)
    largest_received: int = 0
    calls_by_span: Counter = field(default_factory=Counter)
    received_by_span: Counter = field(default_factory=Counter)
    log: list[Event] = field(default_factory=list)

    @property
    def collective_calls(self) -> int:
        return sum(self.collectives.values())

    def as_dict(self) -> dict[str, Any]:
        """The counts by kind, as plain dicts (what a rank body returns):
        ``{"sent": {kind: bytes}, "received": {kind: bytes}, "calls": {kind: n},
        "p2p_rounds": n}``."""
        return {
            "sent": dict(self.sent_by_kind),
            "received": dict(self.received_by_kind),
            "calls": dict(self.calls_by_kind),
            "p2p_rounds": self.p2p_rounds,
        }

    def _add(self, span: Span, sent: int, received: int) -> None:
        kind = span.kind
        self.sent += sent
        self.received += received
        self.sent_by_kind[kind] += sent
        self.received_by_kind[kind] += received
        self.calls_by_kind[kind] += 1
        self.calls_by_span[span] += 1
        self.received_by_span[span] += received
        self.largest_received = max(self.largest_received, received)


@contextmanager
def count_traffic(watch: Collection[str] = ()) -> Iterator[Traffic]:
    """Count, at the dispatcher, every collective this rank issues inside the ``with`` block.

    Parameters
    ----------
    watch : collection of str
        Names of ops (``"aten::convolution"``, without overload) whose calls go into
        ``Traffic.log`` in order with the posts and the reads of received messages. Without
        it no log is kept. Watching holds every received message until the block exits.

    Examples
    --------
    >>> with count_traffic() as traffic:  # doctest: +SKIP
    ...     y = x.redistribute(mesh, [Replicate()])
    >>> traffic.received, traffic.received_by_kind["all_to_all"]  # doctest: +SKIP
    """
    traffic = Traffic()
    with _TrafficMode(traffic, frozenset(watch)):
        yield traffic


def traffic_problems(stats: CommStats, traffic: Traffic) -> list[str]:
    """How shardsci's own count ``stats`` differs from the independent ``traffic``."""
    problems = [f"collectives with no byte model: {traffic.unknown}"] if traffic.unknown else []
    recorded_calls = stats.collective_calls
    if (stats.total_sent, stats.total_received) != (traffic.sent, traffic.received):
        problems.append(
            f"shardsci recorded {stats.total_sent} bytes sent and {stats.total_received} "
            f"received ({dict(stats.received)}); the collectives issued sent {traffic.sent} "
            f"and received {traffic.received}"
        )
    if recorded_calls != traffic.collective_calls:
        problems.append(
            f"shardsci recorded {recorded_calls} collectives ({dict(stats.calls)}); "
            f"{traffic.collective_calls} were issued ({dict(traffic.collectives)})"
        )
    return problems


@contextmanager
def counted_comm(what: str = "") -> Iterator[CommStats]:
    """:func:`shardsci.comm_counter`, checked against :func:`count_traffic` on exit.

    A collective over every rank: all ranks must leave the block normally. Raises the same
    ``AssertionError`` on every rank if any rank's two counts disagree (traffic that went
    around ``record_comm``, or a record without its collective).
    """
    with count_traffic() as traffic, comm_counter() as stats:
        yield stats
    problems = traffic_problems(stats, traffic)
    label = f"{what}: " if what else ""
    assert_all_ranks(not problems, label + "; ".join(problems))


# ---------------------------------------------------------------------------- the mode
# The kernel of shardsci's custom ops, below the Python key (where modes run).
_DENSE = DispatchKeySet(DispatchKey.CompositeExplicitAutograd)


class _TrafficMode(TorchDispatchMode):
    def __init__(self, traffic: Traffic, watch: frozenset[str]) -> None:
        super().__init__()
        self.traffic = traffic
        self.watch = watch
        self.after_message = False
        # Received messages not read yet (watching only): storage address -> (its index,
        # the buffer, held so that no other tensor gets its address meanwhile).
        self.unread: dict[int, tuple[int, torch.Tensor]] = {}
        self.receives = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        # A wrapper subclass (ShardTensor, DTensor) goes first: its __torch_dispatch__ issues
        # the collectives on plain tensors, which then come here. (Fake tensors, which
        # DTensor's sharding propagation runs ops on, move nothing: they run below.)
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented
        if isinstance(func, OpOverload) and func.namespace == "shardsci":
            # A traced collective (NOTE [A traced collective is an effect]): its kernel runs
            # with this mode on, which counts the functional collective it issues.
            with self:
                return func.redispatch(_DENSE, *args, **kwargs)
        message = False
        if isinstance(func, OpOverload) and func.namespace in _NAMESPACES:
            message = self._count(func, args, kwargs)
        elif self.watch:
            self._observe(func, args, kwargs)
        self.after_message = message
        return func(*args, **kwargs)

    def _count(self, func: OpOverload, args: tuple, kwargs: dict) -> bool:
        """Count one op of the collective namespaces; whether it was a message."""
        name = func._schema.name
        if name in _SILENT:
            return False
        if name not in _MODELS:
            self.traffic.unknown.append(name)
            return False
        kind, model = _MODELS[name]
        bound = func._schema.arguments
        values = dict(zip((a.name for a in bound), args)) | kwargs
        sent, received = model(values)
        point_to_point = kind == "p2p"
        group = _group(
            values["process_group"] if "process_group" in values else values["group_name"]
        )
        span = Span(kind, _connected(name, values, group), group.size())
        self.traffic._add(span, sent, received)
        if point_to_point:
            self.traffic.messages += 1
            self.traffic.p2p_rounds += not self.after_message
        else:
            self.traffic.collectives[name] += 1
        if self.watch:
            index = None
            if name in _RECEIVED_INTO:
                index = self.receives
                self.receives += 1
                received = values[_RECEIVED_INTO[name]]
                for buffer in received if isinstance(received, list) else [received]:
                    if buffer.numel():
                        self.unread[buffer.untyped_storage().data_ptr()] = (index, buffer)
            self.traffic.log.append(Event("post", name, index))
        return point_to_point

    def _observe(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Log the first read of a received message and the calls of watched ops."""
        name = func._schema.name
        if name in self.watch:
            self.traffic.log.append(Event("op", name))
        if not self.unread or getattr(func, "is_view", False):
            return
        bound = func._schema.arguments
        values = dict(zip((a.name for a in bound), args)) | kwargs
        read = [
            values[a.name]
            for a in bound
            if a.name in values and not (a.alias_info is not None and a.alias_info.is_write)
        ]
        for tensor in tree_leaves(read):
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                entry = self.unread.pop(tensor.untyped_storage().data_ptr(), None)
                if entry is not None:
                    self.traffic.log.append(Event("read", name, entry[0]))


@with_effects.py_impl(_TrafficMode)
def _effect_under_traffic_mode(
    mode: _TrafficMode, token: torch.Tensor, op: OpOverload, *args: Any, **kwargs: Any
) -> Any:
    """A collective a compiled graph runs as an effect (NOTE [A traced collective is an
    effect]): the effect's op runs under ``mode``, which counts the functional collective it
    issues."""
    with mode:  # the dense kernel (calling with_effects again would come back here)
        return with_effects.dispatch(
            DispatchKey.CompositeExplicitAutograd, token, op, *args, **kwargs
        )


# ---------------------------------------------------------------------------- byte models
def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _total(tensors: Sequence[torch.Tensor]) -> int:
    return sum(_bytes(t) for t in tensors)


def _group(value: Any) -> dist.ProcessGroup:
    """A process group from a c10d op's boxed argument or a functional op's group name."""
    if isinstance(value, str):
        return _resolve_process_group(value)
    return dist.ProcessGroup.unbox(value)


def _connected(name: str, values: dict[str, Any], group: dist.ProcessGroup) -> tuple[int, ...]:
    """The global ranks a collective or message over ``group`` connects this rank with,
    itself included (NOTE [The span of a collective])."""
    ranks = dist.get_process_group_ranks(group)
    me = group.rank()
    if name in ("c10d::send", "c10d::recv_"):
        peer = values["dst"] if name == "c10d::send" else values["src"]
        return tuple(sorted({ranks[me], ranks[peer]}))
    if name == "c10d::alltoall_":
        pieces = zip(values["output_tensors"], values["input_tensors"])
        moving = [bool(out.numel() or inp.numel()) for out, inp in pieces]
    elif name in ("c10d::alltoall_base_", "_c10d_functional::all_to_all_single"):
        out_splits, in_splits = values["output_split_sizes"], values["input_split_sizes"]
        if not (out_splits or in_splits):
            return tuple(sorted(ranks))
        size = len(ranks)
        moving = [bool(o or i) for o, i in zip(out_splits or [1] * size, in_splits or [1] * size)]
    else:
        return tuple(sorted(ranks))
    return tuple(sorted(r for i, r in enumerate(ranks) if moving[i] or i == me))


def _ring(nbytes: int, size: int) -> tuple[int, int]:
    """All-reduce: the ring cost, sent and received (NOTE [What a byte count means])."""
    moved = 2 * (size - 1) * nbytes // size
    return moved, moved


def _split_bytes(tensor: torch.Tensor, splits: Sequence[int], size: int) -> list[int]:
    """Bytes per group rank of a buffer split along dim 0 (evenly when ``splits`` is empty)."""
    if not splits:
        return [_bytes(tensor) // size] * size
    row = math.prod(tensor.shape[1:]) * tensor.element_size()
    return [n * row for n in splits]


def _all_to_all(output: torch.Tensor, input: torch.Tensor, out_splits, in_splits, group):
    me, size = group.rank(), group.size()
    received = _split_bytes(output, out_splits, size)
    sent = _split_bytes(input, in_splits, size)
    return sum(sent) - sent[me], sum(received) - received[me]


def _gathered(piece: int, size: int) -> tuple[int, int]:
    """All-gather: a piece sent to, and one received from, each other rank."""
    return (size - 1) * piece, (size - 1) * piece


def _reduce_scattered(whole: int, size: int) -> tuple[int, int]:
    """Reduce-scatter, as a direct exchange: every piece but one's own goes to its owner."""
    piece = whole // size
    return whole - piece, (size - 1) * piece


def _broadcast(nbytes: int, root: int, group: dist.ProcessGroup) -> tuple[int, int]:
    if group.rank() == root:
        return (group.size() - 1) * nbytes, 0
    return 0, nbytes


Model = Callable[[dict[str, Any]], tuple[int, int]]


def _c10d_all_reduce(v: dict[str, Any]) -> tuple[int, int]:
    return _ring(_total(v["tensors"]), _group(v["process_group"]).size())


def _c10d_all_gather(v: dict[str, Any]) -> tuple[int, int]:
    return _gathered(_total(v["input_tensors"]), _group(v["process_group"]).size())


def _c10d_all_gather_coalesced(v: dict[str, Any]) -> tuple[int, int]:
    inputs = v["input_list"] if "input_list" in v else v["inputs"]
    return _gathered(_total(inputs), _group(v["process_group"]).size())


def _c10d_all_gather_base(v: dict[str, Any]) -> tuple[int, int]:
    return _gathered(_bytes(v["input_tensor"]), _group(v["process_group"]).size())


def _c10d_reduce_scatter(v: dict[str, Any]) -> tuple[int, int]:
    size = _group(v["process_group"]).size()
    outputs = v["output_tensors"] if "output_tensors" in v else v["outputs"]
    return _reduce_scattered(size * _total(outputs), size)


def _c10d_reduce_scatter_base(v: dict[str, Any]) -> tuple[int, int]:
    return _reduce_scattered(_bytes(v["input_tensor"]), _group(v["process_group"]).size())


def _c10d_all_to_all_base(v: dict[str, Any]) -> tuple[int, int]:
    return _all_to_all(
        v["output"],
        v["input"],
        v["output_split_sizes"],
        v["input_split_sizes"],
        _group(v["process_group"]),
    )


def _c10d_all_to_all(v: dict[str, Any]) -> tuple[int, int]:
    me = _group(v["process_group"]).rank()
    outputs, inputs = v["output_tensors"], v["input_tensors"]
    return _total(inputs) - _bytes(inputs[me]), _total(outputs) - _bytes(outputs[me])


def _c10d_broadcast(v: dict[str, Any]) -> tuple[int, int]:
    return _broadcast(_total(v["tensors"]), v["root_rank"], _group(v["process_group"]))


def _c10d_reduce(v: dict[str, Any]) -> tuple[int, int]:
    group, nbytes = _group(v["process_group"]), _total(v["tensors"])
    if group.rank() == v["root_rank"]:
        return 0, (group.size() - 1) * nbytes
    return nbytes, 0


def _c10d_gather(v: dict[str, Any]) -> tuple[int, int]:
    group, nbytes = _group(v["process_group"]), _total(v["input_tensors"])
    if group.rank() == v["root_rank"]:
        return 0, (group.size() - 1) * nbytes
    return nbytes, 0


def _c10d_scatter(v: dict[str, Any]) -> tuple[int, int]:
    group, nbytes = _group(v["process_group"]), _total(v["output_tensors"])
    if group.rank() == v["root_rank"]:
        return (group.size() - 1) * nbytes, 0
    return 0, nbytes


def _functional_all_reduce(v: dict[str, Any]) -> tuple[int, int]:
    tensors = v["inputs"] if "inputs" in v else [v["input"]]
    return _ring(_total(tensors), _group(v["group_name"]).size())


def _functional_all_gather(v: dict[str, Any]) -> tuple[int, int]:
    tensors = v["inputs"] if "inputs" in v else [v["input"]]
    return _gathered(_total(tensors), v["group_size"])


def _functional_reduce_scatter(v: dict[str, Any]) -> tuple[int, int]:
    tensors = v["inputs"] if "inputs" in v else [v["input"]]
    return _reduce_scattered(_total(tensors), v["group_size"])


def _functional_all_to_all(v: dict[str, Any]) -> tuple[int, int]:
    group = _group(v["group_name"])
    size, me = group.size(), group.rank()
    sent = _split_bytes(v["input"], v["input_split_sizes"], size)
    received = _split_bytes(v["input"], v["output_split_sizes"], size)
    return sum(sent) - sent[me], sum(received) - received[me]


def _functional_broadcast(v: dict[str, Any]) -> tuple[int, int]:
    return _broadcast(_bytes(v["input"]), v["src"], _group(v["group_name"]))


_MODELS: dict[str, tuple[str, Model]] = {
    "c10d::allreduce_": ("all_reduce", _c10d_all_reduce),
    "c10d::allreduce_coalesced_": ("all_reduce", _c10d_all_reduce),
    "c10d::allgather_": ("all_gather", _c10d_all_gather),
    "c10d::allgather_coalesced_": ("all_gather", _c10d_all_gather_coalesced),
    "c10d::_allgather_base_": ("all_gather", _c10d_all_gather_base),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", _c10d_all_gather_coalesced),
    "c10d::reduce_scatter_": ("reduce_scatter", _c10d_reduce_scatter),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", _c10d_reduce_scatter_base),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", _c10d_reduce_scatter),
    "c10d::alltoall_base_": ("all_to_all", _c10d_all_to_all_base),
    "c10d::alltoall_": ("all_to_all", _c10d_all_to_all),
    "c10d::broadcast_": ("broadcast", _c10d_broadcast),
    "c10d::reduce_": ("reduce", _c10d_reduce),
    "c10d::gather_": ("gather", _c10d_gather),
    "c10d::scatter_": ("scatter", _c10d_scatter),
    "c10d::send": ("p2p", lambda v: (_total(v["tensors"]), 0)),
    "c10d::recv_": ("p2p", lambda v: (0, _total(v["tensors"]))),
    "c10d::recv_any_source_": ("p2p", lambda v: (0, _total(v["tensors"]))),
    "_c10d_functional::all_reduce": ("all_reduce", _functional_all_reduce),
    "_c10d_functional::all_reduce_": ("all_reduce", _functional_all_reduce),
    "_c10d_functional::all_reduce_coalesced": ("all_reduce", _functional_all_reduce),
    "_c10d_functional::all_reduce_coalesced_": ("all_reduce", _functional_all_reduce),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", _functional_all_gather),
    "_c10d_functional::all_gather_into_tensor_out": ("all_gather", _functional_all_gather),
    "_c10d_functional::all_gather_into_tensor_coalesced": ("all_gather", _functional_all_gather),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", _functional_reduce_scatter),
    "_c10d_functional::reduce_scatter_tensor_coalesced": (
        "reduce_scatter",
        _functional_reduce_scatter,
    ),
    "_c10d_functional::all_to_all_single": ("all_to_all", _functional_all_to_all),
    "_c10d_functional::broadcast": ("broadcast", _functional_broadcast),
    "_c10d_functional::broadcast_": ("broadcast", _functional_broadcast),
}
# Ops that receive into a buffer, and its argument: what ``Traffic.log`` follows to its first
# read (an all-to-all's output: a halo exchange as one collective, NOTE [An exchange of
# messages as one all-to-all where messages are slow]).
_RECEIVED_INTO = {
    "c10d::recv_": "tensors",
    "c10d::recv_any_source_": "tensors",
    "c10d::alltoall_base_": "output",
}

KINDS: dict[str, str] = {name: kind for name, (kind, _) in _MODELS.items()}
"""Collective or message op name -> its kind (those of NOTE [What a byte count means]; messages
are ``"p2p"``)."""
