"""``slice_scatter`` and ``select_scatter``: a write into a slice of a sharded tensor, kept in
the tensor's layout.

Functionalization turns an in-place write into a slice, ``u[..., 0] = g`` (a Dirichlet
boundary), into these ops: a functionalized or exported graph run on ShardTensors calls them
(under ``torch.compile``, traced through ShardTensors, the shards are functionalized instead,
below this dispatch, and these handlers are not reached). DTensor's rule replicates the sliced dim, so
such a graph would gather the field. Here the output has the input's layout and each rank
writes the part of the source that lands in its own shard (NOTE [A slice write lands where
its cells are]). An eager ``x[key] = value`` whose basic key touches a split dim is written
through them too (``write_basic_key``), since the select it would otherwise write into is a
copy (NOTE [A write through a basic key touching a split dim]).
"""

from __future__ import annotations

import numpy as np
import torch

from shardsci.tensor._api import ShardTensor
from shardsci.tensor._binding import bind
from shardsci.tensor._ops._common import accepts, dim_layout
from shardsci.tensor._ops._index_ops import _selected_count, _slice_bounds
from shardsci.tensor._redistribute import redistribute_local
from shardsci.tensor._registry import register_aten_handler
from shardsci.tensor._shape_probe import probe_on_meta
from shardsci.tensor._spec import ShardTensorSpec

aten = torch.ops.aten


# NOTE [A slice write lands where its cells are]
# ``slice_scatter(x, src, dim, start, end, step)`` is ``x`` with the cells ``start:end:step``
# of ``dim`` replaced by ``src``. Every output cell depends on one input cell (of ``x`` or of
# ``src``) at its own position, so the output keeps ``x``'s layout. Along ``dim``, the rank
# holding ``x``'s cells ``[o, o + n)`` writes the selected ones among them, which are the
# source's rows ``[k, k + c)`` (``k`` selected before ``o``): the source is needed in ``x``'s
# layout with ``dim`` cut into those counts (the layout ``x[start:end:step]`` has, so a
# source computed from that slice is already there), and on every other dim as ``x``. A
# replicated or plain source is cut locally; a source sharded alike is used as it is; any
# other is redistributed to that layout, explicitly (a box exchange of the source only,
# seen by the gather guard), never the field. The backward is autograd's: the gradient
# sliced for the source, and written with zeros for ``x``, both kept in their layouts.
@register_aten_handler(aten.slice_scatter.default)
def _slice_scatter(func, args, kwargs):
    a = bind(func, args, kwargs)
    x, src = a.self, a.src
    if not isinstance(x, ShardTensor) or x.ndim == 0 or not accepts(x, src):
        return NotImplemented
    probe_on_meta(func, args, kwargs)  # torch's errors for shapes and dtypes, on every rank
    dim = a.dim % x.ndim
    start, end = _slice_bounds(x.shape[dim], a.start, a.end)
    return _written(x, src, dim, start, end, a.step)


@register_aten_handler(aten.select_scatter.default)
def _select_scatter(func, args, kwargs):
    """A select's write is a slice's of one row: ``src`` with ``dim`` put back."""
    a = bind(func, args, kwargs)
    x, src = a.self, a.src
    if not isinstance(x, ShardTensor) or x.ndim == 0 or not accepts(x, src):
        return NotImplemented
    probe_on_meta(func, args, kwargs)
    dim = a.dim % x.ndim
    index = a.index % x.shape[dim]
    return _written(x, aten.unsqueeze.default(src, dim), dim, index, index + 1, 1)


def _written(x: ShardTensor, src: torch.Tensor, dim: int, start: int, end: int, step: int):
    """``x`` with cells ``start:end:step`` of ``dim`` replaced by ``src``, in ``x``'s layout
    (NOTE above)."""
    spec = x._spec
    if dim in spec.sharding_by_dim:
        sharding, group, starts = dim_layout(spec, dim)
        counts = tuple(
            _selected_count(o, min(o + n, end), start, step) for o, n in zip(starts, sharding.sizes)
        )
        mine = group.index
        lo = max(starts[mine], start)
        first = start + -(-(lo - start) // step) * step - starts[mine]
    else:
        counts, mine, first = (len(range(start, end, step)),), 0, start
    source = _source_local(src, _source_spec(spec, dim, counts))
    out = x._local.clone()
    if counts[mine]:
        rows = slice(first, first + (counts[mine] - 1) * step + 1, step)
        out[(slice(None),) * dim + (rows,)] = source
    return ShardTensor(out, spec)


def _source_spec(spec: ShardTensorSpec, dim: int, counts: tuple[int, ...]) -> ShardTensorSpec:
    """``spec`` with ``dim`` holding ``counts`` cells per rank (whole when unsharded)."""
    shape = list(spec.shape)
    shape[dim] = sum(counts)
    sizes = {s.dim: s.sizes for s in spec.shardings}
    if dim in sizes:
        sizes[dim] = counts
    return ShardTensorSpec.build(
        spec.mesh,
        spec.placements,
        shape,
        spec.dtype,
        sizes,
        order={s.dim: s.axes for s in spec.shardings},
    )


def _source_local(src: torch.Tensor, target: ShardTensorSpec) -> torch.Tensor:
    """This rank's part of ``src`` in the ``target`` layout: cut locally from a plain or
    replicated source, redistributed from a sharded one (nothing moves when alike)."""
    if isinstance(src, ShardTensor):
        if src._spec.shardings:
            return redistribute_local(src._local, src._spec, target.with_dtype(src.dtype))
        src = src._local
    return target.narrow(src)


# NOTE [A write through a basic key touching a split dim]
# ``x[key] = value`` with a basic key (ints, slices, an ellipsis, None) is, in torch, a view
# and a ``copy_`` into it. A select along a split dim is a copy (its owner broadcasts the
# row), so that ``copy_`` would write into the copy and the write would be lost. When the key
# touches a split dim, the write is made functional instead: the value is broadcast to the
# key's view as torch does, and the nested views are written back innermost-first with
# ``slice_scatter`` and ``select_scatter`` (NOTE [A slice write lands where its cells are]),
# then copied into ``x`` in its own layout; autograd sees those ops and ``copy_``, as
# functionalization would write it. The views are the key's slices (kept by their holders),
# selects on whole dims (local views) and, innermost, one select on a split dim; its
# gradient for the value is the owner's row broadcast. Any other int on a split dim is a
# one-cell slice and the value gains that dim, so nothing moves in forward; the value's
# gradient then squeezes a one-cell split dim, which its holder broadcasts (``u[2, 4] = g``
# on 2x2: the value's bytes, no gather). A key touching no split dim keeps torch's path.
def write_basic_key(x: ShardTensor, key: object, value: object) -> bool:
    """Write ``x[key] = value`` for a basic ``key`` that touches a split dim of ``x``, in
    place; False (nothing done) for any other key (NOTE above)."""
    items = key if isinstance(key, tuple) else (key,)
    if not accepts(x) or not all(_is_basic(k) for k in items):
        return False
    target = torch.empty(x.shape, device="meta")[key]  # torch's errors for the key, every rank
    consumed = sum(k is not None and k is not Ellipsis for k in items)
    slices, ints, nones, dim, out_dim = {}, [], [], 0, 0
    for k in items:
        if k is Ellipsis:
            dim += x.ndim - consumed
            out_dim += x.ndim - consumed
        elif k is None:
            nones.append(out_dim)
            out_dim += 1
        elif isinstance(k, slice):
            if k != slice(None):
                slices[dim] = k.indices(x.shape[dim])
            dim, out_dim = dim + 1, out_dim + 1
        else:
            index = k % x.shape[dim]
            slices[dim] = (index, index + 1, 1)
            ints.append(dim)
            dim += 1
    if not any(d in x._spec.sharding_by_dim for d in slices):
        return False
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value, dtype=x.dtype, device=x.device)
    written = value.to(x.dtype).expand(target.shape)
    if nones:
        written = written.squeeze(tuple(nones))
    # ints on whole dims, and the last on a split dim, are selects; other ints are slices
    split = x._spec.sharding_by_dim
    selects = [d for d in ints if d not in split] + [d for d in ints if d in split][-1:]
    levels = [d for d in sorted(slices) if d not in selects] + selects
    for d in sorted(set(ints) - set(selects)):
        written = written.unsqueeze(d - sum(s < d for s in selects))
    # each level's dim in the tensor it writes into (the selects above it dropped a dim)
    at = [d - sum(s < d for s in levels[:k] if s in selects) for k, d in enumerate(levels)]
    views = [x]
    for d, position in zip(levels[:-1], at):
        if d in selects:
            views.append(aten.select.int(views[-1], position, slices[d][0]))
        else:
            views.append(aten.slice.Tensor(views[-1], position, *slices[d]))
    for d, position, outer in zip(reversed(levels), reversed(at), reversed(views)):
        if d in selects:
            written = aten.select_scatter.default(outer, written, position, slices[d][0])
        else:
            written = aten.slice_scatter.default(outer, written, position, *slices[d])
    x.copy_(written)
    return True


# NOTE [Scalar index items as torch reads them]
# Torch reads a numpy integer and a 0-d integer tensor (other than uint8) in a key as an int
# (a select, a view), and a scalar bool (Python's, a 0-d bool or uint8 tensor) as a
# new dim of one cell indexed by a mask: where the key holds no other index tensor, ``True``
# adds that dim as ``None`` does, and ``False`` selects none of it (a write of nothing).
# Written in those terms, a key such as ``u[np.int64(0), 1:3]`` or ``u[..., True]`` takes
# the write through ``slice_scatter`` above instead of torch's view of a select's copy, where
# the write was lost.
def basic_form(key: object) -> object:
    """``key`` with its scalar items in the form torch reads them (NOTE above): numpy integers
    and 0-d integer tensors as ints, scalar bools as None (``True``) or ``False``, when no
    other index tensor is left; else the ints only."""
    items = key if isinstance(key, tuple) else (key,)
    items = tuple(_as_int(k) for k in items)
    if any(_is_index_tensor(k) and not _is_scalar_bool(k) for k in items):
        return items
    return tuple(None if _is_scalar_bool(k) and bool(k) else k for k in items)


def _as_int(item: object) -> object:
    if isinstance(item, np.integer):
        return int(item)
    if isinstance(item, torch.Tensor) and item.ndim == 0 and _selects(item.dtype):
        return int(item.item())
    return item


def _selects(dtype: torch.dtype) -> bool:
    """Whether a 0-d tensor of ``dtype`` indexes as an int (a select) in torch."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype in (torch.bool, torch.uint8))


def _is_scalar_bool(item: object) -> bool:
    if isinstance(item, torch.Tensor):
        return item.ndim == 0 and item.dtype in (torch.bool, torch.uint8)
    return isinstance(item, bool)  # a numpy bool is torch's error


def _is_index_tensor(item: object) -> bool:
    return isinstance(item, (torch.Tensor, list, np.ndarray))


def _is_basic(item: object) -> bool:
    return type(item) is int or isinstance(item, slice) or item is None or item is Ellipsis
