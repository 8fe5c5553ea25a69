"""Reductions whose DTensor rules are wrong or wasteful on uneven or empty shards.

- ``mean``: DTensor averages local means (``Partial("avg")``), wrong for unequal shards; here
  it is a sum over the true count.
- ``var``/``std`` over a sharded dim: DTensor gathers the whole tensor; here two passes (mean,
  then squared deviations) reduce only per-output-element sums, and autograd composes from
  those ShardTensor ops.
- ``amax``/``amin``/``max``/``min``/``norm(inf)``: a local reduction over an empty shard raises
  in torch; here empty shards contribute the reduction's identity.
- ``argmax``/``argmin`` over a sharded dim: DTensor gathers the whole tensor; here ranks
  exchange only their best (value, global index) pairs.
- ``max``/``min`` along a sharded dim (values and indices; ``torch.max`` and ``aten.max.dim``
  called directly, bools too): DTensor gathers the whole tensor; here the indices are
  ``argmax``'s and each value is picked by the rank holding its cell (a pending sum of one
  term, all-reduced), so its gradient goes to that cell alone, as torch's.
- ``sum``, ``amax``, ``amin``, ``prod``, vector norms, ``argmax``/``argmin``, ``max``/``min``
  and ``median``/``nanmedian`` with a dim, over a dim one rank holds whole: the result stays with that rank (NOTE [A sum over a dim one rank holds
  stays with that rank] in ``_common``), neither pending nor replicated.
- ``logsumexp`` over a sharded dim: the max is all-reduced (one value per output element)
  before it shifts the shards, so the result keeps the input's other shardings.
- ``histc``, ``histogram``: DTensor has no rule; here each rank counts its own elements
  (NOTE [A histogram is a pending sum of each rank's counts]).

NOTE [A histogram is a pending sum of each rank's counts]
Each rank counts its own elements against the same edges (over the global range, found by
all-reduces of min and max when the call leaves it to the data): the counts are a pending sum
(Partial) over the axes that shard the input. They cannot be sharded instead: which rank's
elements fall in a bin is the data's values, which no layout may depend on. A density, the
counts over their total times each bin's width, is a pending sum too: each rank's counts over
the global total (one all-reduce of a single number) times the widths. Its terms add up to
torch's density; nothing is replicated but that total and the edges, which every rank
computes alike.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from shardsci.tensor._api import ShardTensor, from_local_spec, redistribute
from shardsci.tensor._binding import bind
from shardsci.tensor._collectives import axis_group, exchange
from shardsci.tensor._dispatch import local_of, run_with_propagation
from shardsci.tensor._held import held_axes
from shardsci.tensor._ops._common import (
    accepts,
    connected_empty,
    held_by_one,
    held_local,
    normalized_dims,
    reduced_now,
    sharding_axes,
)
from shardsci.tensor._registry import register_aten_handler, register_function_handler
from shardsci.tensor._spec import ShardTensorSpec, merged_hints

aten = torch.ops.aten


# ---------------------------------------------------------------------------- mean
@register_aten_handler(aten.mean.default, aten.mean.dim)
def _mean(func, args, kwargs):
    a = bind(func, args, kwargs)
    x = a.self
    dims = normalized_dims(a.get("dim"), x.ndim)  # mean.default has no dim: every dim
    uneven = [s.dim for s in x._spec.shardings if s.dim in dims and not s.is_even()]
    if not accepts(x, sharded=uneven, partial=True):
        return NotImplemented
    total = aten.sum.dim_IntList(x, list(dims), bool(a.get("keepdim", False)), dtype=a.dtype)
    return aten.div.Scalar(total, math.prod(x.shape[d] for d in dims))


# ---------------------------------------------------------------------------- sum
@register_aten_handler(aten.sum.dim_IntList, aten.nansum.default)
def _sum(func, args, kwargs):
    """A sum over a dim one rank holds stays with that rank (NOTE [A sum over a dim one rank
    holds stays with that rank] in ``_common``); other sums take the default path."""
    a = bind(func, args, kwargs)
    x = a.self
    dims = normalized_dims(a.dim, x.ndim)
    if not accepts(x, sharded=dims, partial=True):
        return NotImplemented
    return kept_by_holder(run_with_propagation(func, args, kwargs), x, dims, bool(a.keepdim))


def kept_by_holder(
    out: ShardTensor, x: ShardTensor, dims: tuple[int, ...], keepdim: bool
) -> ShardTensor:
    """``out``, a reduction of ``x`` over ``dims`` pending over their axes, kept by the rank
    that holds a reduced dim whole (``held_by_one``): on the reduced dim where it is kept."""
    if not isinstance(out, ShardTensor) or not isinstance(x, ShardTensor):
        return out
    reduced = [s for s in x._spec.shardings if s.dim in dims]
    # Kept, each held dim carries its own axes.
    first = tuple(s.dim for s in reduced if sum(map(bool, s.sizes)) == 1) if keepdim else ()
    spec, held = held_by_one(out._spec, tuple((s.axes, s.sizes) for s in reduced), first)
    return ShardTensor(held_local(out._local, spec, held), spec) if held else out


# ---------------------------------------------------------------------------- var / std
def _variance_and_mean(x: ShardTensor, dims: tuple[int, ...], correction: float, keepdim: bool):
    count = math.prod(x.shape[d] for d in dims)
    mean = reduced_now(aten.div.Scalar(aten.sum.dim_IntList(x, list(dims), True), count))
    centered = aten.sub.Tensor(x, mean)
    if centered.dtype.is_complex:
        centered = aten.abs.default(centered)
    squares = aten.sum.dim_IntList(aten.mul.Tensor(centered, centered), list(dims), keepdim)
    variance = aten.div.Scalar(squares, count - correction)
    if not keepdim:
        mean = aten.squeeze.dims(mean, list(dims))
    return variance, mean


def _variance_args(func, args, kwargs):
    a = bind(func, args, kwargs)
    correction = 1 if a.correction is None else a.correction
    return a.self, normalized_dims(a.dim, a.self.ndim), correction, bool(a.keepdim)


@register_aten_handler(aten.var.correction, aten.std.correction)
def _var_std(func, args, kwargs):
    x, dims, correction, keepdim = _variance_args(func, args, kwargs)
    if not accepts(x, sharded=dims, partial=True):
        return NotImplemented
    variance, _ = _variance_and_mean(x, dims, correction, keepdim)
    return variance if func is aten.var.correction else aten.sqrt.default(reduced_now(variance))


@register_aten_handler(aten.var_mean.correction, aten.std_mean.correction)
def _var_std_mean(func, args, kwargs):
    """Composed on every layout: DTensor has no rule for the pair."""
    x, dims, correction, keepdim = _variance_args(func, args, kwargs)
    variance, mean = _variance_and_mean(x, dims, correction, keepdim)
    spread = (
        variance if func is aten.var_mean.correction else aten.sqrt.default(reduced_now(variance))
    )
    return spread, mean


# ---------------------------------------------------------------------------- empty shards
def _identity(dtype: torch.dtype, largest: bool) -> float | int | bool:
    """The identity of max (``largest=False``: the smallest value) or of min."""
    if dtype == torch.bool:
        return not largest
    if dtype.is_floating_point:
        return -math.inf if not largest else math.inf
    info = torch.iinfo(dtype)
    return info.min if not largest else info.max


def _empty_safe(reduce, largest_identity: bool):
    """Wrap a local ``reduce(x, dim, keepdim)`` so that reducing an empty shard gives the
    identity instead of raising."""

    def local(x: torch.Tensor, dim=None, keepdim: bool = False, *rest):
        dims = normalized_dims(dim, x.ndim)
        if x.numel() != 0 or not any(x.shape[d] == 0 for d in dims):
            return reduce(x, *([] if dim is None else [dim]), keepdim, *rest)
        shape = [1 if d in dims else n for d, n in enumerate(x.shape)]
        if not keepdim:
            shape = [n for d, n in enumerate(shape) if d not in dims]
        return torch.full(
            shape, _identity(x.dtype, largest_identity), dtype=x.dtype, device=x.device
        )

    return local


_AMAX = _empty_safe(torch.ops.aten.amax.default, largest_identity=False)
_AMIN = _empty_safe(torch.ops.aten.amin.default, largest_identity=True)


@register_aten_handler(aten.amax.default, aten.amin.default)
def _amax_amin(func, args, kwargs):
    local = _AMAX if func is aten.amax.default else _AMIN
    out = run_with_propagation(func, args, kwargs, local_impl=local)
    a = bind(func, args, kwargs)
    return kept_by_holder(out, a.self, normalized_dims(a.dim, a.self.ndim), bool(a.keepdim))


@register_aten_handler(aten.aminmax.default)
def _aminmax(func, args, kwargs):
    """``(amin, amax)`` through their handlers (the local aminmax rejects an empty shard)."""
    a = bind(func, args, kwargs)
    dims, keepdim = [] if a.dim is None else [a.dim], bool(a.keepdim)
    return aten.amin.default(a.self, dims, keepdim), aten.amax.default(a.self, dims, keepdim)


@register_aten_handler(aten.all.dims)
def _all_dims(func, args, kwargs):
    """``all`` over several dims is ``not any(not x)`` over them; DTensor has a rule for
    ``any.dims`` and none for ``all.dims``."""
    a = bind(func, args, kwargs)
    anywhere = aten.any.dims(aten.logical_not.default(a.self), a.dim, keepdim=bool(a.keepdim))
    return aten.logical_not.default(anywhere)


@register_aten_handler(aten.max.default, aten.min.default)
def _max_min(func, args, kwargs):
    reduce = aten.amax.default if func is aten.max.default else aten.amin.default

    def local(x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            return torch.full((), _identity(x.dtype, func is aten.min.default), dtype=x.dtype)
        return reduce(x)

    return run_with_propagation(func, args, kwargs, local_impl=local)


@register_aten_handler(aten.linalg_vector_norm.default)
def _vector_norm(func, args, kwargs):
    """A norm over a dim one rank holds stays with that rank (``kept_by_holder``: the others'
    terms, the norms of empty shards, add nothing). Infinite and negative orders have no
    identity, so torch refuses them on an empty shard: there the shard's norm is the value
    that adds nothing when shards are combined (0 for inf, inf for -inf and negative orders:
    ``inf ** p = 0``)."""
    a = bind(func, args, kwargs)
    if not accepts(a.self, partial=True):
        return NotImplemented

    def local(x, ord=2, dim=None, keepdim=False, *, dtype=None):
        dims = normalized_dims(dim, x.ndim)
        if x.numel():
            return aten.linalg_vector_norm.default(x, ord, dim, keepdim, dtype=dtype)
        shape = [1 if d in dims else n for d, n in enumerate(x.shape)]
        if not keepdim:
            shape = [n for d, n in enumerate(shape) if d not in dims]
        value = 0.0 if ord > 0 else math.inf
        return torch.full(shape, value, dtype=dtype or x.real.dtype, device=x.device)

    identity_free = not math.isinf(a.ord) and a.ord >= 0
    out = run_with_propagation(func, args, kwargs, local_impl=None if identity_free else local)
    dims = normalized_dims(a.dim, a.self.ndim)
    return kept_by_holder(out, a.self, dims, bool(a.keepdim))


@register_aten_handler(aten.prod.dim_int)
def _prod(func, args, kwargs):
    """A product over a dim one rank holds stays with that rank (``kept_by_holder``: the
    others' terms, products of empty shards, are ones); other products take the default
    path."""
    a = bind(func, args, kwargs)
    if not accepts(a.self, sharded=[a.dim]):
        return NotImplemented
    out = run_with_propagation(func, args, kwargs)
    return kept_by_holder(out, a.self, (a.dim % max(a.self.ndim, 1),), bool(a.keepdim))


# ---------------------------------------------------------------------------- argmax / argmin
@register_aten_handler(aten.argmax.default, aten.argmin.default)
def _argmax_argmin(func, args, kwargs):
    a = bind(func, args, kwargs)
    x, dim = a.self, a.dim
    if x._spec.partial:
        x = x.redistribute(
            placements=[Replicate() if p.is_partial() else p for p in x._spec.placements]
        )
    if dim is None:
        return _flat_arg_extreme(x, func is aten.argmax.default)
    dim %= max(x.ndim, 1)
    if not accepts(x, sharded=[dim]):
        return NotImplemented
    largest = func is aten.argmax.default
    held = _held_extremes(x, dim, bool(a.keepdim), torch.max if largest else torch.min)
    if held is not None:
        return held[1]
    return _arg_extreme_along(x, dim, bool(a.keepdim), largest)


def _max_min_dim_signature(input, dim, keepdim=False):
    """``torch.max``/``torch.min`` (and the Tensor methods) with a dim."""


@register_function_handler(torch.max, torch.Tensor.max, torch.min, torch.Tensor.min)
def _max_min_along(func, args, kwargs):
    """``torch.max``/``torch.min`` with a dim (``_values_and_indices``), above autograd: the
    gradient of a value goes to its cell alone, computed from the ShardTensor ops that pick it
    (backward moves no byte). The other overloads (``max(x)``, ``max(x, other)``, ``out=``)
    take their usual paths, and so does what ``_values_and_indices`` declines."""
    if len(args) + len(kwargs) < 2 or not set(kwargs) <= {"dim", "keepdim"}:
        return NotImplemented
    a = bind(func, args, kwargs, signature=_max_min_dim_signature)
    if not isinstance(a.input, ShardTensor) or not isinstance(a.dim, int):
        return NotImplemented
    largest = func in (torch.max, torch.Tensor.max)
    found = _extremes(a.input, a.dim, bool(a.keepdim), largest)
    if found is NotImplemented:
        return NotImplemented
    return torch.return_types.max(found) if largest else torch.return_types.min(found)


@register_aten_handler(aten.max.dim, aten.min.dim)
def _max_min_dim(func, args, kwargs):
    """``aten.max.dim``/``aten.min.dim`` called directly (a decomposition, a compiled graph):
    as ``torch.max`` with a dim, below autograd (``_extremes``); the backward (``max``'s formula: the gradient scattered through
    the indices) runs on the ShardTensor ops it calls."""
    a = bind(func, args, kwargs)
    return _extremes(a.self, a.dim, bool(a.keepdim), func is aten.max.dim)


@register_aten_handler(aten.median.dim, aten.nanmedian.dim)
def _median_dim(func, args, kwargs):
    """``median``/``nanmedian`` along a dim one rank holds whole (``torch.masked.median`` too):
    torch's kernel on the holder (``_held_extremes``), no byte moved; the backward (the
    gradient scattered through the indices, as ``max``'s) runs on the holder. Along a dim
    ranks share, the default path gathers it: an order statistic needs every cell of the dim
    (a distributed selection is not written)."""
    a = bind(func, args, kwargs)
    kernel = torch.median if func is aten.median.dim else torch.nanmedian
    found = _held_extremes(a.self, a.dim, bool(a.keepdim), kernel)
    return NotImplemented if found is None else found


def _extremes(x: ShardTensor, dim: int, keepdim: bool, largest: bool):
    """``(values, indices)`` of max or min along ``dim``: kept by the rank holding it whole
    (``_held_extremes``), else ``_values_and_indices``."""
    found = _held_extremes(x, dim, keepdim, torch.max if largest else torch.min)
    return _values_and_indices(x, dim, keepdim, largest) if found is None else found


def _values_and_indices(x: ShardTensor, dim: int, keepdim: bool, largest: bool):
    """``(values, indices)`` of max (``largest``) or min along a sharded ``dim`` without
    gathering it: the indices are ``argmax``'s (an exchange of each rank's best per output
    element); the rank holding each chosen cell picks its value and the others add zeros (a
    pending sum over the dim's axes, all-reduced; bools as 0/1 bytes). NotImplemented for a
    dim no axis splits and a dim of extent 0 (torch's error, on every rank)."""
    dim = dim % max(x.ndim, 1)
    if not accepts(x, sharded=[dim]) or x.shape[dim] == 0:
        return NotImplemented
    dtype = x.dtype
    if dtype == torch.bool:
        x = aten._to_copy.default(x, dtype=torch.uint8)
    indices = _arg_extreme_along(x, dim, True, largest)
    spec = x._spec
    local = x.to_local()
    offset = spec.local_offsets()[dim]
    at = indices._local - offset
    if local.shape[dim] == 0:
        term = connected_empty(list(at.shape), local, local)
    else:
        mine = (at >= 0) & (at < local.shape[dim])
        picked = local.gather(dim, at.clamp(0, local.shape[dim] - 1))
        term = torch.where(mine, picked, torch.zeros_like(picked))
    pending = reduced_spec(spec, dim, True, x.dtype, Partial())
    values = redistribute(from_local_spec(term, pending), indices._spec.with_dtype(x.dtype))
    if dtype == torch.bool:
        values = aten._to_copy.default(values, dtype=torch.bool)
    if not keepdim:
        values, indices = values.squeeze(dim), indices.squeeze(dim)
    return values, indices


def _held_extremes(x: ShardTensor, dim: int, keepdim: bool, kernel):
    """``(values, indices)`` along a ``dim`` one rank holds whole, kept by that rank like a
    sum (NOTE [A sum over a dim one rank holds stays with that rank] in ``_common``): torch's
    own ``kernel`` (``torch.max``, ``min``, ``median``, ``nanmedian``: one value and its index
    per output cell) on the holder, empty outputs elsewhere, no byte moved. None where no rank
    holds ``dim`` whole or the output has no dim to carry the held axes (0-d). Above autograd
    the values' gradient reaches the holder's cells through ``to_local``; below it (aten's
    overloads), ``max``'s backward scatters through the held indices on the holder (NOTE [A
    scatter through an index its holder holds writes on that holder] in
    ``_gather_scatter_ops``)."""
    dim = dim % max(x.ndim, 1)
    if not accepts(x, sharded=[dim]) or x.shape[dim] == 0:
        return None
    spec = x._spec
    sharding = spec.sharding_by_dim[dim]
    held, _ = held_axes(sharding, spec.mesh_shape)
    if held is None or held.axes != sharding.axes or (x.ndim == 1 and not keepdim):
        return None
    # The holder's value is the result, as a max of one term is: held_by_one keeps it there.
    placement = Partial("min" if kernel is torch.min else "max")
    pending = reduced_spec(spec, dim, keepdim, x.dtype, placement)
    first = (dim,) if keepdim else ()
    out_spec, _ = held_by_one(pending, ((sharding.axes, sharding.sizes),), first)
    local = x.to_local()
    if local.shape[dim] == 0:
        shape = list(out_spec.local_shape())
        values = connected_empty(shape, local, local)
        indices = torch.zeros(shape, dtype=torch.int64, device=local.device)
    else:
        values, indices = kernel(local, dim, keepdim=keepdim)
    return (
        from_local_spec(values, out_spec),
        ShardTensor(indices, out_spec.with_dtype(torch.int64)),
    )


def _best_of(values: torch.Tensor, valid: torch.Tensor, largest: bool) -> torch.Tensor:
    """Index along dim 0 of the first best valid entry; NaN beats everything, as in torch."""
    nan = torch.isnan(values) & valid if values.is_floating_point() else torch.zeros_like(valid)
    fill = -math.inf if largest else math.inf
    if not values.is_floating_point():
        fill = _identity(values.dtype, not largest)
    clean = values.masked_fill(~valid | nan, fill)
    best = clean.amax(0, keepdim=True) if largest else clean.amin(0, keepdim=True)
    candidates = torch.where(nan.any(0, keepdim=True), nan, (clean == best) & valid)
    return candidates.to(torch.uint8).argmax(0)


def _arg_extreme_along(x: ShardTensor, dim: int, keepdim: bool, largest: bool) -> ShardTensor:
    spec = x._spec
    sharding = spec.sharding_by_dim[dim]
    local = x._local
    offset = spec.local_offsets()[dim]
    out_shape = list(local.shape)
    out_shape[dim] = 1
    if local.shape[dim] == 0:
        values = torch.zeros(out_shape, dtype=local.dtype, device=local.device)
        indices = torch.zeros(out_shape, dtype=torch.int64, device=local.device)
        valid = torch.zeros(out_shape, dtype=torch.bool, device=local.device)
    else:
        reduce = torch.max if largest else torch.min
        values, indices = reduce(local, dim, keepdim=True)
        nan_first = torch.isnan(local).any(dim, keepdim=True) if local.is_floating_point() else None
        if nan_first is not None and bool(nan_first.any()):
            first_nan = torch.isnan(local).to(torch.uint8).argmax(dim, keepdim=True)
            indices = torch.where(nan_first, first_nan, indices)
            values = torch.where(nan_first, torch.full_like(values, math.nan), values)
        indices = indices + offset
        valid = torch.ones(out_shape, dtype=torch.bool, device=local.device)
    group = axis_group(spec.mesh, sharding.axes)
    packed = [values, indices, valid]
    gathered = [
        torch.stack(
            exchange(
                group,
                [t] * group.size,
                lambda s, d, t=t: t.shape,
                dtype=t.dtype,
                device=t.device,
                kind="all_gather",
            )
        )
        for t in packed
    ]
    choice = _best_of(gathered[0], gathered[2], largest)
    result = torch.gather(gathered[1], 0, choice.unsqueeze(0)).squeeze(0)
    if not keepdim:
        result = result.squeeze(dim)
    return ShardTensor(result, reduced_spec(spec, dim, keepdim))


def reduced_spec(
    spec: ShardTensorSpec,
    dim: int,
    keepdim: bool,
    dtype: torch.dtype = torch.int64,
    placement: Placement | None = None,
) -> ShardTensorSpec:
    """Spec after reducing ``dim`` (default: to an int64 index): its axes hold ``placement``
    (default Replicate; Partial for a pending sum), the other sharded dims keep their sizes.
    It remembers the input's shardings (NOTE [Shard-size hints]), ``dim``'s too where it is
    kept: the layout a backward formula's new tensor of the input's shape takes."""
    placement = Replicate() if placement is None else placement
    placements = []
    for p in spec.placements:
        if isinstance(p, Shard) and p.dim == dim:
            placements.append(placement)
        elif isinstance(p, Shard) and p.dim > dim and not keepdim:
            placements.append(Shard(p.dim - 1))
        else:
            placements.append(p)
    shape = list(spec.shape)
    if keepdim:
        shape[dim] = 1
    else:
        del shape[dim]
    sizes = {}
    order = {}
    for s in spec.shardings:
        if s.dim != dim:
            new_dim = s.dim - 1 if s.dim > dim and not keepdim else s.dim
            sizes[new_dim], order[new_dim] = s.sizes, s.axes
    hints = tuple(
        replace(h, dim=h.dim - 1 if h.dim > dim and not keepdim else h.dim)
        for h in merged_hints(spec.hints, spec.shardings)
        if keepdim or h.dim != dim
    )
    return ShardTensorSpec.build(
        spec.mesh, placements, shape, dtype, sizes, order=order, hints=hints
    )


def _flat_arg_extreme(x: ShardTensor, largest: bool) -> ShardTensor:
    """argmax/argmin of the flattened tensor: each rank offers its best (value, global flat
    index); one exchange over all sharded axes picks the first best."""
    spec = x._spec
    local = x._local
    if local.numel() == 0:
        value = torch.zeros((), dtype=local.dtype, device=local.device)
        index = torch.zeros((), dtype=torch.int64, device=local.device)
        valid = torch.zeros((), dtype=torch.bool, device=local.device)
    else:
        flat_local = (torch.argmax if largest else torch.argmin)(local)
        if local.is_floating_point() and bool(torch.isnan(local).any()):
            flat_local = torch.isnan(local).reshape(-1).to(torch.uint8).argmax()
        value = local.reshape(-1)[flat_local]
        coords = torch.unravel_index(flat_local, local.shape)
        offsets = spec.local_offsets()
        index = torch.zeros((), dtype=torch.int64, device=local.device)
        for d, c in enumerate(coords):
            index = index * spec.shape[d] + (c + offsets[d])
        valid = torch.ones((), dtype=torch.bool, device=local.device)
    axes = tuple(sorted(a for s in spec.shardings for a in s.axes))
    result = index
    if axes:
        group = axis_group(spec.mesh, axes)
        gathered = [
            torch.stack(
                exchange(
                    group,
                    [t] * group.size,
                    lambda s, d: (),
                    dtype=t.dtype,
                    device=t.device,
                    kind="all_gather",
                )
            )
            for t in (value, index, valid)
        ]
        candidates = gathered[0].clone()
        choice = _first_best_by_index(candidates, gathered[1], gathered[2], largest)
        result = gathered[1][choice]
    replicated = ShardTensorSpec.build(spec.mesh, [Replicate()] * spec.mesh.ndim, (), torch.int64)
    return ShardTensor(result, replicated)


def _first_best_by_index(values, indices, valid, largest: bool) -> int:
    """Among ranks, the best value with the smallest global index (ranks along different axes
    are not in index order, so ties are broken by index explicitly)."""
    nan = torch.isnan(values) & valid if values.is_floating_point() else torch.zeros_like(valid)
    if bool(nan.any()):
        pool = nan
    else:
        fill = (
            _identity(values.dtype, not largest)
            if not values.is_floating_point()
            else (-math.inf if largest else math.inf)
        )
        clean = values.masked_fill(~valid, fill)
        best = clean.max() if largest else clean.min()
        pool = (clean == best) & valid
    masked = indices.masked_fill(~pool, torch.iinfo(torch.int64).max)
    return int(masked.argmin())


# ---------------------------------------------------------------------------- logsumexp
@register_aten_handler(aten.logsumexp.default)
def _logsumexp(func, args, kwargs):
    """``max + log(sum(exp(x - max)))``, the max taken as 0 where it is infinite (as torch)."""
    a = bind(func, args, kwargs)
    x, keepdim = a.self, bool(a.keepdim)
    dims = normalized_dims(a.dim, x.ndim)
    if not accepts(x, sharded=dims, partial=True, floating=True):
        return NotImplemented
    peak = reduced_now(aten.amax.default(x, list(dims), True))
    peak = aten.masked_fill.Scalar(peak, aten.isinf.default(peak), 0)
    total = aten.sum.dim_IntList(aten.exp.default(aten.sub.Tensor(x, peak)), list(dims), keepdim)
    if not keepdim:
        peak = aten.squeeze.dims(peak, list(dims))
    return aten.add.Tensor(aten.log.default(reduced_now(total)), peak)


# ---------------------------------------------------------------------------- histograms
def _global_range(x: ShardTensor) -> tuple[float, float]:
    """The smallest and largest element of ``x`` (one all-reduce each)."""
    low = reduced_now(aten.amin.default(x, [], False))._local.item()
    high = reduced_now(aten.amax.default(x, [], False))._local.item()
    return low, high


def _counted_per_rank(x: ShardTensor, counts: torch.Tensor) -> ShardTensor:
    """Counts of this rank's elements: a partial sum over the axes that shard ``x``."""
    axes = sharding_axes(x._spec)
    placements = [Partial() if a in axes else Replicate() for a in range(x._spec.mesh.ndim)]
    return ShardTensor(
        counts, ShardTensorSpec.build(x._spec.mesh, placements, counts.shape, counts.dtype)
    )


@register_aten_handler(aten.histc.default)
def _histc(func, args, kwargs):
    a = bind(func, args, kwargs)
    x, low, high = a.self, a.min, a.max
    if low == high == 0 and x.numel() != 0:  # the data's own range, as torch takes it
        low, high = _global_range(x)
    return _counted_per_rank(x, func(x._local, a.bins, low, high))


@register_aten_handler(aten.histogram.bin_ct, aten.histogram.bins_tensor)
def _histogram(func, args, kwargs):
    """Each rank counts its elements against the same edges (from the global range when the
    call gives none); a density divides them by the global total (NOTE [A histogram is a
    pending sum of each rank's counts])."""
    a = bind(func, args, kwargs)
    x, bins, weight, density = a.self, a.bins, a.weight, bool(a.density)
    if not accepts(x, bins, weight, partial=True, replicated=[bins]) or (
        isinstance(weight, ShardTensor)
        and not weight._spec.same_layout(x._spec.with_dtype(weight.dtype))
    ):
        return NotImplemented
    bins = local_of(bins)
    if isinstance(weight, ShardTensor):
        weight = weight._local
    elif weight is not None:
        weight = x._spec.narrow(weight)
    local = {"weight": weight}
    if func is aten.histogram.bin_ct:
        span = a.range
        if span is None and x.numel() != 0:
            span = list(_global_range(x))
        local["range"] = span
    counts, edges = func(x._local, bins, **local)
    if density:
        total = reduced_now(_counted_per_rank(x, counts.sum()))._local
        counts = counts / (total * edges.diff())
    return _counted_per_rank(x, counts), _replicated(x, edges)


def _replicated(x: ShardTensor, value: torch.Tensor) -> ShardTensor:
    """``value``, the same on every rank, as a replicated ShardTensor on ``x``'s mesh."""
    mesh = x._spec.mesh
    return ShardTensor(
        value, ShardTensorSpec.build(mesh, [Replicate()] * mesh.ndim, value.shape, value.dtype)
    )
