"""Halo exchange: extend each rank's shard by the cells of its neighbours, differentiably.

# NOTE [Halos are ranges gathered across the boundary]
Along one sharded dim each rank asks for a global index range ``[lo, hi)``: its own cells
plus halos, possibly beyond the domain (``lo < 0``, ``hi > extent``). The range is cut into
runs: cells inside the domain come from the ranks that own them (several, when shards are
narrower than the halo, empty shards included); cells outside follow the boundary:
``zeros``; ``periodic`` (index modulo the extent); ``reflect`` (mirrored about the edge cell,
as ``F.pad(mode="reflect")``); ``replicate`` (the edge cell repeated). Every rank computes
every rank's runs from the layout, so each pair of ranks exchanges at most one message per
dim, point to point, holding exactly the cells the receiver lacks: for halos no wider than the
neighbouring shards that is one message per neighbour, the face, the lower bound.
Several dims are extended one after the other, each on the tensor already extended along the
previous dims, so edges and corners of 2-D and 3-D block decompositions arrive with the faces
of the later dims.
The backward pass is the exact adjoint: each received run's gradient goes back to its owner
(reflected runs flipped back, replicated runs summed onto the edge cell) and is added there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardsci.tensor._caches import cached
from shardsci.tensor._collectives import (
    AxisGroup,
    PendingMessages,
    axis_group,
    start_send_recv,
)
from shardsci.tensor._spec import ShardTensorSpec, mesh_coordinate

__all__ = [
    "BOUNDARIES",
    "HaloPlan",
    "domain_range",
    "extend_dim",
    "halo_exchange",
    "halo_plan",
    "pad_locally",
    "start_extend",
]

BOUNDARIES = ("zeros", "periodic", "reflect", "replicate")


@dataclass(frozen=True)
class _Run:
    """A contiguous run of the extended shard along the dim.

    Attributes
    ----------
    position, length : int
        Where the run lies in the extended shard.
    source : int or None
        Flat group index of the owner of its cells; None for zeros.
    start : int
        First global index of the owner's cells it copies (ascending).
    reversed : bool
        Placed flipped (reflect boundary).
    repeated : bool
        One cell repeated ``length`` times (replicate boundary).
    """

    position: int
    length: int
    source: int | None
    start: int
    reversed: bool = False
    repeated: bool = False

    @property
    def cells(self) -> int:
        """Cells taken from the source."""
        return 1 if self.repeated else self.length


@dataclass(frozen=True)
class HaloPlan:
    """Every rank's runs for one dim: ``runs[k]`` builds member ``k``'s extended shard.

    ``real`` lists, for dims extended before this one, the range ``(dim, start, stop)`` that
    holds cells of the domain; outside it lie cells beyond a zeros boundary, which every rank
    fills itself, so messages carry only the real range (the lower bound on blocks: no corner
    of zeros travels).
    """

    dim: int
    offsets: tuple[int, ...]
    runs: tuple[tuple[_Run, ...], ...]
    extents: tuple[int, ...]
    real: tuple[tuple[int, int, int], ...] = ()

    def sent(self, src: int, dst: int) -> list[_Run]:
        return [r for r in self.runs[dst] if r.source == src]


@cached("halo plans", 4096)
def halo_plan(
    dim: int,
    sizes: tuple[int, ...],
    ranges: tuple[tuple[int, int], ...],
    boundary: str,
    real: tuple[tuple[int, int, int], ...] = (),
) -> HaloPlan:
    """Runs for every member, from the shard sizes along ``dim`` and the wanted ranges."""
    if boundary not in BOUNDARIES:
        raise ValueError(f"unknown boundary {boundary!r}; expected one of {BOUNDARIES}")
    extent = sum(sizes)
    offsets = tuple(sum(sizes[:k]) for k in range(len(sizes)))
    runs = tuple(tuple(_runs(lo, hi, extent, offsets, sizes, boundary)) for lo, hi in ranges)
    return HaloPlan(dim, offsets, runs, tuple(hi - lo for lo, hi in ranges), real)


def _runs(
    lo: int, hi: int, extent: int, offsets: tuple[int, ...], sizes: tuple[int, ...], boundary: str
) -> list[_Run]:
    result: list[_Run] = []
    position = 0
    for start, stop, reverse, repeat in _sources(lo, hi, extent, boundary):
        if start is None:
            result.append(_Run(position, stop, None, 0))
            position += stop
            continue
        if repeat:
            owner = _owner(start, offsets, sizes)
            result.append(_Run(position, stop, owner, start, repeated=True))
            position += stop
            continue
        pieces = _split_by_owner(start, stop, offsets, sizes)
        for owner, a, b in reversed(pieces) if reverse else pieces:
            result.append(_Run(position, b - a, owner, a, reversed=reverse))
            position += b - a
    return result


def _sources(
    lo: int, hi: int, extent: int, boundary: str
) -> list[tuple[int | None, int, bool, bool]]:
    """``[lo, hi)`` as source runs: (start, stop, reversed, repeated); repeated runs are
    (cell, count, False, True) and zero runs (None, count, False, False)."""
    if hi <= lo:
        return []
    inside = (max(lo, 0), min(hi, extent))
    left, right = max(0, min(hi, 0) - lo), max(0, hi - max(lo, extent))
    if (left or right) and extent == 0:
        raise ValueError("cannot pad a dim of size 0 by its boundary")
    runs: list[tuple[int | None, int, bool, bool]] = []
    if left:
        runs += _outside(lo, min(hi, 0), extent, boundary)
    if inside[0] < inside[1]:
        runs.append((inside[0], inside[1], False, False))
    if right:
        runs += _outside(max(lo, extent), hi, extent, boundary)
    return runs


def _outside(
    a: int, b: int, extent: int, boundary: str
) -> list[tuple[int | None, int, bool, bool]]:
    """Source runs for indices ``[a, b)`` entirely below 0 or at/after ``extent``."""
    below = b <= 0
    if boundary == "zeros":
        return [(None, b - a, False, False)]
    if boundary == "replicate":
        return [(0 if below else extent - 1, b - a, False, True)]
    if boundary == "reflect":
        reach = -a if below else b - extent
        if reach > extent - 1:
            raise ValueError(
                f"reflect padding of {reach} needs a dim longer than {reach}, got {extent}"
            )
        if below:
            return [(-b + 1, -a + 1, True, False)]
        return [(2 * extent - 1 - b, 2 * extent - 1 - a, True, False)]
    runs = []
    index = a
    while index < b:
        period = index // extent
        stop = min(b, (period + 1) * extent)
        runs.append((index - period * extent, stop - period * extent, False, False))
        index = stop
    return runs


def _owner(index: int, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> int:
    return max(k for k in range(len(sizes)) if offsets[k] <= index and sizes[k])


def _split_by_owner(
    start: int, stop: int, offsets: tuple[int, ...], sizes: tuple[int, ...]
) -> list[tuple[int, int, int]]:
    pieces = []
    for k, (offset, size) in enumerate(zip(offsets, sizes)):
        a, b = max(start, offset), min(stop, offset + size)
        if a < b:
            pieces.append((k, a, b))
    return pieces


# ---------------------------------------------------------------------------- execution
# NOTE [A halo exchange in two halves]
# Posting the messages and assembling the extended shard are separate autograd Functions,
# ``_Post`` (returns the shard itself) and ``_Finish`` (returns the extended shard), sharing
# an ``_InFlight`` record. Between them a caller may compute on the shard while messages are
# in flight (the overlap option of windowed ops). Backward mirrors it: ``_Finish`` posts the
# halo gradients to their owners and keeps the gradient of the shard's own cells; ``_Post``
# waits for the gradients of its cells that others used and adds them. ``extend_dim`` runs
# the two halves back to back.


class _InFlight:
    """Messages posted by one half of a halo exchange, for the other half to wait on."""

    forward: PendingMessages | None = None
    backward: PendingMessages | None = None


def _take(local: torch.Tensor, plan: HaloPlan, me: int, run: _Run) -> torch.Tensor:
    return local.narrow(plan.dim, run.start - plan.offsets[me], run.cells)


def _with_dim(shape: Sequence[int], dim: int, size: int) -> list[int]:
    return [*shape[:dim], size, *shape[dim + 1 :]]


def _real(t: torch.Tensor, plan: HaloPlan) -> torch.Tensor:
    """The part of ``t`` along earlier-extended dims that holds domain cells."""
    for dim, start, stop in plan.real:
        t = t.narrow(dim, start, stop - start)
    return t


def _message_shape(shape: Sequence[int], plan: HaloPlan, cells: int) -> list[int]:
    result = _with_dim(shape, plan.dim, cells)
    for dim, start, stop in plan.real:
        result[dim] = stop - start
    return result


def _post(local: torch.Tensor, plan: HaloPlan, group: AxisGroup) -> PendingMessages:
    """Send every neighbour the cells it needs from this shard; post the receives."""
    me, dim = group.index, plan.dim
    sends, receives = [], []
    for other in range(group.size):
        if other == me:
            continue
        outgoing = plan.sent(me, other)
        if outgoing:
            parts = [_real(_take(local, plan, me, r), plan) for r in outgoing]
            sends.append((other, torch.cat(parts, dim) if len(parts) > 1 else parts[0]))
        incoming = plan.sent(other, me)
        if incoming:
            cells = sum(r.cells for r in incoming)
            receives.append((other, _message_shape(local.shape, plan, cells)))
    return start_send_recv(
        group, sends, receives, dtype=local.dtype, device=local.device, kind="halo"
    )


def _assemble(
    local: torch.Tensor, plan: HaloPlan, group: AxisGroup, fill: float, pending: PendingMessages
) -> torch.Tensor:
    me, dim = group.index, plan.dim
    senders = [other for other in range(group.size) if other != me and plan.sent(other, me)]
    messages = dict(zip(senders, pending.wait()))
    out = local.new_empty(_with_dim(local.shape, dim, plan.extents[me]))
    cursor = dict.fromkeys(messages, 0)
    for run in plan.runs[me]:
        target = out.narrow(dim, run.position, run.length)
        if run.source is None:
            target.fill_(fill)
            continue
        if run.source == me:
            cells = _take(local, plan, me, run)
        else:
            cells = messages[run.source].narrow(dim, cursor[run.source], run.cells)
            cursor[run.source] += run.cells
            if plan.real:
                target.fill_(fill)
                target = _real(target, plan)
        if run.reversed:
            cells = cells.flip(dim)
        target.copy_(cells.expand_as(target) if run.repeated else cells)
    return out


def _run_grad(grad: torch.Tensor, dim: int, run: _Run) -> torch.Tensor:
    piece = grad.narrow(dim, run.position, run.length)
    if run.reversed:
        piece = piece.flip(dim)
    return piece.sum(dim, keepdim=True) if run.repeated else piece


def _post_adjoint(
    grad: torch.Tensor, plan: HaloPlan, group: AxisGroup, local_shape: Sequence[int]
) -> tuple[torch.Tensor, PendingMessages]:
    """Gradient of the shard's own cells, and the halo gradients posted to their owners."""
    me, dim = group.index, plan.dim
    own = grad.new_zeros(local_shape)
    for run in plan.runs[me]:
        if run.source == me:
            _take(own, plan, me, run).add_(_run_grad(grad, dim, run))
    sends, receives = [], []
    for other in range(group.size):
        if other == me:
            continue
        outgoing = plan.sent(other, me)
        if outgoing:
            parts = [_real(_run_grad(grad, dim, r), plan) for r in outgoing]
            sends.append((other, torch.cat(parts, dim) if len(parts) > 1 else parts[0]))
        incoming = plan.sent(me, other)
        if incoming:
            cells = sum(r.cells for r in incoming)
            receives.append((other, _message_shape(local_shape, plan, cells)))
    pending = start_send_recv(
        group, sends, receives, dtype=grad.dtype, device=grad.device, kind="halo"
    )
    return own, pending


def _add_received(
    grad: torch.Tensor, plan: HaloPlan, group: AxisGroup, pending: PendingMessages
) -> torch.Tensor:
    """Add the gradients other ranks computed for this shard's cells."""
    me, dim = group.index, plan.dim
    receivers = [other for other in range(group.size) if other != me and plan.sent(me, other)]
    received = pending.wait()
    if not receivers:
        return grad
    grad = grad.clone()
    for other, message in zip(receivers, received):
        position = 0
        for run in plan.sent(me, other):
            _real(_take(grad, plan, me, run), plan).add_(message.narrow(dim, position, run.cells))
            position += run.cells
    return grad


class _Post(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, local: torch.Tensor, plan: HaloPlan, group: AxisGroup, state: _InFlight
    ) -> torch.Tensor:
        ctx.plan, ctx.group, ctx.state = plan, group, state
        state.forward = _post(local, plan, group)
        return local.view_as(local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        pending = ctx.state.backward
        ctx.state.backward = None
        return _add_received(grad, ctx.plan, ctx.group, pending), None, None, None


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        local: torch.Tensor,
        plan: HaloPlan,
        group: AxisGroup,
        fill: float,
        state: _InFlight,
    ) -> torch.Tensor:
        ctx.plan, ctx.group, ctx.state, ctx.shape = plan, group, state, local.shape
        pending = state.forward
        state.forward = None
        return _assemble(local, plan, group, fill, pending)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:  # type: ignore[override]
        own, ctx.state.backward = _post_adjoint(grad.contiguous(), ctx.plan, ctx.group, ctx.shape)
        return own, None, None, None, None


def start_extend(
    local: torch.Tensor,
    spec: ShardTensorSpec,
    dim: int,
    ranges: Sequence[tuple[int, int]],
    boundary: str,
    fill: float = 0.0,
    real: Sequence[tuple[int, int, int]] = (),
) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """Post the halo exchange of ``extend_dim``; compute on the returned shard meanwhile.

    Returns
    -------
    shard : Tensor
        ``local`` itself (use it, not ``local``, for work done while messages fly, so that
        gradients meet in the right order).
    finish : callable
        Waits and returns the extended shard, as ``extend_dim`` would.
    """
    sharding = spec.sharding_by_dim[dim]
    group = axis_group(spec.mesh, sharding.axes)
    plan = halo_plan(dim, sharding.sizes, tuple(map(tuple, ranges)), boundary, tuple(real))
    state = _InFlight()
    shard = _Post.apply(local, plan, group, state)
    return shard, lambda: _Finish.apply(shard, plan, group, fill, state)


def extend_dim(
    local: torch.Tensor,
    spec: ShardTensorSpec,
    dim: int,
    ranges: Sequence[tuple[int, int]],
    boundary: str,
    fill: float = 0.0,
    real: Sequence[tuple[int, int, int]] = (),
) -> torch.Tensor:
    """This rank's cells ``[lo, hi)`` of sharded ``dim``, from whoever holds them.

    Parameters
    ----------
    local : Tensor
        This rank's shard, possibly already extended along other dims; differentiable.
    spec : ShardTensorSpec
        The layout ``local`` is a shard of (along ``dim``).
    dim : int
        A dim sharded in ``spec``.
    ranges : sequence of (int, int)
        The global range each member of the dim's group wants, by flat index; every rank
        passes the same.
    boundary : str
        One of ``zeros``, ``periodic``, ``reflect``, ``replicate``.
    fill : float
        The value of cells beyond a ``zeros`` boundary (e.g. ``-inf`` for max pooling).
    real : sequence of (dim, start, stop)
        For dims of ``local`` already extended beyond a ``zeros`` boundary, where its domain
        cells lie (``domain_range``); the rest is ``fill`` and does not travel.

    Returns
    -------
    Tensor
        ``local`` with ``dim`` replaced by this rank's range, ``hi - lo`` long.
    """
    _, finish = start_extend(local, spec, dim, ranges, boundary, fill, real)
    return finish()


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
    local = x.to_local()
    real: list[tuple[int, int, int]] = []
    for dim in sorted(d % x.ndim for d in widths):
        left, right = _pair(widths[dim] if dim in widths else widths[dim - x.ndim])
        mode = boundary if isinstance(boundary, str) else boundary.get(dim, "zeros")
        sharding = spec.sharding_by_dim.get(dim)
        if sharding is None:
            local = pad_locally(local, dim, left, right, mode)
            lo, hi = -left, spec.shape[dim] + right
        else:
            offsets = [sum(sharding.sizes[:k]) for k in range(len(sharding.sizes))]
            ranges = [(o - left, o + s + right) for o, s in zip(offsets, sharding.sizes)]
            local = extend_dim(local, spec, dim, ranges, mode, real=real)
            index = sharding.flat_index(spec.mesh_shape, mesh_coordinate(spec.mesh))
            lo, hi = ranges[index]
        if mode == "zeros":
            real.append(domain_range(dim, lo, hi, spec.shape[dim]))
    return local


def domain_range(dim: int, lo: int, hi: int, extent: int) -> tuple[int, int, int]:
    """``(dim, start, stop)``: where the domain cells lie in a range ``[lo, hi)`` of ``dim``
    taken across a zeros boundary (see ``HaloPlan.real``)."""
    start = min(max(0, -lo), hi - lo)
    stop = max(start, hi - lo - max(0, hi - max(lo, extent)))
    return dim, start, stop


def _pair(width: int | tuple[int, int]) -> tuple[int, int]:
    left, right = (width, width) if isinstance(width, int) else width
    if left < 0 or right < 0:
        raise ValueError(f"halo widths must be non-negative, got {(left, right)}")
    return left, right


_TORCH_MODES = {
    "zeros": "constant",
    "periodic": "circular",
    "reflect": "reflect",
    "replicate": "replicate",
}


def pad_locally(
    local: torch.Tensor, dim: int, left: int, right: int, mode: str, fill: float = 0.0
) -> torch.Tensor:
    """Pad (negative: crop) an unsharded dim, whole on this rank, the way the boundary says."""
    if mode not in _TORCH_MODES:
        raise ValueError(f"unknown boundary {mode!r}; expected one of {BOUNDARIES}")
    if left == right == 0:
        return local
    moved = local.movedim(dim, -1)
    flat = moved.reshape(-1, 1, moved.shape[-1])
    value = fill if mode == "zeros" else None
    padded = torch.nn.functional.pad(flat, (left, right), mode=_TORCH_MODES[mode], value=value)
    return padded.reshape(*moved.shape[:-1], padded.shape[-1]).movedim(-1, dim)
