"""Gathers and scatters along a sharded dim, moving only the rows an index names.

``x[idx]``, ``index_select`` and ``gather`` read rows of a dim that is sharded; ``index_add``,
``scatter_add`` and ``scatter_reduce`` (and their in-place forms) write into one. DTensor
gathers the whole dim first. Here each call goes through a :class:`GatherPlan` (NOTE [Gathers
along a sharded dim go through a cached halo plan] in ``_gather_plan``):
- an index sharded over the same mesh axes as the indexed dim (the edge list of a partitioned
  graph, sharded with the nodes that own its destinations) gives an output sharded like the
  index; a rank receives only the distinct remote rows its index names, once per plan use;
- a replicated index (a plain tensor) gives an output that keeps the input's shards along the
  dims it keeps, and along the gathered dim when the output has the input's extent there,
  or, for a selection through a 1-D index, split by its entries' owners (NOTE [A selection
  through a replicated index is split by its entries' owners]; else replicated over its
  axes); each rank receives only the remote rows its part of the output names (NOTE [A
  gather through a replicated index keeps the input's layout]); so
  does ``gather`` through an index split like the input on its other dims and whole over
  the gathered dim's axes (``x.gather(0, x.argmax(0, keepdim=True))`` on a 2x2 mesh), and
  ``x[idx]`` or ``index_select`` through an index split over axes that split no dim of the
  input (its output split there on the index's dims); a scatter through one (the scatter
  and ``index_*`` families, ``index_put`` and aten's ``_unsafe_masked_index_put_accumulate``,
  ``index_fill``) writes, without communication, into a destination sharded on any dims
  (NOTE [Scatters through a replicated index write where they land]);
- scatters run locally when every index value is owned by the rank that holds it (as for a
  graph's destinations); otherwise they write through the index into the rows this rank owns
  plus its halo, and the halo rows travel back to their owners, where sum and mean add them
  (mean also sends the counts, in the same message) and amax/amin take their extremum (its
  backward shares the gradient among ties on all ranks, as torch does). ``prod`` and integer
  reductions into remote rows decline.
These run above autograd: they compose the plan's differentiable exchanges with local torch
ops, so the backward of a gather is a scatter-sum of the same plan and vice versa. Anything
else (boolean masks, several tensor indices, an index sharded over other axes, a destination
sharded on other dims too, unless the index is replicated) declines to the default path,
except ``index_put`` and aten's ``index``, which take several indices and boolean masks
through a replicated index (``index`` reads where the cells are), and ``put`` and ``take``,
which go through them by flat position; a declined aten ``gather`` or ``index_select`` that
DTensor would read as a ``_MaskPartial`` takes the gathered fallback (``_masked_by_dtensor``). New tensors of the input's shape that backward
formulas scatter into are laid out like it (``_factory_ops``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardsci.tensor._api import ShardTensor, from_local_spec, redistribute
from shardsci.tensor._binding import bind
from shardsci.tensor._box_packing import narrowed
from shardsci.tensor._caches import cached
from shardsci.tensor._collectives import AxisGroup, all_reduce, axis_group, exchange
from shardsci.tensor._first_order import first_order_only
from shardsci.tensor._gather_guard import check_fetch, check_replicated_read
from shardsci.tensor._gather_plan import (
    GatherPlan,
    compact,
    extended_rows,
    gather_plan,
    halo_extend,
    halo_reduce,
    rows_sent_home,
    summed_read,
    summed_rows,
)
from shardsci.tensor._held import without_held
from shardsci.tensor._ops._common import (
    accepts,
    connected_empty,
    dim_layout,
    replicated_local,
    sharding_axes,
    sizes_at_extent,
)
from shardsci.tensor._ops._gathered_ops import gathered
from shardsci.tensor._ops._plain_destination_ops import whole_value
from shardsci.tensor._ops._slice_scatter_ops import basic_form, write_basic_key
from shardsci.tensor._registry import (
    function_handler_for,
    register_aten_handler,
    register_function_handler,
)
from shardsci.tensor._shape_probe import probe_on_meta
from shardsci.tensor._spec import DimSharding, ShardTensorSpec, merged_hints

_INDEX_DTYPES = (torch.int64, torch.int32)

aten = torch.ops.aten


@dataclass(frozen=True)
class _Indexed:
    """A sharded operand, the dim an index addresses in it, and a sharded index into it.

    Attributes
    ----------
    dim : int
        The indexed dim of ``x``.
    sharding : DimSharding
        How ``dim`` is sharded.
    group : AxisGroup
        The ranks sharding it.
    index : Tensor
        This rank's shard of the index.
    index_spec : ShardTensorSpec
        The index's layout.
    """

    x: ShardTensor
    dim: int
    sharding: DimSharding
    group: AxisGroup
    index: torch.Tensor
    index_spec: ShardTensorSpec

    def plan(self, *, wrap_negative: bool = False, what: str) -> GatherPlan:
        return gather_plan(
            self.index,
            self.sharding.sizes,
            self.group,
            replicated=False,
            wrap_negative=wrap_negative,
            what=what,
        )

    @property
    def index_shape(self) -> tuple[int, ...]:
        """The global shape of the index."""
        return tuple(self.index_spec.shape)

    @property
    def index_sharding(self) -> DimSharding:
        return self.index_spec.shardings[0]


def _indexed(x: object, dim: int, index: object) -> _Indexed | None:
    """The call's operands when this module handles them, else None (decline): ``x`` sharded
    along ``dim`` only, and an integer index sharded over the same axes (a replicated index
    takes ``_through_replicated`` or ``_scatter_by_owner``)."""
    if not isinstance(index, ShardTensor) or index.dtype not in _INDEX_DTYPES:
        return None
    if not isinstance(x, torch.Tensor) or x.ndim == 0:
        return None
    dim %= x.ndim
    if not accepts(x, sharded=[dim], whole=[d for d in range(x.ndim) if d != dim]):
        return None
    spec = x._spec
    sharding, group, _ = dim_layout(spec, dim)
    index_spec = index._spec
    if index_spec.mesh != spec.mesh or index_spec.partial or not index_spec.shardings:
        return None
    if len(index_spec.shardings) != 1 or index_spec.shardings[0].axes != sharding.axes:
        return None
    return _Indexed(x, dim, sharding, group, index._local, index_spec)


def _output_spec(
    indexed: _Indexed, shape: tuple[int, ...], dtype: torch.dtype, sharded_dim: int
) -> ShardTensorSpec:
    """Sharded like the index on ``sharded_dim`` of the output."""
    mesh = indexed.x._spec.mesh
    source = indexed.index_sharding
    placements = [
        Shard(sharded_dim) if axis in source.axes else Replicate() for axis in range(mesh.ndim)
    ]
    return ShardTensorSpec.build(
        mesh,
        placements,
        shape,
        dtype,
        {sharded_dim: source.sizes},
        order={sharded_dim: source.axes},
    )


def _extended_rows(indexed: _Indexed, plan: GatherPlan) -> torch.Tensor:
    """This rank's rows of ``x`` and the halo rows its index names (the index is replicated
    over the other mesh axes: every group of ranks along the indexed dim's axes fetches as
    the plan's table says)."""
    check_fetch(indexed.x._spec, indexed.dim, _rows_held(indexed.sharding.sizes, plan))
    return halo_extend(indexed.x.to_local(), plan, indexed.dim)


def _rows_held(sizes: tuple[int, ...], plan: GatherPlan) -> Iterator[tuple[int, int]]:
    """``(rows owned, rows held after the fetch)`` of the indexed dim, split as ``sizes`` over
    the plan's group, on each rank of it."""
    return ((n, n + sum(received)) for n, received in zip(sizes, plan.halo_counts))


# ---------------------------------------------------------------------------- gathers
def _tensor_key(key: object, ndim: int) -> tuple[int, list[torch.Tensor]] | None:
    """``(first dim, index tensors)`` for a key of adjacent index tensors after full slices
    (``x[:, i, j]``) and before full slices or an ellipsis, of a tensor of ``ndim`` dims; a
    list of integers is an index tensor (``x[[1, 2]]``) and a leading ellipsis stands for
    full slices (``x[..., i, :]``), as in torch; else None."""
    if isinstance(key, (torch.Tensor, list)):
        key = (key,)
    if not isinstance(key, tuple):
        return None
    key = tuple(_as_index(k) for k in key)
    if key and key[0] is Ellipsis:
        if ndim < len(key) - 1:
            return None  # torch's error
        key = (slice(None),) * (ndim - len(key) + 1) + key[1:]
    positions = [i for i, k in enumerate(key) if isinstance(k, torch.Tensor)]
    if not positions or positions != list(range(positions[0], positions[0] + len(positions))):
        return None
    first, stop = positions[0], positions[-1] + 1
    if not all(_is_full_slice(k) for k in key[:first]):
        return None
    if not all(_is_full_slice(k) or k is Ellipsis for k in key[stop:]):
        return None
    return first, list(key[first:stop])


def _as_index(item: object) -> object:
    """A list of integers as the index tensor torch reads it as; anything else as it is."""
    if not isinstance(item, list) or not item:
        return item
    try:
        index = torch.tensor(item)
    except (TypeError, ValueError, RuntimeError):
        return item  # a list of tensors or slices: torch's own conversion
    return index if index.dtype == torch.int64 else item


def _getitem_key(key: object, ndim: int) -> tuple[int, torch.Tensor] | None:
    """``(dim, index)`` for a key that is one integer tensor after full slices (``x[:, idx]``)
    and before full slices or an ellipsis; else None."""
    found = _tensor_key(key, ndim)
    if found is None or len(found[1]) != 1:
        return None
    return found[0], found[1][0]


def _is_full_slice(item: object) -> bool:
    return isinstance(item, slice) and item == slice(None)


@register_function_handler(torch.Tensor.__getitem__)
def _getitem(func, args, kwargs):
    a = bind(func, args, kwargs)
    if not isinstance(a.self, torch.Tensor):
        return NotImplemented
    key = basic_form(a.key)  # x[:, torch.tensor(0)] is a select, a view (not an index read)
    several = _tensor_key(key, a.self.ndim)
    if several is not None and len(several[1]) > 1:  # x[i, j]: read above autograd too
        first, tensors = several
        advanced = _advanced_indices([None] * first + tensors, a.self)
        if advanced is None or not accepts(a.self):
            return NotImplemented
        probe_on_meta(aten.index.Tensor, (a.self, [None] * first + tensors))  # torch's errors
        return _cells_read(a.self, *advanced)
    found = _getitem_key(key, a.self.ndim)
    if found is None:
        return NotImplemented
    dim, index = found
    if _is_plain_mask(index):  # x[mask]: its positions, read above autograd as x[idx]
        if dim + 1 > a.self.ndim or index.shape[0] != a.self.shape[dim]:
            return NotImplemented  # torch's error
        index = index.nonzero().squeeze(1)
    if _replicated_index(index) is not None:
        return _through_replicated(func, a.self, dim, index, cell_wise=False)
    if _split_index(a.self, dim, index, cell_wise=False):
        return _through_replicated(func, a.self, dim, index, cell_wise=False, split=True)
    indexed = _indexed(a.self, dim, index)
    if indexed is None:
        return NotImplemented
    return _select_rows(indexed, "x[index]", wrap_negative=True, keep_0d_dim=False)


def _is_plain_mask(index: object) -> bool:
    """Whether ``index`` is a 1-D boolean mask every rank holds whole (a plain tensor)."""
    return (
        isinstance(index, torch.Tensor)
        and not isinstance(index, ShardTensor)
        and index.dtype == torch.bool
        and index.ndim == 1
    )


@register_aten_handler(aten.index.Tensor)
def _index(func, args, kwargs):
    """Aten's ``x[:, ..., idx]`` (replicated integer indices or boolean masks after leading
    ``None``, ``_advanced_indices``; the gradient of ``index_put``'s values, a decomposed
    ``x[idx]``): one index as ``x[idx]`` above (a ShardTensor index too, ``_split_index``);
    several (``x[i, j]``, a 2-D mask) by ``_cells_read``. Anything else takes the default
    path."""
    a = bind(func, args, kwargs)
    first = next((k for k, i in enumerate(a.indices) if i is not None), len(a.indices))
    index = a.indices[first] if first == len(a.indices) - 1 else None
    if _split_index(a.self, first, index, cell_wise=False):
        getitem = torch.Tensor.__getitem__
        return _through_replicated(getitem, a.self, first, index, cell_wise=False, split=True)
    advanced = _advanced_indices(a.indices, a.self)
    if advanced is None or not accepts(a.self):
        return NotImplemented
    first, tensors = advanced
    if len(tensors) == 1:
        return _through_replicated(
            torch.Tensor.__getitem__, a.self, first, tensors[0], cell_wise=False
        )
    probe_on_meta(func, (a.self, [None] * first + tensors), {})  # torch's errors, every rank
    return _cells_read(a.self, first, tensors)


def _cells_read(x: ShardTensor, first: int, indices: list[torch.Tensor]) -> ShardTensor:
    """``x[..., i, j, ...]`` through replicated integer indices of the adjacent dims from
    ``first`` on, broadcast together into the entries' dims. Entries along one dim whose
    owners (row-major over the axes that split the indexed dims) never decrease along it are
    held by their owners (``_entry_runs``). Otherwise each rank reads the entries whose cells
    lie in its block and zeros for the others, so the entries are a pending sum over those
    axes (each cell is on one rank of them). Split dims outside keep their split. Nothing
    moves: whoever needs the entries whole reduces them (an all-reduce of the entries, not of
    ``x``), and their backward writes where they land."""
    spec, last = x._spec, first + len(indices)
    for k, index in enumerate(indices):  # torch wraps negatives; its range, on every rank
        indices[k] = torch.where(index < 0, index + x.shape[first + k], index)
        _check_in_range(torch.Tensor.__getitem__, indices[k], first + k, x.shape[first + k])
    entries = torch.broadcast_shapes(*(index.shape for index in indices))
    starts, sizes = spec.local_offsets(), spec.local_shape()
    runs = _entry_runs(x, first, indices) if len(entries) == 1 else None
    if runs is not None:
        return runs
    outer = _outer(indices)
    if outer is not None:  # x[i[:, None], j[None, :]] is x[i][:, j]
        for d, index in enumerate(outer, start=first):
            x = _through_replicated(torch.Tensor.__getitem__, x, d, index, cell_wise=False)
        return x
    local_shape = (*sizes[:first], *entries, *sizes[last:])
    if all(sizes[first:last]):
        mine = torch.ones(entries, dtype=torch.bool, device=indices[0].device)
        local = []
        for d, index in enumerate(indices, start=first):
            shifted = index - starts[d]
            inside = (shifted >= 0) & (shifted < sizes[d])
            mine = mine & inside
            local.append(torch.where(inside, shifted, 0))
        read = x.to_local()[(slice(None),) * first + tuple(local)]
        mine = mine.reshape((1,) * first + tuple(entries) + (1,) * (x.ndim - last))
        out = torch.where(mine.to(read.device), read, 0)
    else:
        out = connected_empty(list(local_shape), x._local, x.to_local())  # none of its cells
    placements = list(spec.placements)
    shardings = {}
    for sharding in spec.shardings:
        if first <= sharding.dim < last:
            for axis in sharding.axes:
                placements[axis] = Partial()
            continue
        d = sharding.dim if sharding.dim < first else sharding.dim - len(indices) + len(entries)
        for axis in sharding.axes:
            placements[axis] = Shard(d)
        shardings[d] = sharding
    out_spec = ShardTensorSpec.build(
        spec.mesh,
        placements,
        (*x.shape[:first], *entries, *x.shape[last:]),
        out.dtype,
        {d: s.sizes for d, s in shardings.items()},
        order={d: s.axes for d, s in shardings.items()},
    )
    return from_local_spec(out, out_spec)


def _outer(indices: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The 1-D index of each dim when the indices broadcast as an outer product, the ``k``-th
    index varying along the ``k``-th entries' dim only (``x[i[:, None], j[None, :]]``, as
    interpolation indexes); else None."""
    n = len(indices)
    if len(torch.broadcast_shapes(*(index.shape for index in indices))) != n:
        return None
    found = []
    for k, index in enumerate(indices):
        shape = (1,) * (n - index.ndim) + tuple(index.shape)  # broadcasting pads on the left
        if any(size != 1 for p, size in enumerate(shape) if p != k):
            return None
        found.append(index.reshape(-1))
    return found


def _entry_runs(x: ShardTensor, first: int, indices: list[torch.Tensor]) -> ShardTensor | None:
    """``x[..., i, j, ...]`` (in-range indices of the dims from ``first`` on, broadcast to one
    dim) with each entry on the rank that owns its cell, when the owners never decrease along
    the entries: their dim is split over the axes of the split indexed dims (in dim order),
    each rank reading its run of them from its own block; else None."""
    spec, x_dims = x._spec, range(first, first + len(indices))
    split = [spec.sharding_by_dim[d] for d in x_dims if d in spec.sharding_by_dim]
    if not split or spec.partial:
        return None
    shape = torch.broadcast_shapes(*(index.shape for index in indices))
    indices = [index.expand(shape) for index in indices]
    owners, mine = torch.zeros_like(indices[0]), 0
    for sharding in split:
        _, group, starts = dim_layout(spec, sharding.dim)
        ends = torch.tensor([a + n for a, n in zip(starts, sharding.sizes)], device=owners.device)
        coordinate = torch.searchsorted(ends, indices[sharding.dim - first], right=True)
        owners, mine = owners * group.size + coordinate, mine * group.size + group.index
    if bool((owners[1:] < owners[:-1]).any()):
        return None
    counts = torch.bincount(owners, minlength=math.prod(len(s.sizes) for s in split)).tolist()
    begin = sum(counts[:mine])
    offsets = spec.local_offsets()
    local = [index[begin : begin + counts[mine]] - offsets[d] for d, index in zip(x_dims, indices)]
    out = x.to_local()[(slice(None),) * first + tuple(local)]
    axes = tuple(axis for s in split for axis in s.axes)
    placements, sizes, order = list(spec.placements), {first: tuple(counts)}, {first: axes}
    for axis in axes:
        placements[axis] = Shard(first)
    for sharding in spec.shardings:
        if first <= sharding.dim < first + len(indices):
            continue
        d = sharding.dim if sharding.dim < first else sharding.dim - len(indices) + 1
        for axis in sharding.axes:
            placements[axis] = Shard(d)
        sizes[d], order[d] = sharding.sizes, sharding.axes
    out_spec = ShardTensorSpec.build(
        spec.mesh,
        placements,
        (*x.shape[:first], shape[0], *x.shape[first + len(indices) :]),
        out.dtype,
        dict(sorted(sizes.items())),
        order=dict(sorted(order.items())),
    )
    return from_local_spec(out, out_spec)


@register_function_handler(torch.index_select, torch.Tensor.index_select)
def _index_select(func, args, kwargs):
    a = bind(func, args, kwargs)  # out= is the functions' keyword; the in-place methods have none
    if a.get("out") is not None:
        return NotImplemented
    index = _replicated_index(a.index)
    if index is not None:
        if index.ndim > 1:
            return NotImplemented
        return _through_replicated(func, a.input, a.dim, index.reshape(-1), cell_wise=False)
    if _split_index(a.input, a.dim, a.index, cell_wise=False):
        if a.index.ndim != 1:
            return NotImplemented
        return _through_replicated(func, a.input, a.dim, a.index, cell_wise=False, split=True)
    indexed = _indexed(a.input, a.dim, a.index)
    if indexed is None or indexed.index.ndim > 1:
        return NotImplemented
    return _select_rows(indexed, "index_select", wrap_negative=False, keep_0d_dim=True)


def _select_rows(
    indexed: _Indexed, what: str, *, wrap_negative: bool, keep_0d_dim: bool
) -> ShardTensor:
    """``x`` with ``dim`` replaced by the index's dims (a 0-d index keeps a size-1 dim when
    ``keep_0d_dim``, as ``index_select`` does)."""
    plan = indexed.plan(wrap_negative=wrap_negative, what=what)
    rows = _extended_rows(indexed, plan)
    dim, index = indexed.dim, plan.local_index
    if keep_0d_dim:
        index = index.reshape(-1)
    out = rows[(slice(None),) * dim + (index,)]
    index_shape = indexed.index_shape if index.ndim else ()
    if keep_0d_dim and not index_shape:
        index_shape = (1,)
    shape = tuple(indexed.x.shape[:dim]) + index_shape + tuple(indexed.x.shape[dim + 1 :])
    sharded_dim = dim + indexed.index_sharding.dim
    return from_local_spec(out, _output_spec(indexed, shape, out.dtype, sharded_dim))


@register_function_handler(torch.gather, torch.Tensor.gather)
def _gather(func, args, kwargs):
    a = bind(func, args, kwargs)
    if a.get("out") is not None:
        return NotImplemented
    if _replicated_index(a.index) is not None:
        return _through_replicated(
            func, a.input, a.dim, a.index, cell_wise=True, probe=(args, kwargs)
        )
    if _split_index(a.input, a.dim, a.index, cell_wise=True):
        return _through_replicated(
            func, a.input, a.dim, a.index, cell_wise=True, probe=(args, kwargs), split=True
        )
    indexed = _indexed(a.input, a.dim, a.index)
    if indexed is None or indexed.index_sharding.dim != indexed.dim:
        return NotImplemented
    plan = indexed.plan(what="gather")
    out = _extended_rows(indexed, plan).gather(indexed.dim, plan.local_index)
    spec = _output_spec(indexed, indexed.index_shape, out.dtype, indexed.dim)
    return from_local_spec(out, spec)


# NOTE [A gather through a replicated index keeps the input's layout]
# A gather (``x[idx]``, ``index_select``, ``gather``) whose index every rank holds whole
# computes on each rank the part of the output its own shard of ``x`` anchors, and moves only
# rows of the gathered dim (cells of them, for ``gather``). Along a sharded dim ``d`` of ``x`` other than the gathered one,
# ``gather``'s output cell reads ``x`` in the same position along ``d``, so each rank takes the
# index's positions of its own range (cut at the index's extent) and its output is sharded
# along ``d`` with those sizes; ``x[idx]`` and ``index_select`` keep ``x``'s sizes there. Along
# the gathered dim, when it is sharded, an output of ``x``'s extent there (a permutation,
# ``take_along_dim`` with an index of ``x``'s shape) keeps ``x``'s sizes: each rank reads its
# own range of the index and receives the remote rows (cells) that range names (every rank knows
# every rank's range: a plan built without communication, ``gather_plan(sliced=...)``). A
# selection's output of another extent through a 1-D index is split by its entries' owners
# (NOTE [A selection through a replicated index is split by its entries' owners]): nothing
# moves when those never decrease along the index (a sorted index, ``x[[1, 2]]``, ``take``).
# Any other output of another extent (``gather``'s, or through an index of several dims) is
# replicated over those axes, each rank receiving every remote row (or cell) the index names:
# a gather the guard governs (``check_replicated_read``); so is a selection's fetch, through a
# replicated or a sharded index, that leaves a rank holding every row of the gathered dim, at
# least half of them fetched (``check_fetch``, NOTE [Gathers an op was not asked to make]). The index's range is checked on the whole
# index, so every rank raises alike, naming its first entry out of range
# (``_first_out_of_range``). ``gather`` through an index already split so, as ``x``'s other
# dims cut at its extent and whole over the gathered dim's axes (an ``argmax`` of ``x`` with
# ``keepdim``), reads the same way: each group of ranks along those axes holds its part of the
# index whole, which is all it would read of a replicated one; so do ``x[idx]`` and
# ``index_select`` through an index split over axes that split no dim of ``x``, their output
# split like the index on its dims and replicated over the read dim's axes, ``x``'s gradient
# summed over the index's axes (each group read a different part). One all-reduce over the
# mesh shares the range check, naming the entry of least position in the whole index as a
# replicated one would, and, for a selection's ``check_fetch``, every rank's rows fetched
# (``_agreed_rows``).
# A selection through an index split over an axis that splits another dim of ``x`` is not
# served (its output would be split over that axis on two dims): it takes the default path.
# For ``x[idx]`` and ``index_select`` a row of the rank's block is the unit that moves, the
# byte bound of the output's layout; ``gather`` reads single cells, and a cell is the unit
# that moves (NOTE [A cell-wise read moves cells] in ``_gather_plan``): a rank receives the
# distinct remote cells its part of the output reads, at most that part's size, so such a
# fetch is never a gather (no ``check_fetch``). A selection replicated over the gathered
# dim's axes is instead the sum over them of what each rank reads of its own rows (zeros
# where the index names another's), one all-reduce of the read (``summed_read``), where that
# moves fewer bytes than the fetch onto the rank of the group that receives most
# (``_summing_is_cheaper``; never for cells, which the fetch moves at most once each). The
# backward is the plan's adjoint (the halo rows or cells go home); at the aten level, torch's
# ``scatter_add``, ``index_add`` or accumulating ``index_put`` of the gradient into the zeros
# it makes (sharded like the input, ``_factory_ops``) takes ``_added_through_replicated``.
@dataclass(frozen=True)
class _Reading:
    """What this rank reads of a tensor sharded on any dims through a replicated index (NOTE
    [A gather through a replicated index keeps the input's layout]).

    Attributes
    ----------
    index : Tensor
        This rank's part of the index, as positions into its own rows along the gathered dim
        followed by the halo rows ``plan`` brings (its own rows alone without a plan).
    plan : GatherPlan or None
        The rows of the gathered dim that move; None when that dim is not split.
    replicated : bool
        Whether the output is replicated over the gathered dim's axes (every rank of that
        group reads the whole index), rather than sharded like the input there.
    spec : ShardTensorSpec
        The output's layout.
    """

    index: torch.Tensor
    plan: GatherPlan | None
    replicated: bool
    spec: ShardTensorSpec


def _reading(
    func, x: ShardTensor, dim: int, index: torch.Tensor, *, cell_wise: bool,
    split: ShardTensorSpec | None = None,
) -> _Reading:  # fmt: skip
    """How this rank reads ``x`` through the replicated ``index`` along ``dim`` (non-negative,
    checked in range on every rank alike): ``gather`` (``cell_wise``: the index has ``x``'s
    dims) or a selection (the index's dims replace ``dim``). ``split``: the index's layout
    when ``index`` is this rank's part of one whole over ``dim``'s axes (``_split_index``),
    which is then not cut again; a selection's output is split like it on the index's dims
    and replicated over ``dim``'s axes."""
    spec, extent = x._spec, x.shape[dim]
    shape = tuple(index.shape) if split is None else tuple(split.shape)
    shape = shape if cell_wise else (*x.shape[:dim], *shape, *x.shape[dim + 1 :])
    starts, local_sizes = spec.local_offsets(), spec.local_shape()
    placements = [Replicate()] * spec.mesh.ndim
    sizes, order = {}, {}

    def shard_output(out_dim: int, axes: tuple[int, ...], dim_sizes: tuple[int, ...]) -> None:
        for axis in axes:
            placements[axis] = Shard(out_dim)
        sizes[out_dim], order[out_dim] = dim_sizes, axes

    for sharding in spec.shardings:
        d = sharding.dim
        if d == dim:
            continue
        if not cell_wise:
            shard_output(d if d < dim else d + index.ndim - 1, sharding.axes, sharding.sizes)
            continue
        n = shape[d]  # gather reads position i along d from x's position i
        shard_output(d, sharding.axes, sizes_at_extent(sharding.sizes, n))
        if split is not None:
            continue
        begin = min(starts[d], n)
        index = index.narrow(d, begin, min(starts[d] + local_sizes[d], n) - begin)
    if split is not None and not cell_wise:
        for sharding in split.shardings:
            shard_output(dim + sharding.dim, sharding.axes, sharding.sizes)
    plan, sliced = None, None
    if dim in spec.sharding_by_dim:
        sharding, group, group_starts = dim_layout(spec, dim)
        runs = not cell_wise and split is None  # a split index's groups would hold other runs
        if runs and index.ndim == 1 and index.shape[0] != extent:
            # NOTE [A selection through a replicated index is split by its entries' owners]
            owners = _owners(index, sharding.sizes, group_starts)
            counts = tuple(int(n) for n in torch.bincount(owners, minlength=group.size))
            shard_output(dim, sharding.axes, counts)
            out_spec = _built(spec, placements, shape, sizes, order)
            if not bool((owners[1:] < owners[:-1]).any()):  # each rank reads its own rows
                before = sum(counts[: group.index])
                local = index[before : before + counts[group.index]] - group_starts[group.index]
                return _Reading(local, None, False, out_spec)
            plan = gather_plan(
                index, sharding.sizes, group, replicated=True, sliced=0, parts=counts,
                what=func.__name__,
            )  # fmt: skip
            return _Reading(plan.local_index, plan, False, out_spec)
        sliced = dim if cell_wise else 0
        selection_cut = index.ndim == 1 and split is None  # a split index's parts are not cut
        if (not cell_wise and not selection_cut) or index.shape[sliced] != extent:
            sliced = None
        cells = (dim, tuple(local_sizes)) if cell_wise else None
        plan = gather_plan(
            index, sharding.sizes, group, replicated=True, sliced=sliced, cells=cells,
            what=func.__name__,
        )  # fmt: skip
        index = plan.local_index
        if sliced is not None:
            shard_output(dim, sharding.axes, sharding.sizes)
    out_spec = _built(spec, placements, shape, sizes, order)
    return _Reading(index, plan, plan is not None and sliced is None, out_spec)


def _built(spec: ShardTensorSpec, placements, shape, sizes: dict, order: dict) -> ShardTensorSpec:
    """The output layout ``_reading`` states, on ``spec``'s mesh and dtype, remembering the
    input's shardings at the input's dims, where its backward's zeros take them (NOTE [New
    tensors of a backward take the forward's layout] in ``_factory_ops``)."""
    return ShardTensorSpec.build(
        spec.mesh,
        placements,
        shape,
        spec.dtype,
        {d: sizes[d] for d in sorted(sizes)},
        order={d: order[d] for d in sorted(order)},
        hints=merged_hints(spec.hints, spec.shardings),
    )


# NOTE [A selection through a replicated index is split by its entries' owners]
# ``x[index]`` (``index_select``, aten ``index``, and their adjoints) through a replicated 1-D
# index along a split dim, of another extent than that dim: the output's dim is split over the
# same axes, rank ``r`` holding as many entries as name rows rank ``r`` owns, in the index's
# order (``_reading``). Where the owners never decrease along the index (a sorted index), each
# rank's entries are its own rows and nothing moves. Otherwise no layout puts every output
# cell on the rank holding the row it reads (NOTE [An output cell belongs to the shard it
# depends on] in ``tests/expected_layouts.py`` then states nothing), and each rank fetches
# the distinct remote rows its run of entries names, a plan every rank computes alone since
# every rank knows every rank's run (``gather_plan(sliced=0, parts=...)``): at most its
# output's rows, where a replicated output made every rank hold the whole read and fetch every
# remote row the index names. The backward sends the gradient's rows home (the plan's adjoint,
# ``halo_reduce``, an ``index_add`` into their owners). A run naming every row, at least half
# of them remote, is still a gather the guard governs (``check_fetch``).
def _owners(index: torch.Tensor, sizes: tuple[int, ...], starts: list[int]) -> torch.Tensor:
    """The position in its group of the rank owning the row each entry of ``index`` names
    (the ranks' ``sizes`` rows from ``starts``)."""
    ends = torch.tensor([a + n for a, n in zip(starts, sizes)], device=index.device)
    return torch.searchsorted(ends, index, right=True)


def _checked_index(func, x: ShardTensor, dim: int, index: object) -> torch.Tensor:
    """The replicated ``index`` along ``dim`` of ``x``, Python's negative positions wrapped
    for ``x[index]``, checked in range on every rank alike."""
    index, extent = _replicated_index(index), x.shape[dim]
    if func is torch.Tensor.__getitem__ and bool((index < 0).any()):
        index = torch.where(index < 0, index + extent, index)
    _check_in_range(func, index, dim, extent)
    return index


def _through_replicated(
    func, x: object, dim: int, index: object, *, cell_wise: bool, probe: tuple | None = None,
    split: bool = False,
) -> object:  # fmt: skip
    """``gather`` (``cell_wise``: the index has ``x``'s dims) or ``x[index]`` /
    ``index_select`` (the index's dims replace ``dim``) through a replicated index (NOTE [A
    gather through a replicated index keeps the input's layout]); ``probe``: the call's
    ``(args, kwargs)``, for torch's errors on shapes; ``split``: through a ShardTensor index
    whole over ``dim``'s axes (``_split_index``), each group of ranks along them reading
    through its part."""
    if not isinstance(x, ShardTensor) or x.ndim == 0 or not accepts(x):
        return NotImplemented
    if probe is not None:
        probe_on_meta(func, *probe)  # torch's errors for shapes and dtypes, on every rank
    dim = dim % x.ndim
    rows, held = x.to_local(), None
    if split:
        layout, index = index._spec, index.to_local()
        if func is torch.Tensor.__getitem__:  # Python's negative positions
            index = torch.where(index < 0, index + x.shape[dim], index)
        if not cell_wise:  # x is whole over the index's axes, each group reading its part
            rows = x.to_local(grad_placements=_summed_over(x._spec, sharding_axes(layout)))
        bad = _first_out_of_range(index, x.shape[dim])
        reading, read_dim, gathering = None, dim, cell_wise
        if bad is None:
            reading = _reading(func, x, dim, index, cell_wise=cell_wise, split=layout)
            rows, read_dim, gathering = _read_rows(rows, dim, reading, cell_wise)
        summed = reading is not None and _summing_is_cheaper(rows, read_dim, reading)
        fetched = None if reading is None or summed or reading.plan is None else reading.plan
        # a cell-wise read fetches at most its output's part (NOTE [A cell-wise read moves cells])
        held = _agreed_rows(func, x._spec, dim, layout, bad, fetched, rows=not cell_wise)
    else:
        index = _checked_index(func, x, dim, index)
        reading = _reading(func, x, dim, index, cell_wise=cell_wise)
        rows, read_dim, gathering = _read_rows(rows, dim, reading, cell_wise)
        summed = _summing_is_cheaper(rows, read_dim, reading)
        if reading.plan is not None and not reading.replicated and not cell_wise:
            held = _rows_held(x._spec.sharding_by_dim[dim].sizes, reading.plan)
    if reading.plan is not None:
        counted = reading.replicated and check_replicated_read(x._spec, reading.spec)
        if held is not None and not counted:
            check_fetch(x._spec, dim, held)
        if summed:
            out = summed_read(_owned_entries(rows, read_dim, reading), reading.plan)
            return from_local_spec(out, reading.spec.with_dtype(out.dtype))
        rows = halo_extend(rows, reading.plan, read_dim, replicated_output=reading.replicated)
    local = reading.index
    out = rows.gather(read_dim, local) if gathering else rows[(slice(None),) * read_dim + (local,)]
    return from_local_spec(out, reading.spec.with_dtype(out.dtype))


def _read_rows(
    rows: torch.Tensor, dim: int, reading: _Reading, cell_wise: bool
) -> tuple[torch.Tensor, int, bool]:
    """``(rows, dim, cell_wise)`` as ``reading`` reads them: for a cell-wise read whose plan
    moves cells (NOTE [A cell-wise read moves cells]), this rank's block with ``dim`` first,
    flattened, read as a selection along dim 0; else as given."""
    if not cell_wise or reading.plan is None:
        return rows, dim, cell_wise
    return rows.movedim(dim, 0).reshape(-1), 0, False


def _summing_is_cheaper(rows: torch.Tensor, dim: int, reading: _Reading) -> bool:
    """Whether a read replicated over ``dim``'s axes (NOTE [A gather through a replicated
    index keeps the input's layout]) moves fewer bytes as one all-reduce of what each rank
    reads of its own ``rows`` (``summed_read``: a ring's ``2 (n - 1) / n`` of the read) than
    as the fetch of the whole remote rows it names onto the rank that receives most: the same
    answer on every rank of the group, which reads the same index into the same other dims'
    ranges. Never for a cell-wise read, whose rows are single cells (``_read_rows``): it
    fetches at most what it reads. Not for complex values."""
    plan = reading.plan
    if plan is None or not reading.replicated or rows.is_complex():
        return False
    per_row = math.prod(n for d, n in enumerate(rows.shape) if d != dim)
    fetched = max(sum(counts) for counts in plan.halo_counts) * per_row
    read = reading.index.numel() * per_row
    return 2 * (plan.group.size - 1) * read < plan.group.size * fetched


def _owned_entries(rows: torch.Tensor, dim: int, reading: _Reading) -> torch.Tensor:
    """The read through ``reading``'s index of this rank's own ``rows`` along ``dim``, zeros
    where it names another rank's rows: this rank's term of ``summed_read``."""
    plan, local = reading.plan, reading.index
    inside = local < plan.owned  # the plan numbers a rank's own rows first
    if plan.owned == 0:  # a row of zeros to read, so that the read stays connected to ``rows``
        rows = torch.cat(
            [rows, rows.new_zeros([1 if d == dim else n for d, n in enumerate(rows.shape)])], dim
        )
    read = rows[(slice(None),) * dim + (torch.where(inside, local, 0),)]
    inside = inside.reshape((1,) * dim + tuple(inside.shape) + (1,) * (rows.ndim - dim - 1))
    return torch.where(inside, read, read.new_zeros(()))


def _split_index(x: object, dim: int, index: object, *, cell_wise: bool) -> bool:
    """Whether a read from ``x``, split along ``dim``, takes the ShardTensor ``index`` split
    over other mesh axes, whole over ``dim``'s: for ``gather`` (``cell_wise``), split as
    ``x``'s other dims cut at the index's extent (``x.gather(0, x.argmax(0, keepdim=True))``
    on a 2x2 mesh); for a selection (``x[index]``, ``index_select``), over axes that split no
    dim of ``x`` (its output is split there on the index's dims). Each group of ranks along
    ``dim``'s axes holds one part of the index, whole among them, and reads through it as
    through a replicated index (NOTE [A gather through a replicated index keeps the input's
    layout]). A selection through an index split over an axis that splits another dim of
    ``x`` is not one: its output would be split over that axis on two dims."""
    if not isinstance(x, ShardTensor) or not isinstance(index, ShardTensor) or x.ndim == 0:
        return False
    spec, layout, dim = x._spec, index._spec, dim % x.ndim
    if index.dtype not in _INDEX_DTYPES or layout.mesh != spec.mesh or layout.partial:
        return False
    if dim not in spec.sharding_by_dim or not layout.shardings:
        return False
    if not cell_wise:
        return not sharding_axes(layout) & sharding_axes(spec)
    return index.ndim == x.ndim and _split_as_elsewhere(layout, spec, dim)


def _split_as_elsewhere(layout: ShardTensorSpec, spec: ShardTensorSpec, dim: int) -> bool:
    """Whether ``layout`` (of as many dims as ``spec``) splits every dim but ``dim`` as
    ``spec`` does, cut at ``layout``'s extents, and leaves ``dim`` whole."""
    wanted = {
        s.dim: (s.axes, sizes_at_extent(s.sizes, layout.shape[s.dim]))
        for s in spec.shardings
        if s.dim != dim
    }
    return {s.dim: (s.axes, s.sizes) for s in layout.shardings} == wanted


def _agreed_rows(
    func, spec: ShardTensorSpec, dim: int, layout: ShardTensorSpec,
    bad: tuple[int, int] | None, fetch: GatherPlan | None, *, rows: bool,
) -> list[tuple[int, int]] | None:  # fmt: skip
    """For a read from ``x`` (laid out as ``spec``) along ``dim`` through an index laid out as
    ``layout``, whole over ``dim``'s axes (``_split_index``), of which this rank's part holds
    ``bad``, the ``(flat position, value)`` of its first entry outside ``dim``'s extent
    (``_first_out_of_range``), or None: torch's ``IndexError`` on every rank alike, naming the
    entry of least position in the whole index, as ``_check_in_range`` would. Else, with
    ``rows``, the ``(rows owned, rows held after the fetch)`` of ``dim`` on every rank of the
    mesh, for ``check_fetch`` (a rank that fetches nothing, ``fetch`` None, holds none more).
    Each rank knows its own part of both (the groups along ``dim``'s axes read different parts
    of the index); one all-reduce over the mesh shares them: one number for the range
    (``_ranked``), then, with ``rows``, one per rank."""
    ranks = spec.mesh.mesh.flatten().tolist()
    shared = torch.full((1 + len(ranks) * rows,), -1, dtype=torch.int64)
    if bad is not None:
        shared[0] = _ranked(_global_position(layout, bad[0]), bad[1])
    elif rows and fetch is not None:
        shared[1 + ranks.index(spec.mesh.get_rank())] = fetch.owned + fetch.halo
    shared = all_reduce(shared, axis_group(spec.mesh, tuple(range(spec.mesh.ndim))), "max")
    if shared[0] >= 0:
        raise _out_of_range(func, _unranked(int(shared[0])), dim, spec.shape[dim])
    if not rows:
        return None
    coordinates = itertools.product(*map(range, spec.mesh_shape))  # the ranks' order above
    owned = [spec.local_shape(c)[dim] for c in coordinates]
    return [(n, max(n, held)) for n, held in zip(owned, shared[1:].tolist())]


_WORD = 1 << 32


def _ranked(position: int, value: int) -> int:
    """A bad index entry as one non-negative int64 whose maximum over the ranks is the entry
    of least position (below ``2**31``; the first ``2**31 - 1`` positions are told apart) and
    carries its value (saturated to int32, ``_unranked``)."""
    order = (1 << 31) - 1 - min(position, (1 << 31) - 1)
    return order * _WORD + min(max(value, -(1 << 31)), (1 << 31) - 1) + (1 << 31)


def _unranked(ranked: int) -> int | str:
    """The value ``_ranked`` carries; beyond int32 by its bound (``">= 2147483647"``)."""
    value = ranked % _WORD - (1 << 31)
    if value == (1 << 31) - 1:
        return f">= {value}"
    return f"<= {value}" if value == -(1 << 31) else value


def _global_position(layout: ShardTensorSpec, position: int) -> int:
    """The row-major position in the whole tensor laid out as ``layout`` of the entry at
    row-major ``position`` in this rank's part of it."""
    coordinate = []
    for n in reversed(layout.local_shape()):
        position, at = divmod(position, n)
        coordinate.append(at)
    flat = 0
    for at, offset, n in zip(reversed(coordinate), layout.local_offsets(), layout.shape):
        flat = flat * n + offset + at
    return flat


def _summed_over(spec: ShardTensorSpec, axes: set[int]) -> list:
    """``spec``'s placements with ``Partial`` on ``axes`` (over which it is replicated): the
    gradient of a shard each rank along them read a different part of."""
    return [Partial() if axis in axes else p for axis, p in enumerate(spec.placements)]


def _cut_for(x: ShardTensor, source: ShardTensorSpec) -> ShardTensor:
    """``x``, which every rank holds whole (a plain destination), sharded like the gather's
    output ``source``, a dim longer than the source's with its extra cells on the last rank:
    a layout from which that gather reads ``source``'s layout (NOTE [A gather through a
    replicated index keeps the input's layout]), the one ``new_zeros`` gives the zeros of
    torch's backward (``_factory_ops``). A local slice; nothing moves."""
    sizes = {s.dim: sizes_at_extent(s.sizes, x.shape[s.dim]) for s in source.shardings}
    order = {s.dim: s.axes for s in source.shardings}
    spec = ShardTensorSpec.build(
        x._spec.mesh, source.placements, x.shape, x.dtype, sizes, order=order
    )
    return from_local_spec(spec.narrow(x.to_local()), spec)


def _added_through_replicated(
    func, x: object, dim: int, index: object, src: object, add, *,
    cell_wise: bool, in_place: bool, probe: tuple | None,
) -> object:  # fmt: skip
    """``add(into, dim, index, values)`` (``scatter_add``: ``cell_wise``, the index has ``x``'s
    dims; ``index_add``, ``index_put`` with ``accumulate``: the index's dims replace ``dim``)
    through a replicated index of a source laid out as the gather from ``x`` with that index
    would be: the adjoint of that gather, its backward (NOTE [A gather through a replicated
    index keeps the input's layout]). Each rank adds its block of the source into its rows
    and the halo rows the gather read, and the halo rows travel back to their owners, unless
    the source is replicated over the gathered dim's axes (then each rank keeps the sums of its
    own rows: every value is on every rank of that group). A destination every rank holds
    whole is first cut to a layout that ``gather`` reads (``_cut_for``). ``probe``: the call's
    ``(args, kwargs)``, for torch's errors on shapes (None: the caller probed)."""
    if not isinstance(x, ShardTensor) or x.ndim == 0 or not accepts(x, src):
        return NotImplemented
    if probe is not None:
        probe_on_meta(func, *probe)  # torch's errors for shapes and dtypes, on every rank
    dim = dim % x.ndim
    if not x._spec.shardings:
        if in_place or not cell_wise:
            return NotImplemented  # the result would not fit the destination's layout
        x = _cut_for(x, src._spec)
    reading = _reading(func, x, dim, _checked_index(func, x, dim, index), cell_wise=cell_wise)
    if not src._spec.same_layout(reading.spec):
        return NotImplemented
    destination, values, plan = x.to_local(), src.to_local(), reading.plan
    if plan is None:
        out = add(destination.clone(), dim, reading.index, values)
    else:
        into, at, _ = _read_rows(destination, dim, reading, cell_wise)
        shape = [plan.owned + plan.halo if d == at else n for d, n in enumerate(into.shape)]
        if cell_wise:  # the plan's cells, NOTE [A cell-wise read moves cells]
            total = into.new_zeros(shape).index_add_(
                0, reading.index.reshape(-1), values.reshape(-1)
            )
        else:
            total = add(into.new_zeros(shape), at, reading.index, values)
        if reading.replicated:
            total = total.narrow(at, 0, plan.owned)
        else:
            total = halo_reduce(total, plan, at)
        if cell_wise:
            moved = destination.movedim(dim, 0).shape
            total = total.reshape(moved).movedim(0, dim)
        out = destination + total
    result = from_local_spec(out, x._spec.with_dtype(out.dtype))
    return x.copy_(result) if in_place else result


def _sharded(t: object) -> bool:
    """Whether ``t`` is a ShardTensor split along some dim."""
    return isinstance(t, ShardTensor) and bool(t._spec.shardings)


def _masked_by_dtensor(x: object, dim: int, index: object) -> bool:
    """Whether DTensor's rule for a gather from ``x`` along ``dim`` through ``index`` would
    read ``x``'s rows there as a ``_MaskPartial``: an axis splits ``x`` along ``dim`` and the
    index is whole over it. shardsci's reductions do not have the mask that partial needs, so
    such a gather that no handler takes (an index split otherwise than ``x``'s other dims:
    ``_split_index``) takes the gathered fallback; an index split over that axis lets
    DTensor reshard ``x`` like the index instead."""
    if not isinstance(x, ShardTensor) or x.ndim == 0:
        return False
    sharding = x._spec.sharding_by_dim.get(dim % x.ndim)
    if sharding is None:
        return False
    if not isinstance(index, ShardTensor):
        return True
    return any(isinstance(index._spec.placements[axis], Replicate) for axis in sharding.axes)


# ---------------------------------------------------------------------------- scatters
def _source_local(indexed: _Indexed, source: object, dim: int) -> torch.Tensor | None:
    """This rank's part of the values scattered by a sharded index: a source sharded like the
    index along ``dim``, or this rank's slice of a replicated one; None to decline."""
    sharding = indexed.index_sharding
    if isinstance(source, ShardTensor) and source._spec.partial:
        return None
    if isinstance(source, ShardTensor) and source._spec.shardings:
        spec = source._spec
        if len(spec.shardings) != 1 or spec.shardings[0] != DimSharding(
            dim, sharding.axes, sharding.sizes
        ):
            return None
        return source.to_local()
    if not isinstance(source, torch.Tensor):
        return None
    whole = replicated_local(source, indexed.x._spec.mesh, set(sharding.axes))
    index_spec = indexed.index_spec
    offset = index_spec.local_offsets()[sharding.dim]
    return whole.narrow(dim, offset, index_spec.local_shape()[sharding.dim])


def _scatter_into_owned(
    indexed: _Indexed,
    plan: GatherPlan,
    local_scatter,
    like: torch.Tensor,
    *,
    with_counts: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sum of the values scattered into each owned row (and how many values each element
    received, with ``with_counts``): a local scatter into ``[owned | halo]`` rows, then the
    halo rows travel to their owners (one exchange)."""
    dim = indexed.dim
    shape = list(like.shape)
    shape[dim] = plan.owned + plan.halo
    total = local_scatter(like.new_zeros(shape), plan.local_index)
    if not with_counts:
        return halo_reduce(total, plan, dim), None
    with torch.no_grad():
        counts = local_scatter(like.new_zeros(shape), plan.local_index, ones=True)
    both = halo_reduce(torch.stack([total, counts.to(total.dtype)], -1), plan, dim)
    return both[..., 0], both[..., 1].detach()


def _scatter(
    indexed: _Indexed,
    source: object,
    reduce: str,
    include_self: bool,
    what: str,
    *,
    in_place: bool,
    alpha: float = 1,
) -> object:
    """``index_add`` (1-D index) or ``scatter_reduce`` into a sharded dim; ``in_place`` writes
    the result into the destination and returns it."""
    if indexed.index_sharding.dim != (0 if what == "index_add" else indexed.dim):
        return NotImplemented
    dim = indexed.dim
    values = _source_local(indexed, source, dim)
    if values is None:
        return NotImplemented
    if what != "index_add":
        # scatter reads only the part of the source its index covers
        values = values[tuple(slice(0, n) for n in indexed.index.shape)]
    destination = indexed.x.to_local()
    if in_place:
        # The local ops may save the destination for backward (amax compares with it); the
        # copy below must not overwrite what they saved.
        destination = destination.clone()
    plan = indexed.plan(what=what)

    def local_scatter(into: torch.Tensor, index: torch.Tensor, ones: bool = False):
        src = torch.ones_like(values) if ones else values
        if what == "index_add":
            return into.index_add(dim, index, src, alpha=1 if ones else alpha)
        return into.scatter_reduce(dim, index, src, "sum")

    if not plan.moves:
        if what == "index_add":
            out = destination.index_add(dim, plan.local_index, values, alpha=alpha)
        else:
            out = destination.scatter_reduce(
                dim, plan.local_index, values, reduce, include_self=include_self
            )
    elif reduce in ("amax", "amin") and destination.is_floating_point():
        out = _ScatterExtremum.apply(destination, values, plan, dim, reduce, include_self)
    elif reduce in ("sum", "mean") and destination.is_floating_point():
        total, counts = _scatter_into_owned(
            indexed,
            plan,
            local_scatter,
            destination,
            with_counts=reduce == "mean" or not include_self,
        )
        out = _combined(destination, total, counts, reduce, include_self)
    else:
        return NotImplemented
    result = from_local_spec(out, indexed.x._spec.with_dtype(out.dtype))
    return indexed.x.copy_(result) if in_place else result


class _ScatterExtremum(torch.autograd.Function):
    """``scatter_reduce`` amax/amin into owned rows from values that may target other ranks'
    rows: each rank reduces its values per target row, the partial extrema of halo rows travel
    to their owners (one exchange), and the backward shares each gradient evenly among all
    values equal to the result, on whichever rank they are, as torch does (counting a
    destination element equal to the result even when it is not included)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        destination: torch.Tensor,
        values: torch.Tensor,
        plan: GatherPlan,
        dim: int,
        reduce: str,
        include_self: bool,
    ) -> torch.Tensor:
        index = plan.local_index
        shape = list(destination.shape)
        shape[dim] = plan.owned + plan.halo
        identity = float("-inf") if reduce == "amax" else float("inf")
        partial = destination.new_full(shape, identity).scatter_reduce(dim, index, values, reduce)
        counts = destination.new_zeros(shape).scatter_add(dim, index, torch.ones_like(values))
        arrived = rows_sent_home(torch.stack([partial, counts], -1), plan, dim)
        owned = partial.narrow(dim, 0, plan.owned).index_reduce(
            dim, plan.send_rows, arrived[..., 0], reduce
        )
        touched = summed_rows(counts, plan, dim) > 0
        if include_self:
            owned = (
                torch.maximum(owned, destination)
                if reduce == "amax"
                else torch.minimum(owned, destination)
            )
        result = torch.where(touched, owned, destination)
        ctx.save_for_backward(destination, values, result, touched)
        ctx.plan, ctx.dim, ctx.include_self = plan, dim, include_self
        return result

    @staticmethod
    @first_order_only("scatter_reduce amax/amin across ranks")
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        destination, values, result, touched = ctx.saved_tensors
        plan, dim, index = ctx.plan, ctx.dim, ctx.plan.local_index
        result_rows = extended_rows(result, plan, dim)
        value_is_result = values == result_rows.gather(dim, index)
        ties = summed_rows(
            torch.zeros_like(result_rows).scatter_add(dim, index, value_is_result.to(grad.dtype)),
            plan,
            dim,
        )
        self_is_result = (destination == result).to(grad.dtype)
        shared = grad / (ties + self_is_result)
        grad_values = value_is_result * extended_rows(shared, plan, dim).gather(dim, index)
        grad_destination = self_is_result * shared
        if not ctx.include_self:
            grad_destination = torch.where(touched, 0.0, grad_destination)
        return grad_destination, grad_values, None, None, None, None


def _combined(
    destination: torch.Tensor,
    total: torch.Tensor,
    counts: torch.Tensor | None,
    reduce: str,
    include_self: bool,
) -> torch.Tensor:
    """torch's ``scatter_reduce`` result from the destination, the sum of the values each
    element received and their number."""
    if reduce == "sum":
        return destination + total if include_self else torch.where(counts > 0, total, destination)
    if include_self:
        return (destination + total) / (counts + 1)
    return torch.where(counts > 0, total / counts.clamp(min=1), destination)


@register_function_handler(torch.index_add, torch.Tensor.index_add, torch.Tensor.index_add_)
def _index_add(func, args, kwargs):
    a = bind(func, args, kwargs)
    if _replicated_index(a.index) is not None and a.get("out") is None:
        alpha, in_place = a.alpha, func is torch.Tensor.index_add_
        if _sharded(a.source) and _replicated_index(a.index).ndim == 1:
            return _added_through_replicated(
                func, a.input, a.dim, a.index, a.source,
                lambda into, dim, index, src: into.index_add_(dim, index, src, alpha=alpha),
                cell_wise=False, in_place=in_place, probe=(args, kwargs),
            )  # fmt: skip
        return _index_by_owner(
            func, args, kwargs, a,
            lambda into, dim, index, src: into.scatter_add_(
                dim, index, src if alpha == 1 else src * alpha
            ),
            in_place=in_place,
        )  # fmt: skip
    indexed = _indexed(a.input, a.dim, a.index) if a.get("out") is None else None
    if indexed is None or indexed.index.ndim != 1:
        return NotImplemented
    in_place = func is torch.Tensor.index_add_
    return _scatter(indexed, a.source, "sum", True, "index_add", in_place=in_place, alpha=a.alpha)


@register_function_handler(torch.scatter_add, torch.Tensor.scatter_add, torch.Tensor.scatter_add_)
def _scatter_add(func, args, kwargs):
    a = bind(func, args, kwargs)
    if _replicated_index(a.index) is not None and a.get("out") is None:
        in_place = func is torch.Tensor.scatter_add_
        if _sharded(a.src):
            return _added_through_replicated(
                func, a.input, a.dim, a.index, a.src,
                lambda into, dim, index, src: into.scatter_add_(dim, index, src),
                cell_wise=True, in_place=in_place, probe=(args, kwargs),
            )  # fmt: skip
        return _scatter_by_owner(
            func, args, kwargs, a.input, a.dim, a.index, a.src,
            lambda into, dim, index, src: into.scatter_add_(dim, index, src),
            in_place=in_place,
        )  # fmt: skip
    indexed = _indexed(a.input, a.dim, a.index) if a.get("out") is None else None
    if indexed is None:
        return NotImplemented
    in_place = func is torch.Tensor.scatter_add_
    return _scatter(indexed, a.src, "sum", True, "scatter_add", in_place=in_place)


@register_function_handler(
    torch.scatter_reduce, torch.Tensor.scatter_reduce, torch.Tensor.scatter_reduce_
)
def _scatter_reduce(func, args, kwargs):
    a = bind(func, args, kwargs)
    if _replicated_index(a.index) is not None and a.get("out") is None:
        return _scatter_by_owner(
            func, args, kwargs, a.input, a.dim, a.index, a.src,
            lambda into, dim, index, src: into.scatter_reduce_(
                dim, index, src, a.reduce, include_self=a.include_self
            ),
            in_place=func is torch.Tensor.scatter_reduce_,
        )  # fmt: skip
    indexed = _indexed(a.input, a.dim, a.index) if a.get("out") is None else None
    if indexed is None:
        return NotImplemented
    in_place = func is torch.Tensor.scatter_reduce_
    return _scatter(indexed, a.src, a.reduce, a.include_self, "scatter_reduce", in_place=in_place)


# ---------------------------------------------------------------------------- replicated index
# NOTE [Scatters through a replicated index write where they land]
# A scatter whose index (and source) every rank holds whole writes into a destination
# sharded on any dims without moving anything: along a dim other than the scatter's, the
# rank takes the index and source rows of its own range (position i along that dim writes
# row i); along the scatter's dim, it keeps the entries whose index lands in its range,
# shifted to its shard, and sends the others to one extra slice appended to its shard and
# dropped afterwards, so every reduction (sum, mean, prod, amax, amin, assignment) and its
# backward see exactly the entries of that range, include_self or not. The local scatter
# writes in place into that new buffer, so the op holds one new shard, as torch's own
# out-of-place scatter does. The source's gradient is a partial sum over the sharding axes
# (``replicated_local``). The index's range is checked on the whole index, so every rank
# raises alike: on the CPU torch's ``IndexError``; on an accelerator a device-side assert, as
# torch's own kernels do there, with no wait for the device. ``index_put`` and ``index_fill``
# are such scatters (``index_fill`` marks its rows in a vector of the shard's rows instead).
def _replicated_index(index: object) -> torch.Tensor | None:
    """The whole index every rank holds: a plain integer tensor or a replicated ShardTensor's
    local one; None for anything else."""
    if isinstance(index, ShardTensor):
        if index._spec.shardings or index._spec.partial:
            return None
        index = index._local
    if not isinstance(index, torch.Tensor) or index.dtype not in _INDEX_DTYPES:
        return None
    return index


def _shifted(index: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """``index``'s positions in ``[start, start + size)`` shifted to a shard starting at
    ``start``, the others sent to the spare slice at ``size``: computed once per distinct
    element of a broadcast index (an expanded view) and expanded again, so that no tensor of
    the expanded size is made (for a scatter of the ``index_*`` family, the source's size)."""
    distinct, shape = compact(index)
    inside = (distinct >= start) & (distinct < start + size)
    return torch.where(inside, distinct - start, size).expand(shape)


def _scatter_by_owner(
    func,
    args,
    kwargs,
    x: object,
    dim: int,
    index: object,
    src: object,
    scatter,
    *,
    in_place: bool,
    checked: bool = False,
    rows: torch.Tensor | None = None,
) -> object:
    """``scatter(into, dim, index, src)``, which writes into ``into`` in place, into a
    destination sharded on any dims, with a replicated index and source (NOTE [Scatters
    through a replicated index write where they land]); ``in_place`` writes the result into
    ``x`` and returns it. ``checked``: the caller
    has probed the call and found the index in range (before expanding it). ``rows``: the
    1-D index ``index`` expands along ``dim`` (an ``index_*`` op), with which a source split
    by its entries' owners is sent to them (``_runs_of``)."""
    if not isinstance(x, ShardTensor) or x.ndim == 0 or not accepts(x):
        return NotImplemented
    spec, index, dim = x._spec, _replicated_index(index), dim % x.ndim
    partial = isinstance(src, ShardTensor) and bool(src._spec.partial)
    runs = _runs_of(src, spec, dim) if rows is not None and _sharded(src) else None
    block = _source_block(src, spec, dim, index) if _sharded(src) and runs is None else None
    if (_sharded(src) and block is None and runs is None) or partial:
        return NotImplemented
    if not checked:
        probe_on_meta(func, args, kwargs)  # torch's errors for shapes and dtypes, on every rank
        _check_in_range(func, index, dim, x.shape[dim])
    if runs is not None:  # NOTE [A source split by its entries' owners is sent to them]
        values, local_rows = _sent_to_owners(src, spec, dim, rows, runs)
        shape = [-1 if d == dim else 1 for d in range(values.ndim)]
        expanded = local_rows.reshape(shape).expand(values.shape)
        out = scatter(x.to_local().clone(), dim, expanded, values)
        result = from_local_spec(out, spec.with_dtype(out.dtype))
        return x.copy_(result) if in_place else result
    if isinstance(src, torch.Tensor) and block is None:
        src = replicated_local(src, spec.mesh, sharding_axes(spec))
    starts, sizes = spec.local_offsets(), spec.local_shape()
    for sharding in spec.shardings:
        d = sharding.dim
        if d == dim:
            continue
        begin = min(starts[d], index.shape[d])
        end = min(starts[d] + sizes[d], index.shape[d])
        index = index.narrow(d, begin, end - begin)
        if isinstance(src, torch.Tensor) and block is None:
            src = src.narrow(d, begin, end - begin)
    src = src if block is None else block
    # the output, written in place: one new shard (and a spare slice), as torch's own scatter
    destination = x.to_local()
    if dim in spec.sharding_by_dim:
        size = sizes[dim]
        index = _shifted(index, starts[dim], size)
        spare = destination.new_zeros([1 if d == dim else n for d, n in enumerate(sizes)])
        out = scatter(torch.cat([destination, spare], dim), dim, index, src).narrow(dim, 0, size)
    else:
        out = scatter(destination.clone(), dim, index, src)
    result = from_local_spec(out, spec.with_dtype(out.dtype))
    return x.copy_(result) if in_place else result


def _source_block(
    src: ShardTensor, spec: ShardTensorSpec, dim: int, index: torch.Tensor
) -> torch.Tensor | None:
    """This rank's block of a split ``src`` laid out as the ``gather`` through ``index`` from a
    tensor of layout ``spec`` along ``dim`` reads it when that output is not split along
    ``dim`` (NOTE [A gather through a replicated index keeps the input's layout]: split dims
    cut at the index's extent; a backward formula's masked source, ``scatter_reduce``'s prod,
    is such a gather), its gradient summed over the axes of ``dim``; None when it is laid out
    otherwise."""
    wanted = {
        s.dim: (s.axes, sizes_at_extent(s.sizes, index.shape[s.dim]))
        for s in spec.shardings
        if s.dim != dim
    }
    layout = src._spec
    if layout.mesh != spec.mesh or {s.dim: (s.axes, s.sizes) for s in layout.shardings} != wanted:
        return None
    axes = set(spec.sharding_by_dim[dim].axes) if dim in spec.sharding_by_dim else set()
    placements = [Partial() if a in axes else p for a, p in enumerate(layout.placements)]
    return src.to_local(grad_placements=placements)


# NOTE [A source split by its entries' owners is sent to them]
# An ``index_*`` scatter (``index_reduce``, ``index_copy``, their ``index_add`` through
# ``_added_through_replicated``) through a replicated 1-D index ``rows`` whose source is split
# along the scatter's dim over the destination's axes of that dim: rank ``r`` holds the source
# entries of a run of positions (``x[rows]`` split by its entries' owners gives one: NOTE [A
# selection through a replicated index is split by its entries' owners]; torch's backward of
# ``index_reduce`` scatters such a read). Every rank knows every run and every entry's owner
# (the index is replicated), so how many entries each rank sends each other is computed
# without communication: each entry travels once, to the rank owning the row it names (one
# all-to-all, ``_Exchanged``), arriving in the index's order (runs in rank order, each run's
# entries in order), and the owner scatters them into its rows locally: every reduction
# (sum, mean, prod, amax, amin, assignment) sees exactly the entries of its rows, in torch's
# order. Differentiable: the adjoint of the exchange is the exchange back. The source's other
# dims are split as the destination's (an ``index_*`` source has its shape there).
def _runs_of(src: ShardTensor, spec: ShardTensorSpec, dim: int) -> tuple[int, ...] | None:
    """The lengths of the ranks' runs of a source split along ``dim`` over the destination's
    axes of ``dim`` and like it on its other dims (NOTE above), else None."""
    layout = src._spec
    if layout.mesh != spec.mesh or dim not in spec.sharding_by_dim or layout.partial:
        return None
    along = layout.sharding_by_dim.get(dim)
    if along is None or along.axes != spec.sharding_by_dim[dim].axes:
        return None
    wanted = {
        s.dim: (s.axes, sizes_at_extent(s.sizes, src.shape[s.dim]))
        for s in spec.shardings
        if s.dim != dim
    }
    if {s.dim: (s.axes, s.sizes) for s in layout.shardings if s.dim != dim} != wanted:
        return None
    return tuple(along.sizes)


def _sent_to_owners(
    src: ShardTensor, spec: ShardTensorSpec, dim: int, rows: torch.Tensor, runs: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the source entries naming this rank's rows along ``dim``, in the index's order; the
    rows they name, local to this rank's shard): NOTE above. Differentiable."""
    sharding, group, starts = dim_layout(spec, dim)
    size, me = group.size, group.index
    owners = _owners(rows, sharding.sizes, starts)
    positions = torch.arange(rows.shape[0], device=rows.device)
    ends = torch.tensor(list(itertools.accumulate(runs)), device=rows.device)
    run_of = torch.searchsorted(ends, positions, right=True)
    counts = torch.bincount(run_of * size + owners, minlength=size * size).reshape(size, size)
    counts = tuple(tuple(int(n) for n in row) for row in counts.tolist())
    begin = sum(runs[:me])
    order = torch.argsort(owners[begin : begin + runs[me]], stable=True)
    values = src.to_local().movedim(dim, 0).index_select(0, order)
    arrived = _Exchanged.apply(values.contiguous(), counts, group)
    local_rows = (rows[owners == me] - starts[me]).to(torch.int64)  # scatters take int64
    return arrived.movedim(0, dim), local_rows


class _Exchanged(torch.autograd.Function):
    """Rows along dim 0 sent in consecutive pieces, ``counts[me][k]`` rows to rank ``k`` of
    ``group``, and those received, ``counts[k][me]`` rows from each rank ``k``, in rank order;
    the adjoint is the exchange back (``counts`` transposed)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, counts: tuple, group: AxisGroup):  # type: ignore[override]
        ctx.counts, ctx.group = counts, group
        return _exchanged(rows, counts, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        back = tuple(zip(*ctx.counts))
        if grad.requires_grad and torch.is_grad_enabled():
            return _Exchanged.apply(grad.contiguous(), back, ctx.group), None, None
        return _exchanged(grad.contiguous(), back, ctx.group), None, None


def _exchanged(rows: torch.Tensor, counts: tuple, group: AxisGroup) -> torch.Tensor:
    """``_Exchanged``'s forward, not differentiable."""
    me, trailing = group.index, tuple(rows.shape[1:])
    pieces = list(rows.split(list(counts[me])))
    received = exchange(
        group,
        pieces,
        lambda src, dst: (counts[src][dst], *trailing),
        dtype=rows.dtype,
        device=rows.device,
        kind="scatter",
    )
    return torch.cat(list(received))


@register_function_handler(torch.scatter, torch.Tensor.scatter, torch.Tensor.scatter_)
def _scatter_assign(func, args, kwargs):
    a = bind(func, args, kwargs, signature=_scatter_signature)
    src = a.value if a.src is None else a.src
    if _replicated_index(a.index) is None or a.out is not None:
        return NotImplemented
    reduce = {} if a.reduce is None else {"reduce": a.reduce}
    return _scatter_by_owner(
        func, args, kwargs, a.input, a.dim, a.index, src,
        lambda into, dim, index, source: into.scatter_(dim, index, source, **reduce),
        in_place=func is torch.Tensor.scatter_,
    )  # fmt: skip


def _scatter_signature(input, dim, index, src=None, *, value=None, reduce=None, out=None):
    """``torch.scatter``'s overloads: a source tensor or a ``value``, optionally reduced."""


def _check_in_range(func, index: torch.Tensor, dim: int, extent: int) -> None:
    """torch's ``IndexError`` for an index outside ``[0, extent)``, on every rank alike (every
    rank holds the whole index). On an accelerator, a device-side assert instead, without
    waiting for the device, as torch's own scatter kernels check their indices there."""
    if index.device.type != "cpu":
        message = f"{func.__name__}: an index is out of bounds for dim {dim} with size {extent}"
        in_range = ((index >= 0) & (index < extent)).all()
        torch.ops.aten._assert_async.msg(in_range, message)
        return
    bad = _first_out_of_range(index, extent)
    if bad is not None:
        raise _out_of_range(func, bad[1], dim, extent)


def _first_out_of_range(index: torch.Tensor, extent: int) -> tuple[int, int] | None:
    """``(flat position, value)`` of the first entry of ``index`` (row-major) outside
    ``[0, extent)``, else None: what both routes name, the replicated one from the whole index
    (``_check_in_range``), the split one from the part with the least position
    (``_agreed_rows``)."""
    outside = ((index < 0) | (index >= extent)).reshape(-1)
    if not bool(outside.any()):
        return None
    position = int(outside.to(torch.uint8).argmax())  # the first True
    return position, int(index.reshape(-1)[position])


def _out_of_range(func, value: int, dim: int, extent: int) -> IndexError:
    return IndexError(f"{func.__name__}: index {value} is out of bounds for dim {dim} with size "
                      f"{extent}")  # fmt: skip


def _index_by_owner(func, args, kwargs, a, scatter, *, in_place: bool) -> object:
    """An ``index_*`` op (its 1-D ``index`` along ``dim`` names the destination row of each
    row of ``source``) as the scatter ``scatter`` with that index expanded over the source,
    written where it lands (NOTE [Scatters through a replicated index write where they
    land])."""
    index, source = _replicated_index(a.index), a.source
    if (
        index.ndim > 1
        or not isinstance(source, torch.Tensor)
        or not isinstance(a.input, ShardTensor)
    ):
        return NotImplemented
    probe_on_meta(func, args, kwargs)  # torch's errors for shapes and dtypes, on every rank
    dim = a.dim % max(a.input.ndim, 1)
    return _scatter_rows_by_owner(
        func, args, kwargs, a.input, dim, index, source, scatter, in_place=in_place
    )


def _scatter_rows_by_owner(
    func, args, kwargs, x: ShardTensor, dim: int, index: torch.Tensor, source, scatter, *,
    in_place: bool,
) -> object:  # fmt: skip
    """``scatter`` of the rows of ``source`` along ``dim`` to the rows the 1-D ``index``
    names, the index checked once and expanded over the source as a view; the caller has
    probed the call."""
    if x.ndim:
        _check_in_range(func, index, dim, x.shape[dim])
    shape = [-1 if d == dim else 1 for d in range(source.ndim)]
    expanded = index.reshape(shape).expand(source.shape) if source.ndim else index
    return _scatter_by_owner(
        func, args, kwargs, x, dim, expanded, source, scatter, in_place=in_place, checked=True,
        rows=index if source.ndim else None,
    )  # fmt: skip


@register_function_handler(torch.index_copy, torch.Tensor.index_copy, torch.Tensor.index_copy_)
def _index_copy(func, args, kwargs):
    a = bind(func, args, kwargs)
    if _replicated_index(a.index) is None or a.get("out") is not None:
        return NotImplemented
    return _index_by_owner(
        func, args, kwargs, a,
        lambda into, dim, index, src: into.scatter_(dim, index, src),
        in_place=func is torch.Tensor.index_copy_,
    )  # fmt: skip


@register_function_handler(
    torch.index_reduce, torch.Tensor.index_reduce, torch.Tensor.index_reduce_
)
def _index_reduce(func, args, kwargs):
    a = bind(func, args, kwargs)
    if _replicated_index(a.index) is None or a.get("out") is not None:
        return NotImplemented
    return _index_by_owner(
        func, args, kwargs, a,
        lambda into, dim, index, src: into.scatter_reduce_(
            dim, index, src, a.reduce, include_self=a.include_self
        ),
        in_place=func is torch.Tensor.index_reduce_,
    )  # fmt: skip


@register_function_handler(torch.index_put, torch.Tensor.index_put, torch.Tensor.index_put_)
def _index_put(func, args, kwargs):
    """``x[i, j, ...] = values`` (``accumulate``: ``+=``) with replicated indices, into a
    destination sharded on any dims, written where each entry lands (NOTE [Scatters through a
    replicated index write where they land]): every rank keeps the entries whose cell lies in
    its shard, shifted to it, and sends the others to a spare slice appended to each sharded
    indexed dim and dropped afterwards; the values are narrowed to the rank's range along the
    sharded dims that are not indexed. Nothing moves.

    The indices are adjacent tensors after any leading ``None`` (``x[:, i, j]``), integer or
    boolean masks (their ``nonzero``, a host sync as in torch's own masked ``index_put``),
    broadcast together; torch wraps negative ones.
    """
    a = bind(func, args, kwargs, signature=_index_put_signature)
    x, values = a.input, a["values"]  # not ``a.values``: the dict's method
    if _split_elsewhere(x, a.indices, values):
        return _put_through_split_elsewhere(func, x, a.indices, values, a.accumulate)
    if _split_adjoint(x, a.indices, values):
        dim, index = _one_split_index(a.indices)
        return _put_through_split(func, x, dim, index, values, a.accumulate)
    if _sharded(values) and a.accumulate and isinstance(x, ShardTensor):
        # the gradient of ``x[..., i]`` or ``x[..., i[:, None], j[None, :]]`` added into
        # zeros: the adjoint of that read
        return _added_through_reads(func, x, a.indices, values)
    advanced = _advanced_indices(a.indices, x)
    if advanced is None or not isinstance(values, torch.Tensor) or not accepts(x):
        return NotImplemented
    if isinstance(values, ShardTensor) and (values._spec.shardings or values._spec.partial):
        return NotImplemented
    first, indices = advanced
    indices = [
        torch.where(index < 0, index + x.shape[first + k], index) for k, index in enumerate(indices)
    ]
    # torch's errors for the call with integer indices, on every rank
    probe_on_meta(aten.index_put.default, (x, [None] * first + indices, values, a.accumulate))
    for k, index in enumerate(indices):
        _check_in_range(torch.index_put, index, first + k, x.shape[first + k])
    spec = x._spec
    entries = torch.broadcast_shapes(*(index.shape for index in indices))
    last = first + len(indices)  # the indexed dims are [first, last)
    values = replicated_local(values, spec.mesh, sharding_axes(spec))
    values = values.expand((*x.shape[:first], *entries, *x.shape[last:]))
    starts, sizes = spec.local_offsets(), spec.local_shape()
    destination, padded = x.to_local(), []
    for sharding in spec.shardings:
        d = sharding.dim
        if first <= d < last:
            padded.append(d)
        else:
            position = d if d < first else d - len(indices) + len(entries)
            values = values.narrow(position, starts[d], sizes[d])
    # the output, written in place: one new shard with its spare slices, as torch's own
    # index_put holds one new tensor
    if padded:
        own = destination
        destination = own.new_zeros([n + (d in padded) for d, n in enumerate(own.shape)])
        narrowed(destination, [(d, 0, sizes[d]) for d in padded]).copy_(own)
    else:
        destination = destination.clone()
    # an entry outside this rank's range along any padded dim lands in that dim's spare slice
    local = [
        _shifted(index, starts[d], sizes[d]) if d in padded else index
        for d, index in enumerate(indices, start=first)
    ]
    out = aten.index_put_.default(destination, [None] * first + local, values, a.accumulate)
    out = narrowed(out, [(d, 0, sizes[d]) for d in padded])
    result = from_local_spec(out, spec.with_dtype(out.dtype))
    return x.copy_(result) if func is torch.Tensor.index_put_ else result


@register_function_handler(torch.Tensor.__setitem__)
def _setitem(func, args, kwargs):
    """``x[key] = value`` where ``key`` is index tensors (integer or boolean) after full
    slices and before full slices or an ellipsis (``x[i, j] = v``, ``x[:, mask] = 0``): the
    in-place ``index_put`` above, so that a value needing a gradient is written through the
    replicated index too (below autograd, its gradient would be an aten gather from the
    sharded gradient, which no handler takes). A basic key (ints, slices, an ellipsis, None;
    numpy ints, 0-d int tensors and scalar bools as torch reads them, NOTE [Scalar index items
    as torch reads them]) that touches a split dim is written through ``slice_scatter`` (NOTE
    [A write through a basic key touching a split dim]); any other basic key keeps torch's
    view and ``copy_``. A ShardTensor written into a plain tensor is written whole (NOTE [A
    ShardTensor written into a plain tensor])."""
    a = bind(func, args, kwargs)
    x, value = a.self, a.value
    if not isinstance(x, ShardTensor):
        if not isinstance(value, ShardTensor):
            return NotImplemented
        # NOTE [A ShardTensor written into a plain tensor] in _plain_destination_ops
        x[a.key] = whole_value(value)
        return None
    key = basic_form(a.key)  # NOTE [Scalar index items as torch reads them]
    found = _tensor_key(key, x.ndim)
    if found is None:
        return None if write_basic_key(x, key, value) else NotImplemented
    first, tensors = found
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value, dtype=x.dtype, device=x.device)
    handled = _index_put(torch.Tensor.index_put_, (x, [None] * first + tensors, value), {})
    return NotImplemented if handled is NotImplemented else None


def _index_put_signature(input, indices, values, accumulate=False):
    """``index_put``'s parameters (a builtin without an inspectable signature)."""


def _added_through_reads(func, x: ShardTensor, indices: object, values: ShardTensor) -> object:
    """``index_put(x, [None, ..., i, j, ...], values, accumulate=True)`` where ``values`` is
    laid out as ``x[..., i, j, ...]`` reads them: one index (its dims replace one dim), or
    1-D indices broadcast as an outer product (``x[i[:, None], j[None, :]]``, as
    interpolation indexes; ``_outer``), read one dim after the other (``x[i][:, j]``,
    ``_cells_read``). The adjoint of those reads in reverse order, each
    ``_added_through_replicated``: the values go back through ``j`` into zeros laid out as
    ``x[i]``, then through ``i`` into ``x``; nothing is gathered."""
    first = 0
    if isinstance(indices, list | tuple):
        while first < len(indices) and indices[first] is None:
            first += 1
    tensors = [_replicated_index(i) for i in indices[first:]] if first < len(indices) else []
    if not tensors or any(i is None for i in tensors):
        return NotImplemented
    reads = tensors if len(tensors) == 1 else _outer(tensors)
    if reads is None or first + len(reads) > x.ndim:
        return NotImplemented
    reads = [
        torch.where(index < 0, index + x.shape[d], index)  # torch wraps negatives
        for d, index in enumerate(reads, start=first)
    ]
    probe_on_meta(aten.index_put.default, (x, [None] * first + tensors, values, True))
    # the destinations of the reads: ``x``, then zeros laid out as each read's output
    into = [x]
    for d, index in enumerate(reads[:-1], start=first):
        _check_in_range(torch.index_put, index, d, into[-1].shape[d])
        spec = _reading(func, into[-1], d, index, cell_wise=False).spec
        zeros = values.to_local().new_zeros(spec.local_shape())
        into.append(from_local_spec(zeros, spec.with_dtype(values.dtype)))
    for d, index, destination in reversed(list(zip(range(first, x.ndim), reads, into))):
        values = _added_through_replicated(
            func, destination, d, index, values,
            lambda into, dim, index, src: aten.index_put_.default(
                into, [None] * dim + [index], src, True
            ),
            cell_wise=False, in_place=func is torch.Tensor.index_put_ and destination is x,
            probe=None,
        )  # fmt: skip
        if values is NotImplemented:
            return NotImplemented
    return values


def _put_through_split(
    func, x: ShardTensor, dim: int, index: ShardTensor, values: ShardTensor, accumulate: bool
) -> object:
    """``index_put(x, [None, ..., index], values, accumulate)`` through a ShardTensor ``index``
    split over the axes that split ``x`` along ``dim``, ``values`` split like the index on its
    dims and like ``x`` on the others (``_split_adjoint``); in place for ``Tensor.index_put_``
    (``copy_``, so that autograd's rules for in-place ops hold as on a plain tensor). With
    ``accumulate`` it is the backward of ``x[index]`` through such an index (``_select_rows``),
    torch's ``index_put`` into ``grad.new_zeros``, laid out like the gradient
    (``_factory_ops``). Each rank writes its values into its own rows and halo rows for the
    rows others own (``gather_plan`` of its part of the index, which checks the range on every
    rank alike), and the halo rows travel to their owners (one exchange): added into ``x``
    (``accumulate``), or replacing the rows written, with a count per halo row saying which
    rows were. Without ``accumulate``, entries naming the same row on different ranks add up
    (torch leaves the result of duplicate indices open: use unique ones). Differentiable
    through torch's own ops and the exchange's adjoint (``halo_reduce``); the result keeps
    ``x``'s layout."""
    if not accepts(x, values):
        return NotImplemented
    probe_on_meta(aten.index_put.default, (x, [None] * dim + [index], values, accumulate))
    sharding, group, _ = dim_layout(x._spec, dim)
    plan = gather_plan(
        index.to_local(), sharding.sizes, group, replicated=False, wrap_negative=True,
        what="index_put",
    )  # fmt: skip
    destination = x.to_local()
    shape = [plan.owned + plan.halo if d == dim else n for d, n in enumerate(destination.shape)]
    local = [None] * dim + [plan.local_index]
    total = aten.index_put_.default(
        destination.new_zeros(shape), local, values.to_local(), accumulate
    )
    written = halo_reduce(total, plan, dim)
    if accumulate:
        out = destination + written
    else:
        rows = plan.local_index.reshape(-1)
        counts = torch.zeros(plan.owned + plan.halo, dtype=torch.int32, device=rows.device)
        counts = halo_reduce(counts.index_add_(0, rows, torch.ones_like(counts[rows])), plan, 0)
        touched = counts.gt(0).reshape([-1 if d == dim else 1 for d in range(destination.ndim)])
        out = torch.where(touched, written, destination)
    result = from_local_spec(out, x._spec.with_dtype(out.dtype))
    return x.copy_(result) if func is torch.Tensor.index_put_ else result


def _split_adjoint(x: object, indices: object, values: object) -> bool:
    """Whether ``index_put(x, indices, values, accumulate)`` takes ``_put_through_split``:
    one ShardTensor index after leading ``None``, split over the axes that split ``x`` along the dim it names (and over none other), ``values`` split
    like it on its dims and like ``x`` on the others, none of them partial. (An ``x`` every
    rank holds whole, the zeros of a backward through an index of several dims, is not
    served: its sum of each group's part would be a pending sum held whole.)"""
    if not isinstance(x, ShardTensor) or not isinstance(values, ShardTensor) or x.ndim == 0:
        return False
    found = _one_split_index(indices)
    if found is None:
        return False
    dim, index = found
    spec, layout = x._spec, index._spec
    if index.dtype not in _INDEX_DTYPES or dim >= x.ndim or not layout.shardings:
        return False
    if any(t._spec.partial or t._spec.mesh != spec.mesh for t in (x, index, values)):
        return False
    if dim not in spec.sharding_by_dim:
        return False
    if set(spec.sharding_by_dim[dim].axes) != sharding_axes(layout):
        return False
    shift, others = index.ndim - 1, spec.sharding_by_dim.items()
    wanted = {d if d < dim else d + shift: (s.axes, s.sizes) for d, s in others if d != dim}
    wanted |= {dim + s.dim: (s.axes, s.sizes) for s in layout.shardings}
    return {s.dim: (s.axes, s.sizes) for s in values._spec.shardings} == wanted


def _one_split_index(indices: object) -> tuple[int, ShardTensor] | None:
    """``(dim, index)`` where ``indices`` (``index_put``'s) is leading ``None``s and one
    ShardTensor index along ``dim``; None otherwise."""
    if not isinstance(indices, list | tuple) or not indices:
        return None
    dim, index = len(indices) - 1, indices[-1]
    if any(i is not None for i in indices[:dim]) or not isinstance(index, ShardTensor):
        return None
    return dim, index


# NOTE [A write through an index split elsewhere reduces the rows it touched]
# ``index_put(x, [None, ..., index], values)`` where ``index`` is split over mesh axes that
# split no dim of ``x`` (``x`` split on any dims, or replicated), and ``values`` has the shape
# of the read ``x[..., index]``, moved to that read's layout (``_split_index``: the index's
# split on the index's dims, ``x``'s on the others, replicated over the read dim's axes; a
# local slice where the values are whole, as a plain tensor or a loss's replicated gradient
# is). It is the backward of that read at aten level (torch's
# ``index_put`` into ``grad.new_zeros(x.shape)``, which takes ``x``'s layout: NOTE [New tensors
# of a backward take the forward's layout] in ``_factory_ops``), and the user's
# ``x.index_put_((index,), values)`` with index and values split alike. ``x`` is whole over the
# index's axes, whose ranks hold different parts of the index: each rank writes its entries
# that land in its block of ``x`` (the others go to a spare row; another group of ranks holds
# those rows and the same entries); the ranks along the index's axes agree which rows of the
# block any of them touched (one all-reduce of a byte per row, ``max``), then reduce only those
# rows (one all-reduce of the touched rows): their sum (``accumulate``), or the value of the
# last rank along those axes that wrote the row (torch leaves the choice among duplicates
# open; an int32 per row says which rank). The result keeps ``x``'s layout; ``x`` is never
# held whole. The gradient is torch's (``_PutThroughSplitElsewhere``): ``x``'s is the output's,
# with the written rows zeroed unless ``accumulate``, made where it lies; the values' is the
# read ``grad[..., index]`` in the read's layout, one all-reduce of the values' part over the
# axes that split ``dim``. In place, the output is copied into ``x`` (``copy_``), so version
# counters and autograd's rules for in-place ops hold as on a plain tensor.
def _split_elsewhere(x: object, indices: object, values: object) -> bool:
    """Whether ``index_put(x, indices, values)`` takes ``_put_through_split_elsewhere`` (NOTE
    [A write through an index split elsewhere reduces the rows it touched])."""
    if not isinstance(x, ShardTensor) or not isinstance(values, torch.Tensor) or x.ndim == 0:
        return False
    found = _one_split_index(indices)
    if found is None:
        return False
    dim, index = found
    layout = index._spec
    if dim >= x.ndim or index.dtype not in _INDEX_DTYPES or x._spec.partial:
        return False
    if layout.mesh != x._spec.mesh or layout.partial or not layout.shardings:
        return False
    if sharding_axes(layout) & sharding_axes(x._spec):
        return False
    if isinstance(values, ShardTensor) and (
        values._spec.partial or values._spec.mesh != x._spec.mesh
    ):
        return False
    return values.shape == (*x.shape[:dim], *index.shape, *x.shape[dim + 1 :])


def _read_layout(x: ShardTensor, dim: int, index: ShardTensor, dtype) -> ShardTensorSpec:
    """The layout of ``x[..., index]`` along ``dim`` through an index split elsewhere
    (``_split_index``): the index's split on the index's dims, ``x``'s on its other dims,
    replicated over ``dim``'s axes."""
    spec, shift = x._spec, index.ndim - 1
    shardings = [
        DimSharding(s.dim if s.dim < dim else s.dim + shift, s.axes, s.sizes)
        for s in spec.shardings
        if s.dim != dim
    ]
    shardings += [DimSharding(dim + s.dim, s.axes, s.sizes) for s in index._spec.shardings]
    shape = (*x.shape[:dim], *index.shape, *x.shape[dim + 1 :])
    return ShardTensorSpec.from_shardings(spec.mesh, shardings, shape, dtype)


def _put_through_split_elsewhere(
    func, x: ShardTensor, indices: list, values: torch.Tensor, accumulate: bool
) -> ShardTensor:
    """``index_put`` through an index split over axes that split no dim of ``x`` (NOTE [A write
    through an index split elsewhere reduces the rows it touched]); in place for
    ``Tensor.index_put_`` (``copy_``, so that autograd's rules for in-place ops hold as on a
    plain tensor)."""
    dim, index = len(indices) - 1, indices[-1]
    probe_on_meta(aten.index_put.default, (x, indices, values, accumulate))
    spec, layout = x._spec, index._spec
    local = index.to_local()
    local = torch.where(local < 0, local + x.shape[dim], local)  # torch wraps negatives
    _agreed_rows(
        func, spec, dim, layout, _first_out_of_range(local, x.shape[dim]), None, rows=False
    )
    # the values in the read's layout: a local slice where they are whole over its axes
    target = _read_layout(x, dim, index, values.dtype)
    if isinstance(values, ShardTensor):
        parts = redistribute(values, target).to_local()
    else:  # its gradient there is a partial sum over the read's axes
        parts = target.narrow(replicated_local(values, spec.mesh, sharding_axes(target)))
    start, size = spec.local_offsets()[dim], spec.local_shape()[dim]
    where = _RowsWritten(
        dim=dim,
        index=_shifted(local, start, size),
        writers=axis_group(spec.mesh, tuple(sorted(sharding_axes(layout)))),
        holders=dim_layout(spec, dim)[1] if dim in spec.sharding_by_dim else None,
        accumulate=accumulate,
    )
    out = _PutThroughSplitElsewhere.apply(x.to_local(), parts, where)
    result = from_local_spec(out, spec.with_dtype(out.dtype))
    return x.copy_(result) if func is torch.Tensor.index_put_ else result


@dataclass(frozen=True)
class _RowsWritten:
    """How ``_PutThroughSplitElsewhere`` writes this rank's block.

    Attributes
    ----------
    dim : int
        The written dim.
    index : Tensor
        This rank's part of the index as positions in its block along ``dim``, where the spare
        row past the block (``_shifted``) stands for a row another rank holds.
    writers : AxisGroup
        The ranks along the index's axes: they hold the same block and different parts of
        the index.
    holders : AxisGroup or None
        The ranks along the axes that split ``dim`` of ``x`` (None: ``dim`` is whole), which
        hold the same part of the index and different rows.
    accumulate : bool
        ``index_put``'s ``accumulate``.
    """

    dim: int
    index: torch.Tensor
    writers: AxisGroup
    holders: AxisGroup | None
    accumulate: bool


class _PutThroughSplitElsewhere(torch.autograd.Function):
    """This rank's block of ``index_put(x, [None, ..., index], values, accumulate)`` from its
    block of ``x`` and its part of ``values`` in the read's layout (NOTE [A write through an
    index split elsewhere reduces the rows it touched]). The backward is local to each block
    but for one all-reduce: ``x``'s gradient is the output's (``accumulate``), with the rows
    any writer touched zeroed otherwise (torch's ``grad.index_put(indices, 0)``); the values'
    is the read ``grad[..., index]``, each entry taken where its row lies and summed over the
    ranks holding the other rows (the ``holders``), as every rank of them holds these values."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, block: torch.Tensor, values: torch.Tensor, where: _RowsWritten
    ) -> torch.Tensor:
        dim, shifted, group = where.dim, where.index, where.writers
        size = block.shape[dim]
        padded = [n + (d == dim) for d, n in enumerate(block.shape)]
        written = block.new_zeros(padded)
        aten.index_put_.default(written, [None] * dim + [shifted], values, where.accumulate)
        marks = torch.full((size + 1,), -1, dtype=torch.int32, device=block.device)
        marks[shifted.reshape(-1)] = group.index
        if where.accumulate:  # whether any rank touched the row is enough
            touched = marks[:size].ge(0).to(torch.uint8)
            rows = all_reduce(touched, group, "max").nonzero().squeeze(1) if size else marks[:0]
            mine = None
        else:
            last = all_reduce(marks[:size], group, "max") if size else marks[:0]
            rows = last.ge(0).nonzero().squeeze(1)
            mine = last[rows].eq(group.index)
        out = block.clone(memory_format=torch.contiguous_format)
        if rows.numel():
            part = written.index_select(dim, rows)
            if mine is not None:  # only the row's last writer contributes
                shape = [-1 if d == dim else 1 for d in range(part.ndim)]
                part = torch.where(mine.reshape(shape), part, part.new_zeros(()))
            reduced = all_reduce(part, group, "sum")
            if where.accumulate:
                out.index_add_(dim, rows, reduced)
            else:
                out.index_copy_(dim, rows, reduced)
        ctx.where, ctx.rows = where, rows
        return out

    @staticmethod
    @first_order_only("index_put through an index split elsewhere")
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        where, dim = ctx.where, ctx.where.dim
        grad_block = grad if where.accumulate else grad.index_fill(dim, ctx.rows, 0)
        spare = [1 if d == dim else n for d, n in enumerate(grad.shape)]
        rows = torch.cat([grad, grad.new_zeros(spare)], dim)  # the spare row reads zeros
        grad_values = rows[(slice(None),) * dim + (where.index,)]
        if where.holders is not None:
            grad_values = all_reduce(grad_values.contiguous(), where.holders, "sum")
        return grad_block, grad_values, None


@register_aten_handler(aten._unsafe_masked_index_put_accumulate.default)
def _masked_index_put_accumulate(func, args, kwargs):
    """``x.index_put(indices, values.masked_fill(~mask, 0), accumulate=True)`` with every
    index clamped into its dim, as torch's decomposition computes it (a masked-out entry may
    name any cell): the ``index_put`` above, each entry added where it lands, nothing moved.
    It is the backward of interpolation, of ``embedding`` by frequency and of
    ``_unsafe_masked_index`` (``_masked_index``): a value sharded like that read is added
    through its adjoint (``_added_through_replicated``). A sharded mask, a value in another
    layout, or an empty ``x`` takes the gathered fallback (``_gathered_ops``)."""
    a = bind(func, args, kwargs)
    x, mask, values = a.self, a.mask, a["values"]  # not ``a.values``: the dict's method
    if (
        _advanced_indices(a.indices, x) is None
        or x.numel() == 0
        or _sharded(mask)
        or any(isinstance(t, ShardTensor) and t._spec.partial for t in (mask, values))
    ):
        return gathered(func, args, kwargs)
    indices = [
        None if index is None else index.clamp(-x.shape[d], x.shape[d] - 1)
        for d, index in enumerate(a.indices)
    ]
    indices = _in_owner_order(indices, mask, x)
    masked = values.masked_fill(~mask, 0)
    out = _index_put(torch.index_put, (x, indices, masked, True), {})
    return gathered(func, args, kwargs) if out is NotImplemented else out


@register_aten_handler(aten._unsafe_masked_index.default)
def _masked_index(func, args, kwargs):
    """``torch.where(mask, x[indices], fill)`` with every index clamped into its dim, as
    torch's decomposition computes it (interpolation's and ``embedding``'s forward): the read
    through ``_index`` (one index as ``x[idx]``; several where the cells are), then masked.
    A sharded mask, or indices ``_index`` declines, take the gathered fallback."""
    a = bind(func, args, kwargs)
    x, mask = a.self, a.mask
    if not isinstance(x, ShardTensor) or x.ndim == 0 or _sharded(mask):
        return gathered(func, args, kwargs)
    indices = [
        None if index is None else index.clamp(-x.shape[d], x.shape[d] - 1)
        for d, index in enumerate(a.indices)
    ]
    read = _index(aten.index.Tensor, (x, _in_owner_order(indices, mask, x)), {})
    if read is NotImplemented:
        return gathered(func, args, kwargs)
    return aten.where.ScalarOther(mask, read, a.fill)


# NOTE [An entry every mask hides reads the row before it]
# ``_unsafe_masked_index(x, mask, indices, fill)`` (interpolation, ``embedding``) reads
# ``x[indices]`` and puts ``fill`` where the mask is False. A position along an index whose
# every output cell the mask hides depends on no row of ``x`` (NOTE [An output cell belongs to
# the shard it depends on] in ``tests/expected_layouts.py``: its owner is "any"), yet its
# clamped value names some row, which may break the owners' increasing order and turn a read
# that moves nothing into one that fetches rows (NOTE [A selection through a replicated index
# is split by its entries' owners]), and move the output's cells off their rows. So each such
# position reads the row of the last position before it that the mask shows (the first one
# shown, before any): the output is the same, and the read follows the owners of the cells
# that depend on anything. The backward (``_unsafe_masked_index_put_accumulate``, its values
# zero there) takes the same indices, so its source has the read's layout.
def _in_owner_order(indices: list, mask: torch.Tensor, x: ShardTensor) -> list:
    """``indices`` (clamped, plain integer tensors after leading ``None``) with each position
    every mask hides reading the row the last shown position before it reads (NOTE above).
    Only indices with one dim of more than one entry are changed; others are returned as
    given. ``mask`` is held whole by every rank: a plain tensor or a ShardTensor split along
    no dim (its callers send a split one to the gathered fallback first, which the guard
    refuses under "error" before any collective)."""
    tensors = [i for i in indices if i is not None]
    if not tensors or any(
        isinstance(i, ShardTensor) or i.dtype not in _INDEX_DTYPES for i in tensors
    ):
        return indices
    first = next(k for k, i in enumerate(indices) if i is not None)
    if any(i is None for i in indices[first:]):
        return indices
    entries = torch.broadcast_shapes(*(i.shape for i in tensors))
    shape = (*x.shape[:first], *entries, *x.shape[first + len(tensors) :])
    shown = (mask.to_local() if isinstance(mask, ShardTensor) else mask).expand(shape)
    out = list(indices)
    for k, index in enumerate(tensors):
        sized = [d for d, n in enumerate(index.shape) if n != 1]
        if len(sized) != 1:
            continue
        along = first + len(entries) - index.ndim + sized[0]
        care = shown.movedim(along, 0).reshape(shape[along], -1).any(1)
        if bool(care.all()) or not bool(care.any()):
            continue
        positions = torch.arange(care.numel(), device=care.device)
        last = torch.cummax(torch.where(care, positions, -1), 0).values
        last = torch.where(last >= 0, last, care.nonzero()[0, 0])
        out[first + k] = index.reshape(-1)[last].reshape(index.shape)
    return out


def _advanced_indices(indices: object, x: object) -> tuple[int, list[torch.Tensor]] | None:
    """``(first, integer indices)`` of ``index_put``'s ``indices`` when they are replicated
    index tensors or boolean masks of adjacent dims from ``first`` on, after ``first``
    ``None`` (a boolean mask of ``r`` dims becomes its ``r`` integer indices); else None."""
    if not isinstance(x, ShardTensor) or x.ndim == 0 or not isinstance(indices, (list, tuple)):
        return None
    first = 0
    while first < len(indices) and indices[first] is None:
        first += 1
    converted: list[torch.Tensor] = []
    for index in indices[first:]:
        if isinstance(index, ShardTensor):
            if index._spec.shardings or index._spec.partial:
                return None
            index = index._local
        if not isinstance(index, torch.Tensor):
            return None  # a None between index tensors: torch moves the result's dims first
        if index.dtype == torch.bool:
            dims = range(first + len(converted), first + len(converted) + index.ndim)
            if dims.stop > x.ndim or tuple(index.shape) != tuple(x.shape[d] for d in dims):
                return None
            converted.extend(index.nonzero().unbind(1))
        elif index.dtype in _INDEX_DTYPES:
            converted.append(index)
        else:
            return None
    if not converted or first + len(converted) > x.ndim:
        return None
    return first, converted


@register_function_handler(torch.index_fill, torch.Tensor.index_fill, torch.Tensor.index_fill_)
def _index_fill(func, args, kwargs):
    """``index_fill`` along any dim of a destination sharded on any dims, with a replicated
    index: each rank marks which of its own rows along ``dim`` the index names (a vector of
    its rows, one spare entry for the others) and fills them; nothing moves. Each row is
    filled once however often the index names it, so the value's gradient counts it once,
    as torch's does; that gradient is a partial sum over the sharding axes."""
    a = bind(func, args, kwargs, signature=_index_fill_signature)
    x, index = a.input, _replicated_index(a.index)
    if not isinstance(x, ShardTensor) or x.ndim == 0 or index is None or not accepts(x):
        return NotImplemented
    if isinstance(a.value, ShardTensor) and (a.value._spec.shardings or a.value._spec.partial):
        return NotImplemented
    probe_on_meta(func, args, kwargs)  # torch's errors, on every rank
    spec, dim = x._spec, a.dim % x.ndim
    index = index.reshape(-1)
    index = torch.where(index < 0, index + x.shape[dim], index)  # torch wraps negatives
    _check_in_range(func, index, dim, x.shape[dim])
    start, size = spec.local_offsets()[dim], spec.local_shape()[dim]
    mine = (index >= start) & (index < start + size)
    marked = torch.zeros(size + 1, dtype=torch.bool, device=index.device)
    marked[torch.where(mine, index - start, size)] = True
    filled = marked[:size].reshape([-1 if d == dim else 1 for d in range(x.ndim)])
    value = a.value
    if isinstance(value, torch.Tensor):
        value = replicated_local(value, spec.mesh, sharding_axes(spec)).to(x.dtype)
    out = torch.where(filled.to(x.device), value, x.to_local())
    result = from_local_spec(out, spec.with_dtype(out.dtype))
    return x.copy_(result) if func is torch.Tensor.index_fill_ else result


def _index_fill_signature(input, dim, index, value):
    """``index_fill``'s parameters (a builtin with several aten schemas)."""


# ---------------------------------------------------------------------------- flat positions
@register_function_handler(torch.put, torch.Tensor.put, torch.Tensor.put_)
def _put(func, args, kwargs):
    """``x.put(index, source)``: ``index_put`` (above) at the cells whose flat (row-major)
    positions the replicated ``index`` names, unravelled into one index per dim, so that
    each value is written where it lands on any layout and nothing moves."""
    a = bind(func, args, kwargs, signature=_put_signature)
    x, index, source = a.input, _replicated_index(a.index), a.source
    if (
        not isinstance(x, ShardTensor)
        or x.ndim == 0
        or index is None
        or not isinstance(source, torch.Tensor)
        or _sharded(source)
        or not accepts(x)
    ):
        return NotImplemented
    probe_on_meta(func, args, kwargs)  # torch's errors for shapes and dtypes, on every rank
    flat = _flat_positions(func, x, index).reshape(-1)
    cells = list(torch.unravel_index(flat, x.shape))
    out = _index_put(torch.index_put, (x, cells, source.reshape(-1), a.accumulate), {})
    return x.copy_(out) if func is torch.Tensor.put_ else out


def _put_signature(input, index, source, accumulate=False):
    """``put``'s parameters (a builtin without an inspectable signature)."""


@register_function_handler(torch.take, torch.Tensor.take)
def _take(func, args, kwargs):
    """``x.take(index)``, ``x.reshape(-1)[index]``, through the replicated ``index`` (NOTE [A
    gather through a replicated index keeps the input's layout]): when only the leading dim is
    split, each shard is a run of the flat order, and the flattened view keeps it; else the
    cells are read by their coordinates, ``x[i, j, ...]``, each entry held by its cell's
    owner where the owners never decrease along the index."""
    a = bind(func, args, kwargs)
    x, index = a.input, _replicated_index(a.index)
    if not isinstance(x, ShardTensor) or x.ndim == 0 or index is None or not accepts(x):
        return NotImplemented
    if a.get("out") is not None:
        return NotImplemented
    probe_on_meta(func, args, kwargs)  # torch's errors for shapes and dtypes, on every rank
    flat = _flat_positions(func, x, index)
    if set(x._spec.sharding_by_dim) - {0}:  # the cells' coordinates, read as x[i, j, ...]
        return x[torch.unravel_index(flat, x.shape)]
    return _through_replicated(func, x.reshape(-1), 0, flat, cell_wise=False)


def _flat_positions(func, x: ShardTensor, index: torch.Tensor) -> torch.Tensor:
    """``index``'s flat positions into ``x``, negatives wrapped as torch does, checked in
    range on every rank alike."""
    flat = torch.where(index < 0, index + x.numel(), index)
    _check_in_range(func, flat, 0, x.numel())
    return flat


# ---------------------------------------------------------------------------- below autograd
# The gathers and the scatters through a replicated index, reached at the aten level only (a
# backward formula, a decomposition, a traced graph): the same handlers on the same arguments.
# A source may need a gradient: torch's backward formula computes it from the gradient,
# sharded like the destination, with ops that keep the layout. For a scatter's source (or
# ``index_fill``'s value) that is an aten ``gather`` or ``index_select`` through the same
# index (and a sum); for ``scatter_reduce`` and ``index_reduce`` also the result gathered
# there and elementwise masks (ties of amax/amin, zeros of prod, the counts of mean, scattered
# with ``scatter_add``); for ``index_put``'s values an aten ``index`` through the same
# indices or mask (``_index``). A sharded index declines (``scatter_reduce``: the gathered
# fallback of ``_gathered_ops``).
_AT_TORCH_LEVEL = {
    aten.gather.default: torch.gather,
    aten.index_select.default: torch.index_select,
    aten.scatter_add.default: torch.scatter_add,
    aten.scatter.src: torch.scatter,
    aten.scatter.value: torch.scatter,
    aten.scatter_reduce.two: torch.scatter_reduce,
    aten.index_add.default: torch.index_add,
    aten.index_copy.default: torch.index_copy,
    aten.index_reduce.default: torch.index_reduce,
    aten.index_fill.int_Scalar: torch.index_fill,
    aten.index_fill.int_Tensor: torch.index_fill,
    aten.index_put.default: torch.index_put,
}


@register_aten_handler(*_AT_TORCH_LEVEL)
def _below_autograd(func, args, kwargs):
    a = bind(func, args, kwargs)
    torch_func = _AT_TORCH_LEVEL[func]
    if func in (aten.gather.default, aten.index_select.default):
        out = function_handler_for(torch_func)(torch_func, args, kwargs)
        if out is NotImplemented and _masked_by_dtensor(a.self, a.dim, a.index):
            return gathered(func, args, kwargs)
        return out
    if func is aten.index_put.default:
        replicated = (
            _advanced_indices(a.indices, a.self) is not None
            or (a.accumulate and _split_adjoint(a.self, a.indices, a["values"]))
            or _split_elsewhere(a.self, a.indices, a["values"])
        )
    else:
        replicated = _replicated_index(a.index) is not None
    if not replicated and func in _ON_THE_HOLDER:
        return _scattered_on_the_holder(func, args, kwargs)
    if not replicated:
        return gathered(func, args, kwargs) if func is aten.scatter_reduce.two else NotImplemented
    return function_handler_for(torch_func)(torch_func, args, kwargs)


# NOTE [A scatter through an index its holder holds writes on that holder]
# ``max``/``min`` with a dim over a dim one rank holds whole keep their values and indices on
# that rank (NOTE [A sum over a dim one rank holds stays with that rank] in ``_common``), so
# their backward (torch's formula: zeros of the input's shape, laid out like the input since
# the gradient remembers its sizes, NOTE [Shard-size hints]; then ``scatter(dim, indices,
# grad)``) meets a destination whose scatter dim one rank holds whole, and an index and source
# held along the same axes by the same rank, their positions global along that dim. Every
# position lands in the holder's range, which starts at 0: each rank scatters its own shards
# (the holder all of the dim's rows, the others none), without moving a byte, and the output
# keeps the destination's layout. Taken by the scatters without a reduction across entries
# (``scatter`` of a source or a value, ``scatter_add``) where destination and index have the
# same held axes (NOTE [A dim one rank holds is whole on that rank]), the scatter dim's among
# them, and with those taken off no axis splits the scatter dim in either, the index is split
# on its other dims as the destination (cut at the index's extent) and the source as the
# index; anything else declines as before (DTensor's rule gathers the destination over the
# held axes).
# The same scatters meet a destination split along the scatter dim with an index (and source)
# whole along it and split as the destination on the other dims: ``max`` over a split dim
# all-reduces its values and indices over that dim's axes, and its gradient's zeros take the
# input's layout (NOTE [New tensors of a backward take the forward's layout]). Each rank then
# writes the entries landing in its range, shifted to its shard, the others sent to a spare
# slice dropped afterwards (as NOTE [Scatters through a replicated index write where they
# land]), without moving a byte; the index's range is agreed over the mesh first.
_ON_THE_HOLDER = frozenset({aten.scatter.src, aten.scatter.value, aten.scatter_add.default})


def _scattered_on_the_holder(func, args, kwargs):
    a = bind(func, args, kwargs)
    x, index = a.self, a.index
    src = a.value if func is aten.scatter.value else a.src
    if not isinstance(x, ShardTensor) or not isinstance(index, ShardTensor) or x.ndim == 0:
        return NotImplemented
    if not accepts(x, index, *([src] if isinstance(src, torch.Tensor) else [])):
        return NotImplemented
    dim = a.dim % x.ndim
    if isinstance(src, torch.Tensor) and not (
        isinstance(src, ShardTensor) and src._spec.shape == index._spec.shape
        and src._spec.shardings == index._spec.shardings
    ):  # fmt: skip
        return NotImplemented
    local_src = src._local if isinstance(src, ShardTensor) else src
    if _held_alike(x._spec, index._spec, dim):
        out = func(x._local, dim, index._local, local_src)
        return from_local_spec(out, x._spec.with_dtype(out.dtype))
    if not _whole_along(x._spec, index._spec, dim):
        return NotImplemented
    # every rank of the mesh raises torch's IndexError alike (one all-reduce of one number)
    _agreed_rows(func, x._spec, dim, index._spec, _first_out_of_range(index._local, x.shape[dim]),
                 None, rows=False)  # fmt: skip
    start, size = x._spec.local_offsets()[dim], x._spec.local_shape()[dim]
    spare = x._local.new_zeros([1 if d == dim else n for d, n in enumerate(x._local.shape)])
    into = torch.cat([x._local, spare], dim)
    out = func(into, dim, _shifted(index._local, start, size), local_src).narrow(dim, 0, size)
    return from_local_spec(out, x._spec.with_dtype(out.dtype))


@cached("scatters into blocks", 256)
def _whole_along(destination: ShardTensorSpec, index: ShardTensorSpec, dim: int) -> bool:
    """Whether ``index`` is whole along ``dim``, which ``destination`` splits, and laid out
    as ``destination`` on its other dims, cut at the index's extent (NOTE [A scatter through
    an index its holder holds writes on that holder], its second route)."""
    if destination.partial or index.partial or destination.mesh != index.mesh:
        return False
    return dim in destination.sharding_by_dim and _split_as_elsewhere(index, destination, dim)


@cached("scatters on the holder", 256)
def _held_alike(destination: ShardTensorSpec, index: ShardTensorSpec, dim: int) -> bool:
    """Whether the scatter of ``index`` into ``destination`` along ``dim`` writes on each
    rank's own shards (NOTE [A scatter through an index its holder holds writes on that
    holder])."""
    if destination.partial or index.partial or destination.mesh != index.mesh:
        return False
    whole, held = without_held(destination)
    index_whole, index_held = without_held(index)
    if not any(h.dim == dim for h in held) or set(held) != set(index_held):
        return False
    if dim in whole.sharding_by_dim or dim in index_whole.sharding_by_dim:
        return False
    wanted = {
        s.dim: (s.axes, sizes_at_extent(s.sizes, index.shape[s.dim])) for s in whole.shardings
    }
    return {s.dim: (s.axes, s.sizes) for s in index_whole.shardings} == wanted
