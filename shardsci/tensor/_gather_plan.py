"""Gathers and scatters along a sharded dim: which rows each rank lacks, fetched once.

# NOTE [Gathers along a sharded dim go through a cached halo plan]
An index into a dim sharded over mesh axes names rows by their global position. For a rank,
the rows its index names split into the rows it owns and its *halo*: the distinct rows owned
by other ranks. A :class:`GatherPlan` records, for one index and one sharding of the indexed
dim, the halo of every rank (a global table, identical on every rank), the owned rows this
rank sends to each other rank, and the index rewritten into positions of the rank's
*extended* rows ``[owned | halo]``. With it:
- a gather (``x[idx]``, ``index_select``, ``gather``) is one exchange in which each rank
  receives exactly its halo rows (the byte lower bound: every remote row it reads, once),
  followed by a local gather from the extended rows (:func:`halo_extend`);
- a scatter-sum (``index_add``, ``scatter_add``, ``scatter_reduce`` sum/mean) is a local scatter
  into extended rows followed by the reverse exchange, each halo row added by its owner
  (:func:`halo_reduce`); it is the exact adjoint of the gather, and each is the other's
  backward.
Building a plan costs one exchange of counts and one of requested row numbers. Plans are
cached per index *storage* (with the view's offset, shape, stride and version), so
``edge_index[0]`` taken anew in every forward finds the plan built by the first; the entries
go when the storage does. A sharded index's plan is a collective: every rank must hit or miss
together, which holds when every rank runs the same program on corresponding tensors (as in
SPMD training). A replicated index (a plain tensor, or a replicated ShardTensor) is the same
on every rank, so its plan is computed locally, without communication.

An index value outside the indexed dim is reported in the counts exchange, the first
collective of the plan, so every rank raises the same ``IndexError`` and none is left waiting.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from shardsci.tensor._collectives import AxisGroup, exchange

__all__ = ["GatherPlan", "gather_plan", "halo_extend", "halo_reduce"]


@dataclass(frozen=True, eq=False)
class GatherPlan:
    """How one rank's index into a sharded dim reaches the rows it names.

    Attributes
    ----------
    group : AxisGroup
        The ranks sharding the indexed dim; row ownership follows their flat index.
    owned : int
        Rows of the indexed dim this rank owns.
    halo_counts : tuple of tuple of int
        ``halo_counts[r][k]``: rows rank ``r`` receives from rank ``k`` (0 on the diagonal),
        the same table on every rank.
    send_rows : Tensor
        Local positions of the owned rows this rank sends, grouped by receiving rank in flat
        index order, ``(sum_r halo_counts[r][me],)``.
    local_index : Tensor
        The index with every value replaced by its position in ``[owned | halo]`` rows; halo
        rows are ordered by global position.
    """

    group: AxisGroup
    owned: int
    halo_counts: tuple[tuple[int, ...], ...]
    send_rows: torch.Tensor
    local_index: torch.Tensor

    @property
    def halo(self) -> int:
        """Rows this rank receives."""
        return sum(self.halo_counts[self.group.index])

    @property
    def moves(self) -> bool:
        """Whether any rank receives any row (else gathers and scatters are local)."""
        return any(any(row) for row in self.halo_counts)


# ---------------------------------------------------------------------------- building
def gather_plan(
    index: torch.Tensor,
    sizes: tuple[int, ...],
    group: AxisGroup,
    *,
    replicated: bool,
    wrap_negative: bool = False,
    what: str = "index",
) -> GatherPlan:
    """The (cached) plan for this rank's ``index`` into a dim sharded with ``sizes``.

    Parameters
    ----------
    index : Tensor
        Integer global positions along the indexed dim; this rank's shard of a sharded index,
        or the whole of a replicated one.
    sizes : tuple of int
        Extent of the indexed dim owned by each rank of ``group`` (flat index order).
    replicated : bool
        Whether every rank holds the same ``index`` (then no communication is needed).
    wrap_negative : bool
        Read ``-k`` as ``extent - k`` (Python indexing), else negative values are out of range.
    what : str
        Names the operation in error messages.
    """
    key = (
        index.storage_offset(),
        tuple(index.shape),
        index.stride(),
        index._version,
        index.dtype,
        id(group.group),
        sizes,
        replicated,
        wrap_negative,
    )
    storage = index.untyped_storage()
    entries = _PLANS.get(id(storage))
    if entries is None:
        entries = _PLANS[id(storage)] = {}
        weakref.finalize(storage, _PLANS.pop, id(storage), None)
    plan = entries.get(key)
    if plan is None:
        plan = entries[key] = _build(index, sizes, group, replicated, wrap_negative, what)
    return plan


# id(untyped storage) -> {view geometry and layout: plan}; an entry goes with its storage, so
# the id cannot be reused by another storage while the entry exists.
_PLANS: dict[int, dict[tuple, GatherPlan]] = {}


def _build(
    index: torch.Tensor,
    sizes: tuple[int, ...],
    group: AxisGroup,
    replicated: bool,
    wrap_negative: bool,
    what: str,
) -> GatherPlan:
    extent = sum(sizes)
    starts = torch.tensor([sum(sizes[:k]) for k in range(len(sizes) + 1)], dtype=torch.int64)
    me = group.index
    compact, expand_to = _compact(index)
    values = compact.reshape(-1).to(torch.int64).cpu()
    if wrap_negative:
        values = torch.where(values < 0, values + extent, values)
    bad = (values < 0) | (values >= extent)
    first_bad = int(compact.reshape(-1)[bad.nonzero()[0, 0]]) if bad.any() else 0
    wanted = torch.unique(values[~bad]) if bad.any() else torch.unique(values)
    owners = torch.searchsorted(starts[1:], wanted, right=True)
    if replicated:
        _raise_if_bad([(int(bad.sum()), first_bad)], extent, what)
        per_owner = torch.bincount(owners, minlength=group.size).tolist()
        halo_counts = tuple(
            tuple(0 if k == r else per_owner[k] for k in range(group.size))
            for r in range(group.size)
        )
        mine = wanted[owners == me] - starts[me]
        send_rows = mine.repeat(group.size - 1)
    else:
        halo_counts, send_rows = _exchange_requests(
            wanted, owners, group, starts, extent, (int(bad.sum()), first_bad), what
        )
    halo_ids = wanted[owners != me]
    offset, owned = int(starts[me]), sizes[me]
    positions = torch.where(
        (values >= offset) & (values < offset + owned),
        values - offset,
        owned + torch.searchsorted(halo_ids, values),
    )
    local_index = positions.reshape(compact.shape).to(index.device).expand(expand_to)
    return GatherPlan(group, owned, halo_counts, send_rows.to(index.device), local_index)


def _compact(index: torch.Tensor) -> tuple[torch.Tensor, torch.Size]:
    """``index`` without its broadcast dims (stride 0), and the shape to expand back to."""
    narrowed = index
    for dim, (size, stride) in enumerate(zip(index.shape, index.stride())):
        if stride == 0 and size > 1:
            narrowed = narrowed.narrow(dim, 0, 1)
    return narrowed, index.shape


def _exchange_requests(
    wanted: torch.Tensor,
    owners: torch.Tensor,
    group: AxisGroup,
    starts: torch.Tensor,
    extent: int,
    bad: tuple[int, int],
    what: str,
) -> tuple[tuple[tuple[int, ...], ...], torch.Tensor]:
    """Every rank's halo counts (with its out-of-range report), then the rows it requests."""
    size, me = group.size, group.index
    counts = torch.bincount(owners, minlength=size)
    counts[me] = 0
    report = torch.cat([counts, torch.tensor(bad, dtype=torch.int64)])
    rows = exchange(
        group,
        [report] * size,
        lambda src, dst: (size + 2,),
        dtype=torch.int64,
        device=torch.device("cpu"),
        kind="gather_plan",
    )
    table = [row.tolist() for row in rows]
    _raise_if_bad([(row[size], row[size + 1]) for row in table], extent, what)
    halo_counts = tuple(tuple(row[:size]) for row in table)
    requests = [wanted[owners == k] for k in range(size)]
    received = exchange(
        group,
        requests,
        lambda src, dst: (halo_counts[src][dst],),
        dtype=torch.int64,
        device=torch.device("cpu"),
        kind="gather_plan",
    )
    others = [received[r] - starts[me] for r in range(size) if r != me]
    send_rows = torch.cat(others) if others else torch.empty(0, dtype=torch.int64)
    return halo_counts, send_rows


def _raise_if_bad(reports: list[tuple[int, int]], extent: int, what: str) -> None:
    for rank, (count, value) in enumerate(reports):
        if count:
            where = f" on rank {rank} of the group" if len(reports) > 1 else ""
            raise IndexError(
                f"{what}: index value {value}{where} is out of range for a dim of size "
                f"{extent} ({count} such value(s)); expected values in [0, {extent})"
            )


# ---------------------------------------------------------------------------- exchanges
def _halo_rows(
    owned_rows: torch.Tensor, plan: GatherPlan, dim: int, kind: str
) -> list[torch.Tensor]:
    """Send each rank the owned rows it lacks; return the rows received, by source."""
    me, size = plan.group.index, plan.group.size
    rows = owned_rows.movedim(dim, 0)
    trailing = tuple(rows.shape[1:])
    splits = [plan.halo_counts[r][me] if r != me else 0 for r in range(size)]
    outgoing = list(rows.index_select(0, plan.send_rows).split(splits))
    received = exchange(
        plan.group,
        [None if r == me else outgoing[r] for r in range(size)],
        lambda src, dst: (plan.halo_counts[dst][src], *trailing),
        dtype=rows.dtype,
        device=rows.device,
        kind=kind,
    )
    return [received[k] for k in range(size) if k != me]


def _returned_rows(halo: torch.Tensor, plan: GatherPlan, dim: int, kind: str) -> torch.Tensor:
    """Send each halo row back to its owner; return what arrives, in ``send_rows`` order."""
    me, size = plan.group.index, plan.group.size
    rows = halo.movedim(dim, 0)
    trailing = tuple(rows.shape[1:])
    splits = [plan.halo_counts[me][k] if k != me else 0 for k in range(size)]
    outgoing = list(rows.split(splits))
    received = exchange(
        plan.group,
        [None if k == me else outgoing[k] for k in range(size)],
        lambda src, dst: (plan.halo_counts[src][dst], *trailing),
        dtype=rows.dtype,
        device=rows.device,
        kind=kind,
    )
    return torch.cat([received[r] for r in range(size) if r != me]).movedim(0, dim)


def _extend(owned: torch.Tensor, plan: GatherPlan, dim: int) -> torch.Tensor:
    halo = [rows.movedim(0, dim) for rows in _halo_rows(owned, plan, dim, "gather")]
    return torch.cat([owned, *halo], dim)


def _reduce(extended: torch.Tensor, plan: GatherPlan, dim: int) -> torch.Tensor:
    owned = extended.narrow(dim, 0, plan.owned)
    halo = extended.narrow(dim, plan.owned, plan.halo)
    arrived = _returned_rows(halo, plan, dim, "scatter")
    return owned.index_add(dim, plan.send_rows, arrived)


class _HaloExtend(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, owned: torch.Tensor, plan: GatherPlan, dim: int, replicated: bool):  # type: ignore[override]
        ctx.plan, ctx.dim, ctx.replicated = plan, dim, replicated
        return _extend(owned, plan, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        if ctx.replicated:
            # Every rank holds the whole output gradient: the owner's share is complete.
            return grad.narrow(ctx.dim, 0, ctx.plan.owned), None, None, None
        return _reduce(grad.contiguous(), ctx.plan, ctx.dim), None, None, None


class _HaloReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, extended: torch.Tensor, plan: GatherPlan, dim: int):  # type: ignore[override]
        ctx.plan, ctx.dim = plan, dim
        return _reduce(extended, plan, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        return _extend(grad.contiguous(), ctx.plan, ctx.dim), None, None


def halo_extend(
    owned: torch.Tensor, plan: GatherPlan, dim: int, *, replicated_output: bool = False
) -> torch.Tensor:
    """This rank's rows along ``dim`` followed by its halo rows. Differentiable.

    Parameters
    ----------
    owned : Tensor
        This rank's shard, ``plan.owned`` rows along ``dim``.
    replicated_output : bool
        The result feeds an output every rank holds whole, whose gradient is therefore the
        same on every rank: the backward keeps the owned rows' gradient and sends nothing.
        Otherwise the backward is :func:`halo_reduce`.

    Returns
    -------
    Tensor
        ``plan.owned + plan.halo`` rows along ``dim``; the plan's ``local_index`` indexes them.
        When no rank receives anything, ``owned`` itself.
    """
    if not plan.moves:
        return owned
    return _HaloExtend.apply(owned, plan, dim, replicated_output)


def halo_reduce(extended: torch.Tensor, plan: GatherPlan, dim: int) -> torch.Tensor:
    """Owned rows plus the halo rows other ranks hold for them (added by the owner).
    Differentiable; the adjoint of :func:`halo_extend`.

    Parameters
    ----------
    extended : Tensor
        ``plan.owned + plan.halo`` rows along ``dim``.

    Returns
    -------
    Tensor
        ``plan.owned`` rows along ``dim``.
    """
    if not plan.moves:
        return extended
    return _HaloReduce.apply(extended, plan, dim)
