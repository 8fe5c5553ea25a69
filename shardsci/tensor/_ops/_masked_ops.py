"""``masked_scatter`` and ``masked_select`` without holding the field whole: in their operands'
layout, or (a selection across blocks) each selected cell moved to its place; gathered
(``_gathered_ops``, the guard reports it) only for operands laid out apart or pending.

Both ops number the mask's selected cells in row-major order over the whole tensor: the k-th
selected cell takes ``source.flatten()[k]`` (scatter) or is the k-th output element (select).
A rank needs, for the selected cells of its block, only their numbers (NOTE [A masked cell's
number in row-major order]).
"""

from __future__ import annotations

import itertools
import math

import torch
from torch.distributed.tensor import Replicate, Shard

from shardsci.tensor._api import ShardTensor
from shardsci.tensor._binding import bind
from shardsci.tensor._collectives import all_gather, all_reduce, axis_group, exchange
from shardsci.tensor._ops._common import sharding_axes
from shardsci.tensor._ops._gathered_ops import gathered
from shardsci.tensor._redistribute import redistribute_local, target_spec
from shardsci.tensor._registry import register_aten_handler
from shardsci.tensor._shape_probe import probe_on_meta
from shardsci.tensor._spec import DimSharding, ShardTensorSpec

aten = torch.ops.aten


# NOTE [A masked cell's number in row-major order]
# The k-th selected cell of the mask (row-major over the whole tensor) is written from
# ``source.flatten()[k]`` by ``masked_scatter`` and is output element k of ``masked_select``.
# Which k a rank's selected cells have depends on the layout:
# - a whole mask (plain or replicated): every rank counts, with no communication, the cells
#   selected before each of its rows (``_numbers_from_whole``: per-row counts of the whole
#   mask, O(cells / last extent), and the cells left of its block in each row);
# - a mask sharded like the operand, whose blocks in the sharding's flat order are its
#   row-major order (one dim split, every dim before it of extent 1: ``_rank_order``): the
#   cells before a rank's block are the counts of the blocks before it, one all-gather of one
#   count per rank along the sharding's axes;
# - a mask sharded otherwise (2-D blocks): the counts of every row in every block of the
#   last dim, one all-reduce (NOTE [A selection across blocks moves each cell to its place]).
# ``masked_select``'s output in the second case: a 1-D tensor split on dim 0 into the blocks'
# counts, over the sharding's axes (each rank's selection is one run of the output, kept
# where it is). Elsewhere the ranks' selections interleave in the output: each cell moves to
# its place (the NOTE below). ``masked_scatter`` reads its run of a whole source; a source
# split into exactly those runs (``masked_select``'s output, the gradient its backward
# scatters) is read where it is; a 1-D source split over the axes that split the mask (the
# selection across blocks) is asked for the values at this rank's numbers; any other split
# source is gathered whole, explicitly (the guard sees it): the source only, never the
# field. The gradient of the source (``masked_scatter_backward``) is, in the second case
# for a 1-D source of exactly the selected count, each rank's selected gradient as its run
# (no byte moves), and with a mask split in blocks the selection of the gradient across them;
# otherwise each rank's selected gradient written at its numbers into zeros
# of the source's shape and summed over the axes that split the field (one all-reduce of the
# source's size): the gradient returns to the layout the source had, replicated, as the
# source itself was held (a pending sum of it would read to the guard as a gather).
def _operands(x: object, mask: object):
    """The layout of ``x`` and ``mask`` broadcast together (that of the sharded one; the other
    must be whole or laid out alike), this rank's block of each, and the whole mask (None
    when it is sharded); None where neither is split or one is pending or laid out apart."""
    tensors = (x, mask)
    if any(isinstance(t, ShardTensor) and t._spec.partial for t in tensors):
        return None
    shape = torch.broadcast_shapes(x.shape, mask.shape)
    tensors = [t.expand(shape) if t.shape != shape else t for t in tensors]
    split = [t._spec for t in tensors if isinstance(t, ShardTensor) and t._spec.shardings]
    if not split or not all(s.same_layout(split[0]) for s in split):
        return None
    spec = split[0]
    blocks = [
        t._local if isinstance(t, ShardTensor) and t._spec.shardings else spec.narrow(_whole(t))
        for t in tensors
    ]
    m = tensors[1]
    m_whole = None if isinstance(m, ShardTensor) and m._spec.shardings else _whole(m)
    return spec, blocks[0], blocks[1], m_whole


def _whole(t: object) -> torch.Tensor:
    return t._local if isinstance(t, ShardTensor) else t


def _rank_order(spec: ShardTensorSpec) -> DimSharding | None:
    """``spec``'s one sharding when its blocks, in their flat order, are in row-major order."""
    if len(spec.shardings) != 1:
        return None
    s = spec.shardings[0]
    return s if math.prod(spec.shape[: s.dim]) == 1 else None


def _block_counts(spec: ShardTensorSpec, s: DimSharding, m_local, m_whole) -> tuple[int, ...]:
    """Selected cells per block of the rank-order sharding ``s``, in its flat order."""
    if m_whole is not None:
        starts = [sum(s.sizes[:k]) for k in range(len(s.sizes))]
        return tuple(int(m_whole.narrow(s.dim, o, n).sum()) for o, n in zip(starts, s.sizes))
    count = m_local.sum().reshape(1)
    return tuple(all_gather(count, axis_group(spec.mesh, s.axes)).flatten().tolist())


def _numbers(spec: ShardTensorSpec, m_local, m_whole):
    """The row-major numbers of this rank's selected cells (1-D), the total selected, and the
    blocks' counts in rank order (None unless ``_rank_order``) (NOTE [A masked cell's number
    in row-major order])."""
    s = _rank_order(spec)
    if s is not None:
        counts = _block_counts(spec, s, m_local, m_whole)
        mine = axis_group(spec.mesh, s.axes).index
        before = sum(counts[:mine])
        return (
            torch.arange(before, before + counts[mine], device=m_local.device),
            sum(counts),
            counts,
        )
    if m_whole is None:
        return (*_block_numbers(spec, m_local), None)
    return _numbers_from_whole(spec, m_local, m_whole), int(m_whole.sum()), None


def _numbers_from_whole(spec: ShardTensorSpec, m_local, m_whole) -> torch.Tensor:
    """Row-major numbers of this rank's selected cells from the whole mask: cells selected
    before each row, plus those left of the block in the row, plus those before in the block."""
    rows = m_whole.sum(-1)
    flat = rows.flatten()
    row_start = (flat.cumsum(0) - flat).view(rows.shape)
    left = m_whole[..., : spec.local_offsets()[-1]].sum(-1)
    base = spec.narrow((row_start + left).unsqueeze(-1).expand(m_whole.shape))
    within = m_local.cumsum(-1) - m_local.long()
    return (base + within)[m_local]


# NOTE [A selection across blocks moves each cell to its place]
# With dims other than the leading one split (2-D blocks), the ranks' selected cells
# interleave in row-major order. Each rank still finds its cells' numbers (NOTE [A masked
# cell's number in row-major order]) from the selected count of every row in every block of
# the last dim (``_row_counts``: one all-reduce of ``rows x blocks`` counts over the axes
# that split the mask, a last-extent-th of the field per block). ``masked_select``'s output
# is then split on dim 0 over those axes (in increasing order), each rank's part as long as
# its own selection (``_runs_spec``), and each selected cell moves to the rank owning its
# number, with the number (``_moved``: one all-to-all of at most what each rank selected,
# eight bytes more per cell). ``masked_scatter`` from a source split that way over those
# axes (the gradient of that selection) asks the owners of its numbers for their values
# (``_fetched``: the numbers out, the values back). Neither holds the field whole.
def _row_counts(spec: ShardTensorSpec, m_local: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Selected cells before each (row, block of the last dim) in row-major order, for this
    rank's rows and block (``m_local``'s shape less its last dim), and the total selected
    (NOTE [A selection across blocks moves each cell to its place])."""
    last = spec.sharding_by_dim.get(spec.ndim - 1)
    blocks = len(last.sizes) if last is not None else 1
    mine = last.flat_index(spec.mesh_shape, _coordinate(spec)) if last is not None else 0
    counts = m_local.new_zeros((*spec.shape[:-1], blocks), dtype=torch.int64)
    rows = tuple(slice(o, o + n) for o, n in zip(spec.local_offsets()[:-1], m_local.shape[:-1]))
    counts[(*rows, mine)] = m_local.sum(-1)
    counts = all_reduce(counts, axis_group(spec.mesh, _axes(spec)), "sum")
    flat = counts.flatten()
    return (flat.cumsum(0) - flat).view(counts.shape)[(*rows, mine)], int(flat.sum())


def _coordinate(spec: ShardTensorSpec) -> list[int]:
    return [int(c) for c in spec.mesh.get_coordinate()]


def _axes(spec: ShardTensorSpec) -> tuple[int, ...]:
    return tuple(sorted(sharding_axes(spec)))


def _block_numbers(spec: ShardTensorSpec, m_local: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Row-major numbers of this rank's selected cells (1-D, increasing) in a mask split in
    blocks, and the total selected (NOTE [A selection across blocks moves each cell to its
    place])."""
    before, total = _row_counts(spec, m_local)
    within = m_local.cumsum(-1) - m_local.long()
    return (before.unsqueeze(-1) + within)[m_local], total


def _owners(numbers: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    ends = torch.tensor(list(itertools.accumulate(sizes)), device=numbers.device)
    return torch.searchsorted(ends, numbers, right=True)


def _moved(values: torch.Tensor, numbers: torch.Tensor, sizes, group) -> torch.Tensor:
    """``values`` (1-D, at increasing ``numbers``) moved to the ranks of ``group`` owning
    those numbers in a 1-D tensor split as ``sizes``, in number order: this rank's part."""
    owners = _owners(numbers, sizes)
    sends = torch.bincount(owners, minlength=group.size)
    matrix = all_gather(sends, group).tolist()  # what each rank sends to each
    width = values.element_size() + 8
    cells = values.contiguous().view(torch.uint8).reshape(len(values), values.element_size())
    packed = torch.cat([numbers.reshape(-1, 1).view(torch.uint8), cells], 1)
    pieces = list(packed.split(sends.tolist()))
    received = torch.cat(
        exchange(
            group, pieces, lambda src, dst: (matrix[src][dst], width),
            dtype=torch.uint8, device=values.device, kind="masked_select",
        )
    )  # fmt: skip
    start = sum(sizes[: group.index])
    place = received[:, :8].contiguous().view(torch.int64).reshape(-1) - start
    out = values.new_empty(sizes[group.index])
    out[place] = received[:, 8:].contiguous().view(values.dtype).reshape(-1)
    return out


def _fetched(source: ShardTensor, numbers: torch.Tensor, group) -> torch.Tensor:
    """The values at increasing ``numbers`` of a 1-D ``source`` split over ``group``'s axes:
    the numbers go to their owners, the values come back (NOTE [A selection across blocks
    moves each cell to its place])."""
    sizes = source._spec.shardings[0].sizes
    sends = torch.bincount(_owners(numbers, sizes), minlength=group.size)
    matrix = all_gather(sends, group).tolist()
    device = numbers.device
    asked = exchange(
        group, list(numbers.split(sends.tolist())), lambda src, dst: (matrix[src][dst],),
        dtype=torch.int64, device=device, kind="masked_scatter",
    )  # fmt: skip
    start = sum(sizes[: group.index])
    replies = [source._local[a - start] for a in asked]
    back = exchange(
        group, replies, lambda src, dst: (matrix[dst][src],),
        dtype=source.dtype, device=device, kind="masked_scatter",
    )  # fmt: skip
    return torch.cat(back)


def _selected_in_blocks(spec: ShardTensorSpec, values, numbers) -> ShardTensor:
    """The selection, laid out as ``spec`` across blocks, of this rank's selected ``values`` at
    their increasing row-major ``numbers``: each moved to its place (NOTE [A selection across
    blocks moves each cell to its place])."""
    axes = _axes(spec)
    group = axis_group(spec.mesh, axes)
    mine = torch.tensor([numbers.numel()], device=numbers.device)
    counts = tuple(all_gather(mine, group).flatten().tolist())
    out = _moved(values, numbers, counts, group)
    return ShardTensor(out, _runs_spec(spec, axes, counts, out.dtype))


def _source_values(source: object, numbers: torch.Tensor, spec: ShardTensorSpec, counts):
    """The source's values at ``numbers`` (NOTE [A masked cell's number in row-major order])."""
    if not (isinstance(source, ShardTensor) and source._spec.shardings):
        return _whole(source).reshape(-1)[numbers]
    own, s = source._spec, _rank_order(spec)
    if counts is None and source.ndim == 1 and own.shardings[0].axes == _axes(spec):
        return _fetched(source, numbers, axis_group(spec.mesh, _axes(spec)))
    if (
        counts is not None
        and source.ndim == 1
        and own.shardings[0].axes == s.axes
        and own.shardings[0].sizes == counts
    ):
        return source._local
    whole = target_spec(own, [Replicate()] * own.mesh.ndim)
    return redistribute_local(source._local, own, whole).reshape(-1)[numbers]


@register_aten_handler(aten.masked_scatter.default)
def _masked_scatter(func, args, kwargs):
    a = bind(func, args, kwargs)
    probe_on_meta(func, args, kwargs)  # torch's errors for shapes and dtypes, on every rank
    found = _operands(a.self, a.mask)
    partial = isinstance(a.source, ShardTensor) and a.source._spec.partial
    numbered = None if found is None or partial else _numbers(found[0], found[2], found[3])
    if numbered is None:
        return gathered(func, args, kwargs)
    spec, x_local, m_local, _ = found
    numbers, total, counts = numbered
    if a.source.numel() < total:
        raise RuntimeError("Number of elements of source < number of ones in mask")
    out = x_local.clone(memory_format=torch.contiguous_format)
    out[m_local] = _source_values(a.source, numbers, spec, counts)
    return ShardTensor(out, spec.with_dtype(out.dtype))


@register_aten_handler(aten.masked_scatter_backward.default)
def _masked_scatter_backward(func, args, kwargs):
    a = bind(func, args, kwargs)
    found = _operands(a.grad_output, a.mask)
    numbered = None if found is None else _numbers(found[0], found[2], found[3])
    if numbered is None:
        return gathered(func, args, kwargs)
    spec, g_local, m_local, _ = found
    numbers, total, counts = numbered
    if counts is not None and len(a.sizes) == 1 and a.sizes[0] == total:
        s = _rank_order(spec)
        return ShardTensor(g_local[m_local], _runs_spec(spec, s.axes, counts, g_local.dtype))
    if len(a.sizes) == 1 and a.sizes[0] == total:
        return _selected_in_blocks(spec, g_local[m_local], numbers)
    out = g_local.new_zeros(math.prod(a.sizes))
    out[numbers] = g_local[m_local]
    whole = ShardTensorSpec.build(
        spec.mesh, [Replicate()] * spec.mesh.ndim, list(a.sizes), out.dtype
    )
    return ShardTensor(
        all_reduce(out, axis_group(spec.mesh, tuple(sharding_axes(spec))), "sum").view(
            list(a.sizes)
        ),
        whole,
    )


def _runs_spec(spec: ShardTensorSpec, axes: tuple[int, ...], counts, dtype) -> ShardTensorSpec:
    """A 1-D tensor of the selected cells split over ``axes``, ``counts`` in their flat order."""
    placements = [Shard(0) if axis in axes else Replicate() for axis in range(spec.mesh.ndim)]
    return ShardTensorSpec.build(
        spec.mesh, placements, [sum(counts)], dtype, {0: counts}, order={0: axes}
    )


def _check_selection(x, mask) -> None:
    """torch's errors for a selection's arguments, on every rank (``masked_select`` has no
    meta kernel to probe)."""
    if mask.dtype != torch.bool:
        raise RuntimeError("masked_select: expected BoolTensor for mask")
    torch.empty(mask.shape, device="meta") + torch.empty(x.shape, device="meta")


@register_aten_handler(aten.masked_select.default)
def _masked_select(func, args, kwargs):
    a = bind(func, args, kwargs)
    _check_selection(a.self, a.mask)
    found = _operands(a.self, a.mask)
    if found is None:
        return gathered(func, args, kwargs)
    spec, x_local, m_local, m_whole = found
    numbers, _, counts = _numbers(spec, m_local, m_whole)
    out = x_local[m_local]
    if counts is None:
        return _selected_in_blocks(spec, out, numbers)
    return ShardTensor(out, _runs_spec(spec, _rank_order(spec).axes, counts, out.dtype))
