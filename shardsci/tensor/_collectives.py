"""Collectives on local tensors along one mesh axis (or several, flattened).

All collectives here take shapes that every rank computes from the same global spec, so the
ranks always agree on split sizes (gloo aborts the process on disagreeing splits). None of
them are differentiable: autograd lives one level up, on ShardTensors.

Payloads travel as raw bytes, so any dtype (bool, complex, float8) moves through gloo and nccl
alike.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardsci.tensor import _graph_collectives
from shardsci.tensor._caches import BoundedCache, clear_caches
from shardsci.tensor._comm_stats import record_comm
from shardsci.tensor._spec import mesh_coordinate
from shardsci.tensor._torch_compat import all_gather_single, disable_current_modes
from shardsci.tensor._torch_compile import in_graph

__all__ = [
    "AxisGroup",
    "PendingMessages",
    "all_gather",
    "all_reduce",
    "axis_group",
    "broadcast",
    "exchange",
    "exchange_packed",
    "issued_as",
    "send_recv",
    "start_send_recv",
]


@dataclass(frozen=True)
class AxisGroup:
    """The ranks along some mesh axes that share this rank's other coordinates.

    Attributes
    ----------
    group : ProcessGroup
        Their process group.
    size : int
        Number of ranks.
    index : int
        This rank's flat index, row-major over the axes (the order of shard sizes).
    group_ranks : tuple of int
        Flat index -> rank within ``group``.
    global_ranks : tuple of int
        Flat index -> global rank.
    posts_one_by_one : bool
        Whether point-to-point messages are posted one call each rather than as one batch
        (NOTE [Messages posted one by one where the backend does not batch them]).
    messages_in_one_collective : bool
        Whether an exchange every member joins goes as one all-to-all rather than as messages
        (NOTE [An exchange of messages as one all-to-all where messages are slow]).
    """

    group: dist.ProcessGroup
    size: int
    index: int
    group_ranks: tuple[int, ...]
    global_ranks: tuple[int, ...]
    posts_one_by_one: bool = False
    messages_in_one_collective: bool = False


# NOTE [An exchange of messages as one all-to-all where messages are slow]
# A halo exchange is a few messages to neighbours, which every member of the axis's group
# takes part in. On gloo a point-to-point message costs far more than the same bytes in one
# collective: 2 gloo ranks, 2 KiB each way, load 20-50 (``benchmarks/call_waiting.py``):
# isend + irecv 0.08 ms of the thread's CPU and 2.5 ms of wall, one ``all_to_all_single``
# 0.06 and 0.28 ms. ``benchmarks/halo_collective.py`` runs the same work both ways, paired
# and alternated (2026-11-29 13:02-13:27 UTC, load 14-88, records in
# ``benchmarks/records/2026-11-29-halo-collective``): a UNet training step's process CPU,
# all-to-all over messages, on 2 ranks 0.76 at a 16² tile per rank and 0.68 at 64²; 4 ranks
# 0.65 / 0.76; 2x2 0.88 / 0.89; 8 ranks (16²) 0.76, 2x4 0.91; a circular pad's forward and
# backward 0.21-1.0; the same bytes. So on gloo such an exchange goes as one
# ``all_to_all_single`` over the axis's group, with a zero split for every member that is
# not a neighbour: one call instead of a message each way per neighbour (as in a compiled
# graph, where there is no functional point-to-point collective). Elsewhere it stays
# messages: NCCL already launches a batch of messages as one group, and torch's NCCL
# all-to-all with split sizes posts a send and a receive for every peer, zero-byte ones
# included (``_nccl_should_send_recv`` is true for every count from NCCL 2.14 on; read in
# torch's source, not measured): 2 (P - 1) legs for a 2-neighbour exchange, O(P) on a large
# group. The rule is ``messages_in_one_collective``, applied to the group's backend, or inside
# ``issued_as`` to the target run's: the dry run's fake process group, or gloo ranks measuring a
# step for an NCCL cluster (``benchmarks.cost_model``), count what the target run issues.
# Every member must call the exchange, messages or not (``start_send_recv``'s
# ``everyone_joins``). A hop of the ring (``_ops/_ring``: attention's keys and values, a ring
# product's moving operand) is such an exchange too, every rank of the group making every hop:
# on gloo its forward and backward took 0.27-0.49 of the messages' process CPU, a ViT step
# 0.64-0.98 (2, 4 and 2x2 ranks, load 24-60), on 8 ranks 0.64-1.00 (records in
# ``benchmarks/records/2026-11-29-ring-collective``).
GLOO_LARGEST_GROUP = 8
"""The largest group on gloo whose exchanges go as one all-to-all: measured up to 8 ranks
(``benchmarks/halo_collective.py``); gloo's all-to-all visits every member, so a larger
group is left to messages until measured."""


def messages_in_one_collective(backend: str, size: int) -> bool:
    """Whether an exchange of messages that every member of a group of ``size`` ranks on
    ``backend`` joins goes as one all-to-all (NOTE [An exchange of messages as one all-to-all
    where messages are slow])."""
    return backend == "gloo" and 1 < size <= GLOO_LARGEST_GROUP


# torch's own choice per device, before any registered backend claims a device.
_BUILT_IN_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl"}

_ISSUED_AS: list[str] = []
"""The backends ``issued_as`` is inside, innermost last."""


@contextlib.contextmanager
def issued_as(backend: str) -> Iterator[None]:
    """Within, every rule that depends on a group's backend (how an exchange is issued:
    ``messages_in_one_collective``) follows ``backend``, the target run's, whatever the groups
    run on: a dry run's fake process group stands in for NCCL on a GPU cluster planned on
    this CPU, and gloo ranks measuring a step for that cluster issue its halos as NCCL would
    (messages), so that both count what the target run issues. Only what is issued changes:
    messages are still posted as the group's own backend posts them (``posts_one_by_one``).
    Caches are emptied on entry and exit: their plans hold groups made under the other
    rule."""
    clear_caches()
    _ISSUED_AS.append(backend)
    try:
        yield
    finally:
        _ISSUED_AS.pop()
        clear_caches()


def _backend(group: dist.ProcessGroup, device_type: str) -> str:
    """The backend whose rules ``group`` follows: that of ``issued_as`` inside one; else
    ``group``'s, or for a registered one (the dry run's fake process group) the backend torch
    built in for ``device_type``, if any."""
    if _ISSUED_AS:
        return _ISSUED_AS[-1]
    backend = str(dist.get_backend(group))
    if dist.Backend.backend_type_map.get(backend) != dist.ProcessGroup.BackendType.CUSTOM:
        return backend
    return _BUILT_IN_BACKENDS.get(device_type, backend)


# Keyed by the mesh's value, which keeps the mesh (and its groups) alive while cached
# (NOTE [Caches are keyed by value]).
_GROUPS: BoundedCache[tuple[DeviceMesh, tuple[int, ...]], AxisGroup] = BoundedCache(
    "axis groups", 1024
)


def axis_group(mesh: DeviceMesh, axes: Sequence[int]) -> AxisGroup:
    """The group along ``axes`` (outermost first) that contains this rank.

    A group over several axes is created on first use, collectively over the whole mesh.
    """
    axes = tuple(axes)
    key = (mesh, axes)
    found = _GROUPS.get(key)
    if found is not None:
        return found
    coordinate = mesh_coordinate(mesh)
    # Real tensors while a handler runs on fake shards (torch.compile): flattening a mesh
    # reads its rank tensor, which a fake mode refuses ("Please convert all Tensors to
    # FakeTensors"; F.group_norm's statistics over a 2x2 mesh, first met in a trace).
    with disable_current_modes():
        group = mesh.get_group(axes[0]) if len(axes) == 1 else _flattened_group(mesh, axes)
    mine = next(row for row in _rank_grid(mesh, axes) if dist.get_rank() in row)
    members = dist.get_process_group_ranks(group)
    index = sum(
        coordinate[a] * math.prod(mesh.shape[b] for b in axes[i + 1 :]) for i, a in enumerate(axes)
    )
    result = AxisGroup(
        group=group,
        size=len(mine),
        index=index,
        group_ranks=tuple(members.index(r) for r in mine),
        global_ranks=tuple(mine),
        posts_one_by_one=dist.get_backend(group) == "gloo",
        messages_in_one_collective=messages_in_one_collective(
            _backend(group, mesh.device_type), len(mine)
        ),
    )
    return _GROUPS.put(key, result)


def _rank_grid(mesh: DeviceMesh, axes: tuple[int, ...]) -> list[list[int]]:
    """One row per group along ``axes``: its global ranks by flat index.

    Read with dispatch modes off: torch.compile traces under a fake tensor mode, where no op
    may run on the mesh's real rank tensor.
    """
    with disable_current_modes():
        ranks = mesh.mesh.numpy()
    return ranks.transpose(_others_then(axes, mesh.ndim)).reshape(-1, _size(mesh, axes)).tolist()


def _size(mesh: DeviceMesh, axes: Sequence[int]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _others_then(axes: tuple[int, ...], ndim: int) -> list[int]:
    return [a for a in range(ndim) if a not in axes] + list(axes)


def _flattened_group(mesh: DeviceMesh, axes: tuple[int, ...]) -> dist.ProcessGroup:
    """The process group over several mesh axes.

    # NOTE [Groups over several mesh axes are created by every rank of the world]
    ``new_group`` is collective over the whole world and matches calls by order, so every rank
    must create the same groups in the same order, including ranks of other data-parallel
    replicas whose sub-mesh holds different ranks. A sub-mesh (``mesh["h", "w"]`` of a
    ``(dp, h, w)`` mesh) only knows its own replica's ranks, so its groups are created by
    DeviceMesh's flattening, which enumerates the groups of every replica from the root mesh;
    a root mesh enumerates every row of its own grid.
    """
    names = mesh.mesh_dim_names
    root = mesh._get_root_mesh()
    if names is not None:
        chosen = tuple(names[a] for a in sorted(axes))
        flat_name = "shardsci_" + "_".join(chosen)
        sub = mesh if len(chosen) == mesh.ndim else mesh[chosen]
        return sub._flatten(flat_name).get_group()
    if root is not mesh or mesh.mesh.numel() != dist.get_world_size():
        raise NotImplementedError(
            f"a collective over mesh axes {axes} of an unnamed sub-mesh {mesh} cannot create "
            f"its process group consistently on every rank; give the mesh axis names "
            f"(init_device_mesh(..., mesh_dim_names=...))"
        )
    grid = _rank_grid(mesh, axes)
    mine, _ = dist.new_subgroups_by_enumeration([sorted(row) for row in grid])
    return mine


# ---------------------------------------------------------------------------------- exchange
def exchange(
    group: AxisGroup,
    pieces: Sequence[torch.Tensor | None],
    shape_of: Callable[[int, int], Sequence[int]],
    *,
    dtype: torch.dtype,
    device: torch.device,
    kind: str,
) -> list[torch.Tensor]:
    """Personalised all-to-all: send ``pieces[k]`` to flat index ``k``, receive from each.

    Parameters
    ----------
    group : AxisGroup
        The ranks taking part.
    pieces : sequence of Tensor or None
        What this rank sends to each flat index; ``pieces[group.index]`` is kept, not sent.
    shape_of : callable
        ``shape_of(src, dst)`` is the shape of the piece ``src`` sends to ``dst``, the same
        function on every rank (it is how the receiving side knows what comes).
    kind : str
        The name this exchange is counted under (see NOTE [What a byte count means]).

    Returns
    -------
    list of Tensor
        The piece received from each flat index (this rank's own piece included).
    """
    me = group.index
    received_shapes = [tuple(shape_of(src, me)) for src in range(group.size)]
    if not _anything_moves(group.size, shape_of):
        empty = _EmptyPieces(dtype, device)
        return [
            _own_piece(pieces[me], received_shapes[me], dtype, device)
            if src == me
            else empty(received_shapes[src])
            for src in range(group.size)
        ]
    itemsize = dtype.itemsize
    send_bytes = [0] * group.size
    recv_bytes = [0] * group.size
    send_buffers = []
    for dst in sorted(range(group.size), key=lambda k: group.group_ranks[k]):
        if dst == me or pieces[dst] is None or pieces[dst].numel() == 0:
            continue
        send_buffers.append(_as_bytes(pieces[dst]))
        send_bytes[group.group_ranks[dst]] = send_buffers[-1].numel()
    for src in range(group.size):
        if src != me:
            recv_bytes[group.group_ranks[src]] = math.prod(received_shapes[src]) * itemsize
    send = (
        torch.cat(send_buffers)
        if send_buffers
        else torch.empty(0, dtype=torch.uint8, device=device)
    )
    recv = _all_to_all_bytes(group, send.to(device), send_bytes, recv_bytes, kind)
    return _split_received(recv, recv_bytes, received_shapes, group, pieces[me], dtype, device)


def exchange_packed(
    group: AxisGroup,
    packed: torch.Tensor,
    send_counts: Sequence[int],
    recv_counts: Sequence[int],
    *,
    kind: str,
) -> torch.Tensor:
    """Personalised all-to-all of one packed buffer (NOTE [One pack and one unpack per
    collective]): whatever the number of peers, a constant number of aten ops.

    Parameters
    ----------
    packed : Tensor
        Contiguous: the elements for each group rank, one after the other in group-rank
        order, ``send_counts[r]`` for group rank ``r`` (zero for this rank).
    recv_counts : sequence of int
        Elements received from each group rank, every rank's ``send_counts`` to this one.
    kind : str
        The name this exchange is counted under (see NOTE [What a byte count means]).

    Returns
    -------
    Tensor
        ``(sum(recv_counts),)`` of ``packed``'s dtype: what each group rank sent, in
        group-rank order.
    """
    itemsize = packed.dtype.itemsize
    recv = _all_to_all_bytes(
        group,
        _as_bytes(packed),
        [n * itemsize for n in send_counts],
        [n * itemsize for n in recv_counts],
        kind,
    )
    return _from_bytes(recv, packed.dtype, (sum(recv_counts),))


def _all_to_all_bytes(
    group: AxisGroup, send: torch.Tensor, send_bytes: list[int], recv_bytes: list[int], kind: str
) -> torch.Tensor:
    """``all_to_all_single`` of byte buffers (split sizes by group rank), traced in a
    compiled graph, counted outside one."""
    if in_graph():
        return _graph_collectives.all_to_all_single(send, recv_bytes, send_bytes, group.group)
    recv = torch.empty(sum(recv_bytes), dtype=torch.uint8, device=send.device)
    dist.all_to_all_single(recv, send, recv_bytes, send_bytes, group=group.group)
    record_comm(kind, sum(send_bytes), sum(recv_bytes))
    return recv


def _anything_moves(size: int, shape_of: Callable[[int, int], Sequence[int]]) -> bool:
    return any(
        math.prod(shape_of(src, dst)) > 0
        for src in range(size)
        for dst in range(size)
        if src != dst
    )


# The byte views below skip a reshape to the shape a tensor already has: each is an aten op
# (``tests/test_redistribute_ops.py`` pins a redistribution's ops).
def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor if tensor.ndim == 1 else tensor.reshape(-1)
    if flat.numel() and flat.stride(0) != 1:  # a broadcast element has stride 0
        flat = flat.clone(memory_format=torch.contiguous_format)
    if flat.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(torch.uint8)


def _from_bytes(buffer: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """``buffer`` (bytes, or already of ``dtype``) as a tensor of ``dtype`` and ``shape``."""
    if buffer.dtype == dtype:
        values = buffer
    elif dtype.is_complex:
        real = buffer.view(dtype.to_real())
        values = torch.view_as_complex(real.reshape(-1, 2))
    else:
        values = buffer.view(dtype)
    return values if values.shape == tuple(shape) else values.reshape(shape)


def _own_piece(
    piece: torch.Tensor | None, shape: Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    if piece is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return piece


def _split_received(
    recv: torch.Tensor,
    recv_bytes: list[int],
    shapes: list[tuple[int, ...]],
    group: AxisGroup,
    own: torch.Tensor | None,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    starts = [0] * len(recv_bytes)
    running = 0
    for group_rank, nbytes in enumerate(recv_bytes):
        starts[group_rank] = running
        running += nbytes
    result = []
    empty = _EmptyPieces(dtype, device)
    for src in range(group.size):
        if src == group.index:
            result.append(_own_piece(own, shapes[src], dtype, device))
            continue
        group_rank = group.group_ranks[src]
        if recv_bytes[group_rank] == 0:
            result.append(empty(shapes[src]))
            continue
        chunk = recv[starts[group_rank] : starts[group_rank] + recv_bytes[group_rank]]
        result.append(_from_bytes(chunk, dtype, shapes[src]))
    return result


class _EmptyPieces:
    """The pieces of no element that an exchange receives from the ranks that send nothing
    (most of a graph's ranks, with few neighbours each): one tensor per shape, shared, so
    that they cost no aten op per peer."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self.made: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, shape: Sequence[int]) -> torch.Tensor:
        shape = tuple(shape)
        if shape not in self.made:
            self.made[shape] = torch.empty(shape, dtype=self.dtype, device=self.device)
        return self.made[shape]


# ---------------------------------------------------------------------------------- reductions
_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


def all_reduce(tensor: torch.Tensor, group: AxisGroup, reduce_op: str) -> torch.Tensor:
    """Reduce ``tensor`` over the group; returns a new tensor (``avg`` divides by the size),
    or ``tensor`` itself on a group of one."""
    if reduce_op not in _REDUCE_OPS:
        raise NotImplementedError(f"all-reduce with reduce op {reduce_op!r}")
    if group.size == 1:
        return tensor
    result = tensor.clone(memory_format=torch.contiguous_format)
    if result.dtype == torch.bool:
        result = result.to(torch.uint8)
    if in_graph():
        result = _graph_collectives.all_reduce(
            result, "sum" if reduce_op == "avg" else reduce_op, group.group
        )
    else:
        dist.all_reduce(result, op=_REDUCE_OPS[reduce_op], group=group.group)
        nbytes = result.numel() * result.element_size()
        ring = 2 * (group.size - 1) * nbytes // group.size
        record_comm("all_reduce", ring, ring)
    if reduce_op == "avg":
        result = result / group.size
    return result.to(tensor.dtype)


def all_gather(tensor: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Every member's ``tensor`` (all of one shape), stacked by flat index: ``(size, *shape)``.

    The native collective (NCCL's tuned algorithms on GPUs); pieces of different sizes go
    through ``exchange``.
    """
    if group.size == 1:
        return tensor.unsqueeze(0)
    payload = _as_bytes(tensor)
    if in_graph():
        gathered = _graph_collectives.all_gather(payload, group.group)
    else:
        gathered = payload.new_empty(group.size * payload.numel())
        all_gather_single()(gathered, payload, group=group.group)
        nbytes = (group.size - 1) * payload.numel()
        record_comm("all_gather", nbytes, nbytes)
    stacked = _from_bytes(gathered, tensor.dtype, (group.size, *tensor.shape))
    order = list(group.group_ranks)
    return stacked if order == sorted(order) else stacked[order]


def broadcast(
    tensor: torch.Tensor | None,
    src: int,
    group: AxisGroup,
    *,
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Broadcast from flat index ``src``; other ranks pass ``tensor=None``."""
    if group.index == src:
        buffer = tensor.contiguous()
    else:
        buffer = torch.empty(shape, dtype=dtype, device=device)
    if group.size == 1:
        return buffer
    payload = buffer if buffer.dtype != torch.bool else buffer.view(torch.uint8)
    if in_graph():
        received = _graph_collectives.broadcast(payload, group.group_ranks[src], group.group)
        return received if buffer.dtype != torch.bool else received.view(torch.bool)
    dist.broadcast(payload, group_src=group.group_ranks[src], group=group.group)
    nbytes = buffer.numel() * buffer.element_size()
    if group.index == src:
        record_comm("broadcast", (group.size - 1) * nbytes, 0)
    else:
        record_comm("broadcast", 0, nbytes)
    return buffer


@dataclass
class PendingMessages:
    """Point-to-point messages in flight; ``wait`` returns the received tensors."""

    works: list
    buffers: list[torch.Tensor]
    shapes: list[Sequence[int]]
    dtype: torch.dtype
    kind: str
    sent: int
    counted: bool = True
    """False for messages in a compiled graph, which are not counted (NOTE [torch.compile and
    ShardTensor])."""
    as_messages: bool = True
    """False when they went as one all-to-all (NOTE [An exchange of messages as one all-to-all
    where messages are slow])."""

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        if self.counted:
            received = sum(b.nbytes for b in self.buffers)
            record_comm(self.kind, self.sent, received, as_messages=self.as_messages)
        return [_from_bytes(b, self.dtype, shape) for b, shape in zip(self.buffers, self.shapes)]


# NOTE [Messages in their own dtype]
# A point-to-point message moves bytes: gloo sends a tensor's bytes whatever its dtype, and NCCL
# sends every dtype in ``_SENT_AS_IS`` natively. Those are sent and received as they are (a
# contiguous tensor, a receive buffer of the message's dtype and shape); complex, bool and the
# rest go as ``uint8`` views (``_as_bytes``, ``_from_bytes``). The same bytes travel either
# way; the view, the reshape back and the dtype check per message are skipped (about 10 µs of
# the calling thread a message on gloo, measured in host10's collective_calls).
_SENT_AS_IS = frozenset(
    {
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
    }
)


def start_send_recv(
    group: AxisGroup,
    sends: Sequence[tuple[int, torch.Tensor]],
    receives: Sequence[tuple[int, Sequence[int]]],
    *,
    dtype: torch.dtype,
    device: torch.device,
    kind: str = "p2p",
    everyone_joins: bool = False,
) -> PendingMessages:
    """Post point-to-point messages and return at once: ``sends`` are (flat index, tensor),
    ``receives`` are (flat index, shape).

    Both sides must agree: each send on one rank matches a receive on its peer, in the same
    order for a given pair. With ``everyone_joins`` (every member of the group calls this for
    the same exchange, with messages or none), the messages go as one all-to-all where the
    group's backend makes messages slow (NOTE [An exchange of messages as one all-to-all where
    messages are slow]).
    """
    shapes = [shape for _, shape in receives]
    if in_graph():
        buffers = _traced_send_recv(group, sends, receives, dtype=dtype, device=device)
        return PendingMessages([], buffers, shapes, dtype, kind, 0, counted=False)
    if everyone_joins and group.messages_in_one_collective:
        send, send_bytes, recv_bytes, cut = _one_payload(group, sends, receives, dtype, device)
        recv = torch.empty(sum(recv_bytes), dtype=torch.uint8, device=device)
        work = dist.all_to_all_single(
            recv, send, recv_bytes, send_bytes, group=group.group, async_op=True
        )
        return PendingMessages(
            [work], cut(recv), shapes, dtype, kind, sum(send_bytes), as_messages=False
        )
    posts = []
    sent = 0
    for dst, tensor in sends:
        payload = tensor.contiguous() if tensor.dtype in _SENT_AS_IS else _as_bytes(tensor)
        sent += payload.nbytes
        posts.append((dist.isend, payload, group.group_ranks[dst]))
    buffers = []
    for src, shape in receives:
        if dtype in _SENT_AS_IS:
            buffer = torch.empty(shape, dtype=dtype, device=device)
        else:
            buffer = torch.empty(
                math.prod(shape) * dtype.itemsize, dtype=torch.uint8, device=device
            )
        buffers.append(buffer)
        posts.append((dist.irecv, buffer, group.group_ranks[src]))
    works = _posted(group, posts)
    return PendingMessages(works, buffers, [shape for _, shape in receives], dtype, kind, sent)


# NOTE [Messages posted one by one where the backend does not batch them]
# ``batch_isend_irecv`` groups messages only on a backend that coalesces them (NCCL, where
# two ranks sending to each other must post in one group or deadlock); on gloo (which does not
# coalesce: ``supports_coalescing`` is False in torch 2.13) it calls ``isend`` and ``irecv``
# one by one, in order, after building a ``P2POp`` per message and checking the list. On gloo
# the messages are posted that same way directly, in the same order, with every buffer made
# before the first is posted: the same calls, messages and bytes, without the wrapper's
# Python (measured on 2 gloo ranks, one 512-byte message each way: 77 against 106 µs of the
# calling thread's CPU, medians of 11 paired rounds, load 20-24).
def _posted(group: AxisGroup, posts: list[tuple[Callable, torch.Tensor, int]]) -> list:
    """Post ``(dist.isend or dist.irecv, tensor, peer's rank in the group)`` in order; the
    works to wait for."""
    if not posts:
        return []
    if group.posts_one_by_one:
        return [
            dist.isend(t, group=group.group, group_dst=peer)
            if op is dist.isend
            else dist.irecv(t, group=group.group, group_src=peer)
            for op, t, peer in posts
        ]
    return dist.batch_isend_irecv(
        [dist.P2POp(op, t, group=group.group, group_peer=peer) for op, t, peer in posts]
    )


def send_recv(
    group: AxisGroup,
    sends: Sequence[tuple[int, torch.Tensor]],
    receives: Sequence[tuple[int, Sequence[int]]],
    *,
    dtype: torch.dtype,
    device: torch.device,
    kind: str = "p2p",
) -> list[torch.Tensor]:
    """Point-to-point messages, waited for (see ``start_send_recv``)."""
    return start_send_recv(group, sends, receives, dtype=dtype, device=device, kind=kind).wait()


def _traced_send_recv(
    group: AxisGroup,
    sends: Sequence[tuple[int, torch.Tensor]],
    receives: Sequence[tuple[int, Sequence[int]]],
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """``start_send_recv``'s messages in a compiled graph: one functional all-to-all (there is
    no functional point-to-point collective)."""
    send, send_bytes, recv_bytes, cut = _one_payload(group, sends, receives, dtype, device)
    return cut(_graph_collectives.all_to_all_single(send, recv_bytes, send_bytes, group.group))


def _one_payload(
    group: AxisGroup,
    sends: Sequence[tuple[int, torch.Tensor]],
    receives: Sequence[tuple[int, Sequence[int]]],
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, list[int], list[int], Callable[[torch.Tensor], list[torch.Tensor]]]:
    """Messages as one all-to-all's payload: the bytes sent, the split sizes sent to and
    received from each group rank (zero for every rank this one neither sends to nor
    receives from), and how to cut the received bytes into the messages, each pair's
    messages in order within its split."""
    to_rank: list[list[torch.Tensor]] = [[] for _ in range(group.size)]
    for dst, tensor in sends:
        to_rank[group.group_ranks[dst]].append(_as_bytes(tensor))
    from_rank: list[list[int]] = [[] for _ in range(group.size)]
    received_nbytes = []
    for src, shape in receives:
        received_nbytes.append(math.prod(shape) * dtype.itemsize)
        from_rank[group.group_ranks[src]].append(len(received_nbytes) - 1)
    flat = [payload for payloads in to_rank for payload in payloads]
    send = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8, device=device)
    send_bytes = [sum(p.numel() for p in payloads) for payloads in to_rank]
    recv_bytes = [sum(received_nbytes[i] for i in order) for order in from_rank]

    def cut(recv: torch.Tensor) -> list[torch.Tensor]:
        buffers: list[torch.Tensor] = [recv] * len(receives)
        start = 0
        for order in from_rank:
            for i in order:
                buffers[i] = recv[start : start + received_nbytes[i]]
                start += received_nbytes[i]
        return buffers

    return send.to(device), send_bytes, recv_bytes, cut
