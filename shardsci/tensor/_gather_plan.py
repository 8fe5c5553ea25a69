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
cached per index *storage* (with the view's offset, shape, stride and dtype, and the layout
indexed), for the storage's current version, so ``edge_index[0]`` taken anew in every forward
finds the plan built by the first. Two views of one storage with the same geometry hold the
same elements, even when empty (torch strides an empty dim by 1, so the rows of a ``(2, 0)``
index start at different offsets). A sharded index's plan is a collective: every rank must hit
or miss together, which holds when every rank runs the same program on corresponding tensors
(as in SPMD training). So the storage, not the index's values, is the key: equal values
on one rank and different ones on another would make the ranks disagree. A replicated index
(a plain tensor, or a replicated ShardTensor) is the same on every rank, so its plan is
computed locally, without communication; so is the plan of a replicated index each rank of
which reads only its own range (``sliced``: an output sharded like the indexed dim), since
every rank knows every rank's range.

The cache follows NOTE [Caches are keyed by value] (``_caches``) with one twist: each storage
has its own bounded cache of plans, held through a weak reference to the storage (by
identity while it lives; a storage allocated where a dead one was, with the same ``id``,
never finds the dead one's plans), and its plans go when it dies. An in-place write to the
index (a new version) replaces its plan. So whether a call hits depends only on the calls
made with that storage, the same on every rank, never on when a rank's garbage collector
freed another storage: a cache shared by all storages would evict by a count that collected
storages change at different moments on different ranks, and a rank that missed alone would
wait in the plan's exchange.

An index value outside the indexed dim is reported in the counts exchange, the first
collective of the plan, so every rank raises the same ``IndexError`` and none is left waiting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from shardsci.tensor._caches import BoundedCache, register_cache
from shardsci.tensor._collectives import AxisGroup, all_reduce, exchange

__all__ = [
    "GatherPlan",
    "compact",
    "extended_rows",
    "gather_plan",
    "halo_extend",
    "halo_reduce",
    "remember_plan",
    "rows_sent_home",
    "summed_rows",
]


@dataclass(frozen=True, eq=False)
class GatherPlan:
    """How one rank's index into a sharded dim reaches the rows it names (the cells, for a
    cell-wise read: NOTE [A cell-wise read moves cells]; "rows" below are then cells).

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
        rows are ordered by global position (negative values are read from the end).
    negative : tuple of int, optional
        ``(rank, value)``: the first rank holding a negative index value, and the value.
    """

    group: AxisGroup
    owned: int
    halo_counts: tuple[tuple[int, ...], ...]
    send_rows: torch.Tensor
    local_index: torch.Tensor
    negative: tuple[int, int] | None

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
    sliced: int | None = None,
    parts: tuple[int, ...] | None = None,
    cells: tuple[int, tuple[int, ...]] | None = None,
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
    sliced : int, optional
        With ``replicated``: each rank reads only its own range of the index along this dim
        of it, cut like the indexed dim (``index.shape[sliced] == sum(sizes)``), as for an
        output sharded like the input; the plan's ``local_index`` covers that range.
    parts : tuple of int, optional
        With ``sliced``: the lengths of the ranks' ranges along it, in flat index order,
        instead of ``sizes`` (``sum(parts) == index.shape[sliced]``): an output split by its
        entries' owners (NOTE [A selection through a replicated index is split by its
        entries' owners] in ``_gather_scatter_ops``).
    cells : (int, tuple of int), optional
        With ``replicated``: ``(dim, block)`` for a cell-wise read (``gather``: the index has
        the tensor's dims, ``dim`` the indexed one, each entry reading the cell at its own
        position along the others), ``block`` the shape of this rank's block of the tensor,
        the same on every rank of ``group``, the index already cut to it along the other dims.
        The plan then moves single cells, not rows (NOTE [A cell-wise read moves cells]).
    wrap_negative : bool
        Read ``-k`` as ``extent - k`` (Python indexing); else a negative value raises (on
        every rank: the plan knows every rank's negative values).
    what : str
        Names the operation in error messages.

    Raises
    ------
    IndexError
        On every rank, for a value outside ``[-extent, extent)`` on any rank, or a negative
        one without ``wrap_negative``.
    """
    plans, key = _cache_slot(index, sizes, group, (replicated, sliced, parts, cells))
    found = plans.get(key)
    if found is not None and found[0] == index._version:
        plan = found[1]
    else:
        plan = _build(index, sizes, group, replicated, sliced, parts, cells, what)
        plans.put(key, (index._version, plan))
    if plan.negative is not None and not wrap_negative:
        _raise_out_of_range(what, *plan.negative, sum(sizes), len(plan.halo_counts))
    return plan


def remember_plan(index: torch.Tensor, sizes: tuple[int, ...], plan: GatherPlan) -> None:
    """Make ``plan`` the plan :func:`gather_plan` finds for this rank's shard ``index`` of a
    sharded index into a dim sharded with ``sizes`` over ``plan.group``: a plan its caller
    derived without communication, from data every rank holds (a graph partition, NOTE [A
    partitioned graph's halo plan comes from its partition] in ``shardsci.graph._graph``).
    Every rank must remember the plan of corresponding indices, as every rank must build it."""
    plans, key = _cache_slot(index, sizes, plan.group, (False, None, None, None))
    plans.put(key, (index._version, plan))


def _cache_slot(
    index: torch.Tensor, sizes: tuple[int, ...], group: AxisGroup, how: tuple
) -> tuple[BoundedCache, tuple]:
    """The plans of ``index``'s storage, and the key of this view and layout among them."""
    storage = index.untyped_storage()
    plans = _PLANS.get(storage)
    if plans is None:
        plans = _PLANS[storage] = BoundedCache(None, _PLANS_PER_STORAGE)
    key = (
        index.storage_offset(),
        tuple(index.shape),
        index.stride(),
        index.dtype,
        group,
        sizes,
        how,
    )
    return plans, key


_PLANS_PER_STORAGE = 16
"""Plans kept per index storage: its views (``edge_index[0]``, ``[1]``) times the layouts
they index."""

# storage (weakly) -> {(view geometry, dtype, layout): (the storage's version, plan)}; NOTE above.
_PLANS = WeakIdKeyDictionary()
register_cache("gather plans", lambda: sum(len(p) for p in _PLANS.values()), _PLANS.clear)


def _build(
    index: torch.Tensor,
    sizes: tuple[int, ...],
    group: AxisGroup,
    replicated: bool,
    sliced: int | None,
    parts: tuple[int, ...] | None,
    cells: tuple[int, tuple[int, ...]] | None,
    what: str,
) -> GatherPlan:
    extent = sum(sizes)
    starts = torch.tensor([sum(sizes[:k]) for k in range(len(sizes) + 1)], dtype=torch.int64)
    me = group.index
    report = _report(_given(compact(index)[0]), extent)  # every value this rank holds
    device = index.device
    if cells is not None:  # NOTE [A cell-wise read moves cells]
        index, per_row = _cell_numbers(index, *cells)
        starts = starts * per_row
    if sliced is not None:
        lengths = sizes if parts is None else parts
        begins = [sum(lengths[:k]) for k in range(group.size)]
        ranges = [index.narrow(sliced, begins[k], lengths[k]) for k in range(group.size)]
        index = ranges[me]
    distinct, expand_to = compact(index)
    values, wanted, owners = _owners(_given(distinct), starts)
    if replicated:
        reports = [report]
        # every rank knows which rows each rank of the group reads: its own, or its range's
        named = [(wanted, owners)] * group.size if sliced is None else [
            (wanted, owners) if k == me else _owners(_given(r), starts)[1:]
            for k, r in enumerate(ranges)
        ]  # fmt: skip
        halo_counts = tuple(
            tuple(0 if k == r else int((read == k).sum()) for k in range(group.size))
            for r, (_, read) in enumerate(named)
        )
        send_rows = torch.cat(
            [torch.empty(0, dtype=torch.int64)]
            + [rows[read == me] - starts[me] for r, (rows, read) in enumerate(named) if r != me]
        )
    else:
        halo_counts, reports = _exchange_counts(owners, group, report, device)
    for rank, (count, value, _, _) in enumerate(reports):
        if count:
            _raise_out_of_range(what, rank, value, extent, len(reports))
    if not replicated:
        send_rows = _exchange_requests(wanted, owners, group, starts, halo_counts, device)
    negative = next(((r, v) for r, (_, _, count, v) in enumerate(reports) if count), None)
    halo_ids = wanted[owners != me]
    offset, owned = int(starts[me]), int(starts[me + 1] - starts[me])
    positions = torch.where(
        (values >= offset) & (values < offset + owned),
        values - offset,
        owned + torch.searchsorted(halo_ids, values),
    )
    local_index = positions.reshape(distinct.shape).to(device).expand(expand_to)
    return GatherPlan(group, owned, halo_counts, send_rows.to(device), local_index, negative)


# NOTE [A cell-wise read moves cells]
# ``gather`` reads, for each entry of its index, one cell: the entry's own position along
# every dim but the indexed one, the entry's value along it. Through a replicated index cut
# to a rank's block along the other dims, every rank of the group along the indexed dim holds
# the same block shape there, so the ranks' blocks, each moved to put the indexed dim first
# and flattened, are one 1-D dim split over the group, ``sizes`` times the cells of a row
# each, and an entry is the cell ``value * per_row + its position in the row``. The plan is
# then a plan for that flat dim: a rank receives exactly the distinct remote cells its part
# of the index reads, each once, and its backward sends exactly those cells' gradients home.
# Fetching whole rows instead made a rank hold every row it reads a cell of: for a random
# index, every row of the indexed dim.
def _cell_numbers(
    index: torch.Tensor, dim: int, block: tuple[int, ...]
) -> tuple[torch.Tensor, int]:
    """Each entry of ``index`` (global rows along ``dim``, cut to a block of shape ``block``
    along the other dims) as the number of the cell it reads in the block flattened with
    ``dim`` first, rows numbered globally; and the cells in a row."""
    per_row = math.prod(n for d, n in enumerate(block) if d != dim)
    shape = [1 if d == dim else n for d, n in enumerate(block)]
    within = torch.arange(per_row, dtype=torch.int64).reshape(shape)
    within = within[tuple(slice(0, n) for n in index.shape)]
    return index.to(torch.int64).cpu() * per_row + within, per_row


def _given(index: torch.Tensor) -> torch.Tensor:
    """The index's values, flat, as int64 on the host."""
    return index.reshape(-1).to(torch.int64).cpu()


def _owners(
    given: torch.Tensor, starts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``given`` with negative values wrapped, the distinct rows in range it names, and the
    rank owning each of them (``starts``: where each rank's rows start, then the extent)."""
    extent = int(starts[-1])
    values = torch.where(given < 0, given + extent, given)
    wanted = torch.unique(values[(values >= 0) & (values < extent)])
    return values, wanted, torch.searchsorted(starts[1:], wanted, right=True)


def compact(index: torch.Tensor) -> tuple[torch.Tensor, torch.Size]:
    """``index`` without its broadcast dims (stride 0), and the shape to expand back to."""
    narrowed = index
    for dim, (size, stride) in enumerate(zip(index.shape, index.stride())):
        if stride == 0 and size > 1:
            narrowed = narrowed.narrow(dim, 0, 1)
    return narrowed, index.shape


def _report(values: torch.Tensor, extent: int) -> tuple[int, int, int, int]:
    """(values outside [-extent, extent), the first of them, negative values, the first)."""
    outside = (values < -extent) | (values >= extent)
    negative = (values < 0) & ~outside
    return (
        int(outside.sum()),
        int(values[outside][0]) if outside.any() else 0,
        int(negative.sum()),
        int(values[negative][0]) if negative.any() else 0,
    )


def _exchange_counts(
    owners: torch.Tensor,
    group: AxisGroup,
    report: tuple[int, int, int, int],
    device: torch.device,
) -> tuple[tuple[tuple[int, ...], ...], list[tuple[int, ...]]]:
    """Every rank's halo counts by owner, and every rank's report on its values, exchanged
    as tensors on the index's ``device`` (a NCCL group moves only device tensors)."""
    size, me = group.size, group.index
    counts = torch.bincount(owners, minlength=size)
    counts[me] = 0
    row = torch.cat([counts, torch.tensor(report, dtype=torch.int64)]).to(device)
    rows = exchange(
        group,
        [row] * size,
        lambda src, dst: (size + len(report),),
        dtype=torch.int64,
        device=device,
        kind="gather_plan",
    )
    table = torch.stack(rows).tolist()
    return tuple(tuple(row[:size]) for row in table), [tuple(row[size:]) for row in table]


def _exchange_requests(
    wanted: torch.Tensor,
    owners: torch.Tensor,
    group: AxisGroup,
    starts: torch.Tensor,
    halo_counts: tuple[tuple[int, ...], ...],
    device: torch.device,
) -> torch.Tensor:
    """Send each owner the rows this rank wants from it; return the local positions of the
    rows the others want from this rank, grouped by requester (exchanged on ``device``)."""
    me = group.index
    received = exchange(
        group,
        [wanted[owners == k].to(device) for k in range(group.size)],
        lambda src, dst: (halo_counts[src][dst],),
        dtype=torch.int64,
        device=device,
        kind="gather_plan",
    )
    others = [received[r].cpu() - starts[me] for r in range(group.size) if r != me]
    return torch.cat(others) if others else torch.empty(0, dtype=torch.int64)


def _raise_out_of_range(what: str, rank: int, value: int, extent: int, ranks: int) -> None:
    where = f" on rank {rank} of the group" if ranks > 1 else ""
    raise IndexError(
        f"{what}: index value {value}{where} is out of range for a dim of size {extent}; "
        f"expected values in [0, {extent})"
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


def rows_sent_home(extended: torch.Tensor, plan: GatherPlan, dim: int) -> torch.Tensor:
    """Send each halo row of ``extended`` (``[owned | halo]`` rows along ``dim``) back to its
    owner; return the rows that arrive, along ``dim`` in ``plan.send_rows`` order. Not
    differentiable."""
    me, size = plan.group.index, plan.group.size
    rows = extended.narrow(dim, plan.owned, plan.halo).movedim(dim, 0)
    trailing = tuple(rows.shape[1:])
    splits = [plan.halo_counts[me][k] if k != me else 0 for k in range(size)]
    outgoing = list(rows.split(splits))
    received = exchange(
        plan.group,
        [None if k == me else outgoing[k] for k in range(size)],
        lambda src, dst: (plan.halo_counts[src][dst], *trailing),
        dtype=rows.dtype,
        device=rows.device,
        kind="scatter",
    )
    return torch.cat([received[r] for r in range(size) if r != me]).movedim(0, dim)


def extended_rows(owned: torch.Tensor, plan: GatherPlan, dim: int) -> torch.Tensor:
    """``owned`` rows followed by the halo rows other ranks send. Not differentiable."""
    halo = [rows.movedim(0, dim) for rows in _halo_rows(owned, plan, dim, "gather")]
    return torch.cat([owned, *halo], dim)


def summed_rows(extended: torch.Tensor, plan: GatherPlan, dim: int) -> torch.Tensor:
    """The owned rows of ``extended`` plus the halo rows other ranks hold for them (the
    adjoint of :func:`extended_rows`). Not differentiable."""
    owned = extended.narrow(dim, 0, plan.owned)
    return owned.index_add(dim, plan.send_rows, rows_sent_home(extended, plan, dim))


class _HaloExtend(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, owned: torch.Tensor, plan: GatherPlan, dim: int, replicated: bool):  # type: ignore[override]
        ctx.plan, ctx.dim, ctx.replicated = plan, dim, replicated
        return extended_rows(owned, plan, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        if ctx.replicated:
            # Every rank holds the whole output gradient: the owner's share is complete.
            return grad.narrow(ctx.dim, 0, ctx.plan.owned), None, None, None
        if grad.requires_grad and torch.is_grad_enabled():  # each other's adjoint (NOTE
            # [Second derivatives through ShardTensors] in ``_api.py``)
            return _HaloReduce.apply(grad.contiguous(), ctx.plan, ctx.dim), None, None, None
        return summed_rows(grad.contiguous(), ctx.plan, ctx.dim), None, None, None


class _HaloReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, extended: torch.Tensor, plan: GatherPlan, dim: int):  # type: ignore[override]
        ctx.plan, ctx.dim = plan, dim
        return summed_rows(extended, plan, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        if grad.requires_grad and torch.is_grad_enabled():
            return _HaloExtend.apply(grad.contiguous(), ctx.plan, ctx.dim, False), None, None
        return extended_rows(grad.contiguous(), ctx.plan, ctx.dim), None, None


class _SummedRead(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, read: torch.Tensor, plan: GatherPlan):  # type: ignore[override]
        return all_reduce(read, plan.group, "sum")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        # Every rank holds the whole output gradient: its own entries' share is complete.
        return grad, None


def summed_read(read: torch.Tensor, plan: GatherPlan) -> torch.Tensor:
    """The sum over the plan's group of each rank's ``read``, which holds the entries of its
    own rows and zeros for the others: the whole read, on every rank of the group, by one
    all-reduce instead of a fetch of the rows (:func:`halo_extend` with
    ``replicated_output``). Differentiable; as there, the output's gradient is the same on
    every rank of the group."""
    return _SummedRead.apply(read, plan)


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
