"""Halo exchange: extend each rank's shard by its neighbours' cells and the boundary's,
in one buffer, differentiably.

# NOTE [An extended shard is assembled in one buffer]
An ``Extension`` takes, along each of some dims in turn, a global range of cells for every
rank (NOTE [Halos are ranges gathered across the boundary] in ``_halo_plan``; a dim that is
not sharded is a group of one). This rank's cells land in one buffer spanning, along each of
these dims, its own cells and its range: the shard is copied in once, then each dim is filled
in turn: neighbours' faces are written where they belong (one batched exchange per sharded
dim), boundary cells are copied within the buffer (periodic, reflect, replicate) or filled.
While a dim is filled, the dims filled before it span their whole range and the later ones
only the own cells, so the corners of a block decomposition arrive with the faces of the later
dims. The result is a view of the buffer: the shard is copied once, whatever the number of
dims, and nothing is copied when no rank's range differs from its own cells.
The backward pass is the exact adjoint in one buffer too: the gradient is copied in once, then
the dims are taken in reverse: each received run's gradient goes back to its owner, boundary
cells' gradients are added onto the cells they copy (reflected runs flipped back, replicated
runs summed onto the edge cell), and the own cells are the result.

# NOTE [Corners beyond a zeros boundary do not travel]
Cells beyond a zeros boundary of a dim filled earlier are filled by every rank itself, so the
messages of later dims carry only the range of domain cells along that dim (``_Step.real``):
on a block with a zeros boundary no corner of zeros travels (the lower bound).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F

from shardsci.tensor._box_packing import Narrowing, narrowed
from shardsci.tensor._caches import cached
from shardsci.tensor._collectives import AxisGroup, PendingMessages, axis_group, start_send_recv
from shardsci.tensor._first_order import first_order_only
from shardsci.tensor._halo_plan import HaloPlan, Run, domain_range, halo_plan
from shardsci.tensor._spec import ShardTensorSpec
from shardsci.tensor._streams import stream_ops
from shardsci.tensor._torch_compile import in_graph

__all__ = [
    "Extension",
    "added_to_owners",
    "extend",
    "extended",
    "extension",
    "halo_exchange",
    "pad_locally",
    "start_extend",
    "summed_to_owners",
]

# (dim, the range each member of the dim's group wants, boundary): one dim of an extension.
Request = tuple[int, tuple[tuple[int, int], ...], str]


@dataclass(frozen=True)
class _Step:
    """Filling one dim of the buffer.

    Attributes
    ----------
    dim : int
    plan : HaloPlan
        Every member's runs along ``dim``.
    group : AxisGroup or None
        The ranks sharding ``dim``; None when there is nobody else (not sharded, or one rank).
    me : int
        This rank's member index in ``plan``.
    origin : int
        The global index of the buffer's first cell along ``dim``.
    region : tuple of Narrowing
        Along the other dims of the extension, the cells this step covers (buffer
        coordinates): the wanted range of dims filled before, the own cells of later ones.
    real : tuple of Narrowing
        Within ``region`` (and along dims extended before the extension), the domain cells
        where they are not all of it (NOTE [Corners beyond a zeros boundary do not travel]):
        what messages carry.
    """

    dim: int
    plan: HaloPlan
    group: AxisGroup | None
    me: int
    origin: int
    region: tuple[Narrowing, ...]
    real: tuple[Narrowing, ...]

    @property
    def shift(self) -> int:
        """The buffer position of the first wanted cell."""
        return self.plan.ranges[self.me][0] - self.origin

    @cached_property
    def peers(self) -> tuple[tuple[int, tuple[Run, ...], tuple[Run, ...]], ...]:
        """``(member, runs this rank provides it, runs it provides this rank)`` for every other
        member with either: a rank's messages, found once per plan, not per exchange."""
        if self.group is None:
            return ()
        result = []
        for other in range(self.group.size):
            if other != self.me:
                to, from_ = self.plan.sent(self.me, other), self.plan.sent(other, self.me)
                if to or from_:
                    result.append((other, to, from_))
        return tuple(result)

    @cached_property
    def anyone_exchanges(self) -> bool:
        """Whether any two members of the group exchange cells along this dim: in a compiled
        graph every member then joins the step's collective, messages or not (NOTE [A traced
        collective is an effect])."""
        if self.group is None:
            return False
        return any(
            self.plan.sent(src, dst)
            for src in range(self.group.size)
            for dst in range(self.group.size)
            if src != dst
        )

    @cached_property
    def fills_only(self) -> bool:
        """Whether nobody in the group exchanges along this dim and this rank's cells are its
        own or the fill beyond a boundary (none copied from elsewhere in its own shard)."""
        return not self.anyone_exchanges and all(
            run.source is None or self.plan.is_direct(self.me, run)
            for run in self.plan.runs[self.me]
        )

    @cached_property
    def around(self) -> tuple[tuple[Narrowing, ...], tuple[Narrowing, ...]]:
        """Along the other dims, the region and the region's domain cells (``real``), each
        one narrowing per dim: what ``_view`` applies before the step's dim."""
        return self.region, _composed(self.region + self.real)

    @cached_property
    def filled_here(self) -> tuple[tuple[Run, tuple[Narrowing, ...], tuple[Narrowing, ...]], ...]:
        """``(run, place, source)`` for this rank's runs that it fills itself (the boundary's
        copies of its own cells; ``source`` is empty for the fill), where they lie in the
        buffer: found once per plan, not on every call (NOTE [Caches are keyed by value])."""
        return tuple(
            (run, self.narrowings(run.position + self.shift, run.length, False), source)
            for run in self.plan.runs[self.me]
            if run.source is None
            or (run.source == self.me and not self.plan.is_direct(self.me, run))
            for source in [
                ()
                if run.source is None
                else self.narrowings(run.start - self.origin, run.cells, False)
            ]
        )

    @cached_property
    def received(self) -> tuple[tuple[int, int, Run, tuple[Narrowing, ...]], ...]:
        """``(message, offset, run, place)`` for this rank's runs that others send: the
        message (by sender, in ``peers`` order) and where in it the run's cells start."""
        senders = [other for other, _, incoming in self.peers if incoming]
        cursor = dict.fromkeys(senders, 0)
        result = []
        for run in self.plan.runs[self.me]:
            if run.source is None or run.source == self.me:
                continue
            place = self.narrowings(run.position + self.shift, run.length, False)
            result.append((senders.index(run.source), cursor[run.source], run, place))
            cursor[run.source] += run.cells
        return tuple(result)

    def narrowings(self, start: int, length: int, real: bool) -> tuple[Narrowing, ...]:
        """Cells ``[start, start + length)`` along the step's dim, over its region (or only
        the region's domain cells)."""
        return (*self.around[real], (self.dim, start, length))

    def skips_exchange(self, sends: list, receives: list) -> bool:
        """Whether this rank posts nothing for the step: it has no messages, and where the
        step is one collective for the whole group (a compiled graph, or NOTE [An exchange
        of messages as one all-to-all where messages are slow]) nobody else has either."""
        if sends or receives or not self.anyone_exchanges:
            return not sends and not receives
        return not (in_graph() or self.group.messages_in_one_collective)


@dataclass(frozen=True)
class Extension:
    """This rank's part of an extension along some dims (see the NOTE above).

    Attributes
    ----------
    steps : tuple of _Step
        The dims, in the order they are filled.
    hull : tuple of (int, int)
        Per step, the buffer's extent along its dim.
    own, wanted : tuple of Narrowing
        Where the own cells and the wanted range lie in the buffer.
    identity : bool
        No rank wants anything but its own cells: nothing to do.
    """

    steps: tuple[_Step, ...]
    hull: tuple[tuple[int, int], ...]
    own: tuple[Narrowing, ...]
    wanted: tuple[Narrowing, ...]
    identity: bool

    def buffer_shape(self, shape: Sequence[int]) -> list[int]:
        result = list(shape)
        for dim, extent in self.hull:
            result[dim] = extent
        return result

    @cached_property
    def constant_pad(self) -> tuple[tuple[int, int, int], ...] | None:
        """``(dim, before, after)`` per step where the extension is this rank's shard padded
        with the fill and nothing moves (one rank, or dims no mesh axis splits), else None:
        then ``extend`` is one ``F.pad`` (NOTE [A local extension is a pad])."""
        if not all(step.fills_only for step in self.steps):
            return None
        widths = tuple(
            (dim, start, extent - start - length)
            for (dim, start, length), (_, extent) in zip(self.own, self.hull)
        )
        # An empty shard's hull may lie beside its own (empty) range: no pad of it.
        return None if any(before < 0 or after < 0 for _, before, after in widths) else widths

    @property
    def wanted_is_whole(self) -> bool:
        return all(n[2] == extent for n, (_, extent) in zip(self.wanted, self.hull))


@cached("halo extensions", 4096)
def extension(
    spec: ShardTensorSpec, requests: tuple[Request, ...], prior_real: tuple[Narrowing, ...] = ()
) -> Extension:
    """Plan this rank's extension of a shard of ``spec`` (cached per layout and request).

    Parameters
    ----------
    requests : tuple of (dim, ranges, boundary)
        The dims to extend, in order; ``ranges`` holds the global range every member of the
        dim's group wants (one range when the dim is not sharded).
    prior_real : tuple of Narrowing
        Along dims extended beforehand (not in ``requests``), where the domain cells lie,
        for those whose range holds cells beyond a zeros boundary.
    """
    dims = []
    for dim, ranges, boundary in requests:
        sharding = spec.sharding_by_dim.get(dim)
        if sharding is None:
            plan, group, me = halo_plan((spec.shape[dim],), ranges, boundary), None, 0
        else:
            group = axis_group(spec.mesh, sharding.axes)
            plan, me = halo_plan(sharding.sizes, ranges, boundary), group.index
            group = group if group.size > 1 else None
        dims.append((dim, plan, group, me, boundary, spec.shape[dim]))
    hull, own, wanted, origins = [], [], [], []
    for dim, plan, _, me, _, _ in dims:
        own_lo, own_hi = plan.offsets[me], plan.offsets[me] + plan.sizes[me]
        lo, hi = plan.ranges[me]
        if hi <= lo:
            lo = hi = own_lo
        start = min(lo, own_lo) if own_hi > own_lo else lo
        stop = max(hi, own_hi) if own_hi > own_lo else hi
        origins.append(start)
        hull.append((dim, stop - start))
        # an empty shard may lie outside the range it wants (a pad of a dim with no cell
        # reads only padding): its no cells are placed at the nearest end of the buffer
        own_start = own_lo - start if own_hi > own_lo else min(max(own_lo - start, 0), stop - start)
        own.append((dim, own_start, own_hi - own_lo))
        wanted.append((dim, lo - start, hi - lo))
    steps = []
    for i, (dim, plan, group, me, _, _) in enumerate(dims):
        region = tuple(wanted[:i]) + tuple(own[i + 1 :])
        real = tuple(
            part
            for j in range(i)
            if (part := _domain_part(*dims[j], wanted[j]))[1:] != (0, wanted[j][2])
        )
        steps.append(_Step(dim, plan, group, me, origins[i], region, real + prior_real))
    return Extension(
        tuple(steps),
        tuple(hull),
        tuple(own),
        tuple(wanted),
        all(plan.moves_nothing() for _, plan, *_ in dims),
    )


def _domain_part(dim, plan, group, me, boundary, extent, wanted) -> Narrowing:
    """The domain cells of a wanted range, relative to it (all of it unless zeros)."""
    if boundary != "zeros":
        return (dim, 0, wanted[2])
    lo, hi = plan.ranges[me]
    if hi <= lo:
        return (dim, 0, 0)
    _, start, stop = domain_range(dim, lo, hi, extent)
    return (dim, start, stop - start)


# ---------------------------------------------------------------------------- steps
def _view(t: torch.Tensor, step: _Step, start: int, length: int, real: bool) -> torch.Tensor:
    """Cells ``[start, start + length)`` of ``t`` along the step's dim, over its region (or
    only the region's domain cells)."""
    return narrowed(t, step.narrowings(start, length, real))


def _composed(narrowings: tuple[Narrowing, ...]) -> tuple[Narrowing, ...]:
    """Narrowings applied one after the other, as one per dim."""
    by_dim: dict[int, tuple[int, int]] = {}
    for dim, start, length in narrowings:
        before = by_dim.get(dim, (0, 0))[0]
        by_dim[dim] = (before + start, length)
    return tuple((dim, start, length) for dim, (start, length) in by_dim.items())


def _message_shape(t: torch.Tensor, step: _Step, cells: int) -> list[int]:
    """The shape of a message of ``cells`` cells along the step's dim, cut from ``t``."""
    shape = list(t.shape)
    for dim, _, length in step.around[True]:
        shape[dim] = length
    shape[step.dim] = cells
    return shape


def _post(
    source: torch.Tensor, origin: int, step: _Step, keep: list | None = None
) -> PendingMessages | None:
    """Send every member the cells of this rank it wants (taken from ``source``, whose first
    cell along the dim is global ``origin``) and post the receives of this rank's. With
    ``keep``, the messages are packed contiguous and kept there (NOTE [Halo overlap on
    streams])."""
    dim = step.dim
    sends, receives = [], []
    for other, outgoing, incoming in step.peers:
        if outgoing:
            parts = [_view(source, step, r.start - origin, r.cells, real=True) for r in outgoing]
            sends.append((other, _message(parts, dim, keep)))
        if incoming:
            receives.append((other, _message_shape(source, step, sum(r.cells for r in incoming))))
    return _exchange(step, sends, receives, source)


def _message(parts: list[torch.Tensor], dim: int, keep: list | None) -> torch.Tensor:
    """The runs ``parts`` sent to one peer as one message, joined along ``dim`` (packed
    contiguous and kept in ``keep`` where given)."""
    message = torch.cat(parts, dim) if len(parts) > 1 else parts[0]
    if keep is not None:
        message = message.contiguous()
        keep.append(message)
    return message


def _exchange(
    step: _Step, sends: list, receives: list, like: torch.Tensor
) -> PendingMessages | None:
    """Post the step's messages, in ``like``'s dtype and device, or nothing where this rank
    takes no part in the step (``_Step.skips_exchange``)."""
    if step.skips_exchange(sends, receives):
        return None
    return start_send_recv(
        step.group,
        sends,
        receives,
        dtype=like.dtype,
        device=like.device,
        kind="halo",
        everyone_joins=True,
    )


def _fill(
    buffer: torch.Tensor,
    step: _Step,
    pending: PendingMessages | _SideExchange | None,
    fill: float,
) -> None:
    """Fill the step's dim of ``buffer``: boundary cells now, received cells when they come."""
    for run, place, source in step.filled_here:
        target = narrowed(buffer, place)
        if run.source is None:
            target.fill_(fill)
        else:
            _place(target, narrowed(buffer, source), run, step.dim)
    if pending is None:
        return
    messages = pending.wait()
    for message, offset, run, place in step.received:
        target = narrowed(buffer, place)
        if step.real:
            target.fill_(fill)
            target = narrowed(target, step.real)
        _place(target, messages[message].narrow(step.dim, offset, run.cells), run, step.dim)


def _place(target: torch.Tensor, cells: torch.Tensor, run: Run, dim: int) -> None:
    if run.reversed:
        cells = cells.flip(dim)
    target.copy_(cells.expand_as(target) if run.repeated else cells)


def _run_grad(grad: torch.Tensor, run: Run, dim: int) -> torch.Tensor:
    """The gradient of a run's source cells from the gradient of its place."""
    if run.reversed:
        grad = grad.flip(dim)
    return grad.sum(dim, keepdim=True) if run.repeated else grad


def _fold_boundary(grad: torch.Tensor, step: _Step) -> None:
    """Add boundary cells' gradients onto the cells they copy."""
    for run, place, source in step.filled_here:
        if run.source is not None:
            narrowed(grad, source).add_(_run_grad(narrowed(grad, place), run, step.dim))


def _post_adjoint(
    grad: torch.Tensor, step: _Step, keep: list | None = None
) -> PendingMessages | None:
    """Send every other member the gradient of the cells it provided, post the receives of
    the gradients of this rank's (``keep`` as for ``_post``)."""
    dim = step.dim
    sends, receives = [], []
    for other, used, provided in step.peers:
        if provided:
            parts = [
                _run_grad(_view(grad, step, r.position + step.shift, r.length, True), r, dim)
                for r in provided
            ]
            sends.append((other, _message(parts, dim, keep)))
        if used:
            receives.append((other, _message_shape(grad, step, sum(r.cells for r in used))))
    return _exchange(step, sends, receives, grad)


def _add_received(
    grad: torch.Tensor, origin: int, step: _Step, pending: PendingMessages | _SideExchange | None
) -> None:
    """Add to this rank's cells (of ``grad``, first cell ``origin``) the gradients that the
    others computed for them."""
    if pending is None:
        return
    dim = step.dim
    receivers = [used for _, used, _ in step.peers if used]
    for used, message in zip(receivers, pending.wait()):
        position = 0
        for run in used:
            _view(grad, step, run.start - origin, run.cells, real=True).add_(
                message.narrow(dim, position, run.cells)
            )
            position += run.cells


def _grad_buffer(grad: torch.Tensor, ext: Extension) -> torch.Tensor:
    """The gradient of the wanted cells in a buffer of our own, spanning the hull."""
    if ext.wanted_is_whole:
        return grad.clone(memory_format=torch.contiguous_format)
    buffer = grad.new_zeros(ext.buffer_shape(grad.shape))
    narrowed(buffer, ext.wanted).copy_(grad)
    return buffer


# ---------------------------------------------------------------------------- autograd
class _Extend(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, ext: Extension, fill: float) -> torch.Tensor:  # type: ignore[override]
        ctx.ext = ext
        return extended(local, ext, fill)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return summed_to_owners(grad, ctx.ext), None, None


class _AddedToOwners(torch.autograd.Function):
    """``added_to_owners`` in a backward that builds a graph: its adjoint is the extension
    (with zeros beyond the boundary), so a second derivative through a halo is one more
    exchange (NOTE [Second derivatives through ShardTensors] in ``_api.py``)."""

    @staticmethod
    def forward(ctx: Any, extended: torch.Tensor, ext: Extension) -> torch.Tensor:  # type: ignore[override]
        ctx.ext = ext
        return added_to_owners(extended, ext)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return extend(grad.contiguous(), ctx.ext), None


def summed_to_owners(grad: torch.Tensor, ext: Extension) -> torch.Tensor:
    """``added_to_owners(grad, ext)``, differentiable where a backward builds a graph."""
    if grad.requires_grad and torch.is_grad_enabled():
        return _AddedToOwners.apply(grad, ext)
    return added_to_owners(grad, ext)


def extended(local: torch.Tensor, ext: Extension, fill: float = 0.0) -> torch.Tensor:
    """``extend``'s result, built without autograd (the forward of its autograd Function)."""
    buffer = local.new_empty(ext.buffer_shape(local.shape))
    narrowed(buffer, ext.own).copy_(local)
    for step in ext.steps:
        _fill(buffer, step, _post(buffer, step.origin, step), fill)
    return narrowed(buffer, ext.wanted)


def added_to_owners(extended: torch.Tensor, ext: Extension) -> torch.Tensor:
    """The adjoint of ``extend`` (not differentiable): this rank's shard of the cells
    ``extended`` holds (shaped as ``extend``'s output), plus what the other ranks' extended
    cells hold of it. Moves as many cells as ``extend``, the other way."""
    if ext.identity:
        return extended
    buffer = _grad_buffer(extended, ext)
    for step in reversed(ext.steps):
        _fold_boundary(buffer, step)
        _add_received(buffer, step.origin, step, _post_adjoint(buffer, step))
    return narrowed(buffer, ext.own)


# NOTE [A local extension is a pad]
# Where no rank exchanges anything and this rank's extension holds only its own cells and the
# fill beyond a zeros boundary (a one-rank mesh, a dim no mesh axis splits), the buffer is
# ``F.pad`` of the shard with the fill: one aten op whose backward torch runs in C++, where
# ``_Extend`` builds the buffer in pieces and folds the gradient back in Python.
def extend(local: torch.Tensor, ext: Extension, fill: float = 0.0) -> torch.Tensor:
    """This rank's shard ``local`` extended as ``ext`` plans (``fill``: the value beyond a
    zeros boundary, e.g. ``-inf`` for max pooling). Differentiable; ``local`` itself when
    nothing moves."""
    if ext.identity:
        return local
    widths = ext.constant_pad
    if widths is None:
        return _Extend.apply(local, ext, fill)
    pad = dict.fromkeys(range(min(w[0] for w in widths), local.ndim), (0, 0))
    pad.update((dim, (before, after)) for dim, before, after in widths)
    padded = F.pad(local, [w for dim in reversed(pad) for w in pad[dim]], value=fill)
    return narrowed(padded, ext.wanted)


# NOTE [A halo exchange in two halves]
# For the overlap option of windowed ops, the exchange of one dim is split into two autograd
# Functions sharing an ``_InFlight`` record: ``_Post`` sends this rank's cells and returns the
# shard itself, ``_Finish`` assembles the extended shard. Between them a caller computes on
# the shard while messages are in flight. Backward mirrors it: ``_Finish`` posts the halo
# gradients to their owners and keeps the gradient of the own cells; ``_Post`` waits for the
# gradients of its cells that others used and adds them.


# NOTE [Halo overlap on streams]
# On an accelerator, each half of an overlapped exchange packs and posts its messages on a side
# stream of the device (one per device, ``_streams.DeviceStreams.side_stream``), so that the
# interior's kernels on the current (consumer) stream overlap the packing and the messages:
# - Posting: an event recorded on the consumer stream after the shard's producer, waited on by
#   the side stream, orders the packing after the shard is written; the messages are packed
#   contiguous on the side stream and posted there (NCCL's stream then waits on the side one).
# - Waiting (``_SideExchange.wait``): ``Work.wait()`` runs with the side stream current, so the
#   side stream waits for the messages without blocking the host; an event recorded on it,
#   waited on by the consumer stream, orders the unpack (``_fill``, ``_add_received``) after
#   the receives. The received tensors, allocated on the side stream, are marked
#   ``record_stream(consumer)`` so the allocator does not hand their memory to the side stream
#   while the consumer still reads it.
# - Lifetimes: the tensors the side stream reads (the shard, the gradient buffer) and the
#   packed messages are held by the in-flight record until the consumer stream waited for the
#   side stream, after which freeing them (on either stream) is ordered after every use.
# - Backward: the boundary cells' gradients are folded in on the consumer stream before the
#   side stream packs (the side stream only reads the gradient buffer, never writes it).
# Autograd runs each half's backward on the stream its forward ran on, the consumer's.
# ``record_stream`` covers a consumer other than the stream that posted (the side stream
# otherwise waits on the consumer before its next use, which already orders reuse).
# On a device without streams (CPU, meta) ``side_stream`` is None and both halves run as they
# did before (no stream or event object is created); posting on the current stream is also
# right on CUDA, by reading ProcessGroupNCCL: its stream waits on the current one before the
# messages, keeps their tensors (record_stream, or stashed until ``wait``), and ``wait`` makes
# the current stream, which allocated the receive buffers and unpacks them, wait for it.
# Verified on the CPU: that path (tests/test_overlap.py), and the stream path's order against
# a recording stand-in for ``DeviceStreams`` on 2 gloo ranks, judged by a race and lifetime
# check over every aten op with messages ordered as ProcessGroupNCCL orders them
# (tests/test_overlap_streams.py; it fails with either event wait or the held tensors
# removed; the ``record_stream`` calls are not checked there). Only on a GPU, never run yet
# (tests/test_gpu.py, run by ``scripts/gpu_check.sh``): the real streams and events on torch
# 2.11-2.13, an overlapped convolution in a world of one rank (no message), and the side
# stream ordered after a slow producer and before the consumer. Halos between ranks over
# NCCL have not run anywhere.


class _SideExchange:
    """Messages posted on a side stream (NOTE [Halo overlap on streams]): ``wait`` orders the
    consumer stream after them and then releases what the side stream used."""

    def __init__(
        self, pending: PendingMessages, side: Any, device: torch.device, keep: list
    ) -> None:
        self.pending, self.side, self.device, self.keep = pending, side, device, keep

    def wait(self) -> list[torch.Tensor]:
        ops = stream_ops()
        with ops.using(self.side):
            messages = self.pending.wait()
        consumer = ops.current_stream(self.device)
        ops.wait_event(consumer, ops.record_event(self.side))
        for message in messages:
            ops.record_stream(message, consumer)
        self.keep = []
        return messages


def _posted_aside(
    post: Callable[[list | None], PendingMessages | None], source: torch.Tensor
) -> PendingMessages | _SideExchange | None:
    """``post(keep)`` on the side stream of ``source``'s device, after the work queued on the
    current stream; ``post(None)`` where the device has no streams, and in a compiled graph
    (whose functional collectives the compiler orders)."""
    ops = stream_ops()
    side = None if in_graph() else ops.side_stream(source.device)
    if side is None:
        return post(None)
    ops.wait_event(side, ops.record_event(ops.current_stream(source.device)))
    keep = [source]
    with ops.using(side):
        pending = post(keep)
    return None if pending is None else _SideExchange(pending, side, source.device, keep)


class _InFlight:
    """Messages posted by one half of a halo exchange, for the other half to wait on."""

    forward: PendingMessages | _SideExchange | None = None
    backward: PendingMessages | _SideExchange | None = None


class _Post(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, ext: Extension, state: _InFlight) -> torch.Tensor:  # type: ignore[override]
        step = ext.steps[0]
        ctx.step, ctx.state = step, state
        ctx.origin = step.plan.offsets[step.me]
        state.forward = _posted_aside(lambda keep: _post(local, ctx.origin, step, keep), local)
        return local.view_as(local)

    @staticmethod
    @first_order_only("an overlapped halo exchange (overlap_halos)")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        pending, ctx.state.backward = ctx.state.backward, None
        if pending is not None:
            grad = grad.clone()
            _add_received(grad, ctx.origin, ctx.step, pending)
        return grad, None, None


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, shard: torch.Tensor, ext: Extension, fill: float, state: _InFlight
    ) -> torch.Tensor:
        ctx.ext, ctx.state = ext, state
        pending, state.forward = state.forward, None
        buffer = shard.new_empty(ext.buffer_shape(shard.shape))
        narrowed(buffer, ext.own).copy_(shard)
        _fill(buffer, ext.steps[0], pending, fill)
        return narrowed(buffer, ext.wanted)

    @staticmethod
    @first_order_only("an overlapped halo exchange (overlap_halos)")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        buffer, step = _grad_buffer(grad, ctx.ext), ctx.ext.steps[0]
        _fold_boundary(buffer, step)
        ctx.state.backward = _posted_aside(lambda keep: _post_adjoint(buffer, step, keep), buffer)
        return narrowed(buffer, ctx.ext.own), None, None, None


def start_extend(
    local: torch.Tensor, ext: Extension, fill: float = 0.0
) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """Post the exchange of a one-dim extension; compute on the returned shard meanwhile.

    Returns
    -------
    shard : Tensor
        ``local`` itself (use it, not ``local``, for work done while messages fly, so that
        gradients meet in the right order).
    finish : callable
        Waits and returns the extended shard, as ``extend`` would.
    """
    if len(ext.steps) != 1:
        raise ValueError(f"start_extend takes a one-dim extension, got {len(ext.steps)} dims")
    state = _InFlight()
    shard = _Post.apply(local, ext, state)
    return shard, lambda: _Finish.apply(shard, ext, fill, state)


# ---------------------------------------------------------------------------- public
def halo_exchange(
    x: torch.Tensor,
    widths: Mapping[int, int | tuple[int, int]],
    boundary: str | Mapping[int, str] = "zeros",
) -> torch.Tensor:
    """This rank's shard of ``x`` extended by halos, as a plain tensor. Differentiable.

    Parameters
    ----------
    x : ShardTensor
        Sharded along any of the dims in ``widths`` (slab or block decomposition).
    widths : dict
        Tensor dim -> halo width, or (left, right) widths.
    boundary : str or dict
        ``zeros``, ``periodic``, ``reflect`` or ``replicate``, for all dims or per dim:
        what lies beyond the domain edge. Unsharded dims are padded locally the same way.

    Returns
    -------
    Tensor
        Shape of this rank's shard plus ``left + right`` along each dim in ``widths``.
    """
    spec = x._spec
    requests = []
    for dim in sorted(d % x.ndim for d in widths):
        left, right = _pair(widths[dim] if dim in widths else widths[dim - x.ndim])
        mode = boundary if isinstance(boundary, str) else boundary.get(dim, "zeros")
        sharding = spec.sharding_by_dim.get(dim)
        sizes = sharding.sizes if sharding is not None else (spec.shape[dim],)
        offsets = [sum(sizes[:k]) for k in range(len(sizes))]
        ranges = tuple((o - left, o + s + right) for o, s in zip(offsets, sizes))
        requests.append((dim, ranges, mode))
    return extend(x.to_local(), extension(spec, tuple(requests)))


def _pair(width: int | tuple[int, int]) -> tuple[int, int]:
    left, right = (width, width) if isinstance(width, int) else width
    if left < 0 or right < 0:
        raise ValueError(f"halo widths must be non-negative, got {(left, right)}")
    return left, right


def pad_locally(local: torch.Tensor, dim: int, left: int, right: int, fill: float) -> torch.Tensor:
    """Pad a dim of ``local`` with ``fill`` on this rank alone (no neighbour involved). The
    result is laid out like ``local`` (contiguous when it is): kernels such as max_pool3d on an
    unbatched input refuse a tensor whose strides look channels-last."""
    if left == right == 0:
        return local

    def filled(width: int) -> list[torch.Tensor]:
        shape = list(local.shape)
        shape[dim] = width
        return [local.new_full(shape, fill)] if width else []

    return torch.cat([*filled(left), local, *filled(right)], dim)
