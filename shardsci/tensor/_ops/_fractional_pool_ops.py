"""Fractional max pooling of sharded tensors, from the global random samples.

``F.fractional_max_poolNd`` draws, per (batch, channel) plane, one number ``u`` in [0, 1) for
each pooled dim (``_random_samples``, shape (N, C, N_d)), and window ``i`` of a dim of input
extent ``I``, output extent ``O`` and kernel ``k`` starts at
``int((i + u) a) - int(u a)`` with ``a = (I - k) / (O - 1)`` (the last at ``I - k``; computed
in the input's dtype, as torch does). The samples are given, whole on every rank, or drawn
as torch draws them, by every rank (its generator advances as torch's would), and the first
rank's sent to all (a few numbers per plane: ranks whose generators differ would otherwise
plan different layouts and exchanges); then every rank knows every plane's windows.

The output keeps the input's placements (NOTE [Which rank owns an output of a windowed op] in
``_windows``, with windows that differ by plane): along a sharded dim, output ``i`` belongs to
the shard that holds the planes' windows ``i`` whole (the first, where they lie in different
shards; where every plane's window straddles a boundary, the previous output's shard), so
that the cells of those planes depend on no other rank's. Each rank
gathers with the halo exchange the input cells its windows read in any plane and takes
their maxima locally: along the last dim, then along each earlier one, keeping the first
strict maximum as torch's kernel does (row-major order). The indices are flat over the
input's pooled dims, global. The gradient flows through the gathers to the argmax cells and
back through the halo exchange.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from shardsci.tensor._api import ShardTensor, from_local_spec
from shardsci.tensor._binding import bind
from shardsci.tensor._collectives import axis_group, broadcast
from shardsci.tensor._halo import extend, extension
from shardsci.tensor._ops._common import accepts
from shardsci.tensor._ops._pool_ops import _per_dim
from shardsci.tensor._ops._windows import output_spec
from shardsci.tensor._registry import register_function_handler
from shardsci.tensor._shape_probe import probe_on_meta
from shardsci.tensor._spec import ShardTensorSpec, mesh_coordinate

# What __torch_function__ receives: the ``boolean_dispatch`` wrapper F.fractional_max_poolNd
# (bound by the signature of its ``_with_indices`` twin), or the twin itself.
_FRACTIONAL = {
    F.fractional_max_pool2d: F.fractional_max_pool2d_with_indices,
    F.fractional_max_pool2d_with_indices: F.fractional_max_pool2d_with_indices,
    F.fractional_max_pool3d: F.fractional_max_pool3d_with_indices,
    F.fractional_max_pool3d_with_indices: F.fractional_max_pool3d_with_indices,
}
_POOLED_DIMS = {F.fractional_max_pool2d_with_indices: 2, F.fractional_max_pool3d_with_indices: 3}


#: Pooled dim -> its sample: torch's 2-d kernel reads sample 0 for W and 1 for H, its 3-d
#: kernel 0, 1, 2 for T, H, W.
_SAMPLE_OF = {2: (1, 0), 3: (0, 1, 2)}


@register_function_handler(*_FRACTIONAL)
def _fractional_max_pool(func, args, kwargs):
    a = bind(func, args, kwargs, signature=_FRACTIONAL[func])
    x, n = a.input, _POOLED_DIMS[_FRACTIONAL[func]]
    with_indices = func in _POOLED_DIMS or bool(a.return_indices)
    samples = a._random_samples
    if not accepts(x, floating=True, replicated=[samples]):
        return NotImplemented
    result = probe_on_meta(func, args, kwargs)
    out_shape = tuple((result[0] if isinstance(result, tuple) else result).shape)
    if samples is None:  # drawn as torch draws them, the first rank's for every rank
        batch = 1 if x.ndim == n + 1 else x.shape[0]
        drawn = torch.rand(batch, x.shape[-n - 1], n, dtype=x.dtype, device=x.device)
        mesh = axis_group(x._spec.mesh, range(x._spec.mesh.ndim))
        samples = broadcast(drawn, 0, mesh, shape=drawn.shape, dtype=drawn.dtype, device=x.device)
    elif isinstance(samples, ShardTensor):
        samples = samples.to_local()
    spec, first = x._spec, x.ndim - n
    kernel = _per_dim(a.kernel_size, n)
    planes = _local_planes(samples, spec, n)
    starts, requests, out_sizes, out_ranges = [], [], {}, {}
    for i, dim in enumerate(range(first, x.ndim)):
        u = samples[..., _SAMPLE_OF[n][i]]
        every = _window_starts(u, x.shape[dim], out_shape[dim], kernel[i])
        sharding = spec.sharding_by_dim.get(dim)
        lo = 0
        if sharding is None:
            out_ranges[dim] = (0, out_shape[dim])
        else:
            sizes = _owned_sizes(every, kernel[i], sharding.sizes)
            bounds = [sum(sizes[:r]) for r in range(len(sizes) + 1)]
            pairs = itertools.pairwise(bounds)
            ranges = tuple(_read_range(every, kernel[i], begin, end) for begin, end in pairs)
            me = sharding.flat_index(spec.mesh_shape, mesh_coordinate(spec.mesh))
            out_sizes[dim], out_ranges[dim] = sizes, (bounds[me], bounds[me + 1])
            requests.append((dim, ranges, "zeros"))
            lo = ranges[me][0]
        mine = planes(every)[..., out_ranges[dim][0] : out_ranges[dim][1]]
        starts.append((mine - lo, mine))
    cells = extend(x.to_local(), extension(spec, tuple(requests))) if requests else x.to_local()
    local_starts, global_starts = zip(*starts)
    values, index = _maxima(cells, list(local_starts), kernel, list(global_starts), x.shape[first:])
    out = from_local_spec(values, output_spec(spec, out_shape, out_sizes, values.dtype))
    if not with_indices:
        return out
    return out, from_local_spec(index, output_spec(spec, out_shape, out_sizes, index.dtype))


def _local_planes(samples: torch.Tensor, spec: ShardTensorSpec, n: int):
    """A function narrowing a per-plane tensor (N, C, ...) (or (1, C, ...) for an unbatched
    input) to this rank's planes, laid out to broadcast against its cells."""
    first = spec.ndim - n
    offsets, shape = spec.local_offsets(), spec.local_shape()

    def narrow(t: torch.Tensor) -> torch.Tensor:
        if first == 1:  # unbatched (C, *spatial)
            return t[0].narrow(0, offsets[0], shape[0])
        return t.narrow(0, offsets[0], shape[0]).narrow(1, offsets[1], shape[1])

    return narrow


def _window_starts(u: torch.Tensor, extent: int, out: int, kernel: int) -> torch.Tensor:
    """Per plane (the shape of ``u``), the start of every window along one dim: torch's
    ``generate_intervals``, in ``u``'s dtype, truncating to int as it does."""
    starts = torch.full((*u.shape, out), extent - kernel, dtype=torch.int64, device=u.device)
    if out > 1:
        i = torch.arange(out - 1, dtype=u.dtype, device=u.device)
        alpha = torch.tensor(extent - kernel, dtype=u.dtype) / torch.tensor(out - 1, dtype=u.dtype)
        shift = (u * alpha).to(torch.int64)[..., None]
        starts[..., :-1] = ((i + u[..., None]) * alpha).to(torch.int64) - shift
    return starts


def _owned_sizes(starts: torch.Tensor, kernel: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
    """Output shard sizes along one dim: output ``i`` to the shard that holds plane windows
    ``i`` whole (the first such, where planes' windows lie in different shards), or, where
    every plane's window straddles a boundary, to the previous output's shard."""
    ends = torch.tensor([sum(sizes[: r + 1]) for r in range(len(sizes))])
    flat = starts.reshape(-1, starts.shape[-1])
    first = torch.searchsorted(ends, flat, right=True)
    last = torch.searchsorted(ends, flat + kernel - 1, right=True)
    held = torch.where(first == last, first, len(sizes))
    held = held.min(0).values.tolist() if held.numel() else [len(sizes)] * flat.shape[-1]
    owners, previous = [], next((r for r, s in enumerate(sizes) if s), 0)
    for owner in held:
        previous = owner if owner < len(sizes) else previous
        owners.append(previous)
    return tuple(owners.count(r) for r in range(len(sizes)))


def _read_range(starts: torch.Tensor, kernel: int, a: int, b: int) -> tuple[int, int]:
    """The input cells windows ``[a, b)`` read in any plane."""
    mine = starts[..., a:b]
    if not mine.numel():  # no output here, or no plane
        return (0, 0)
    return int(mine.min()), int(mine.max()) + kernel


def _maxima(
    cells: torch.Tensor,
    starts: list[torch.Tensor],
    kernel: tuple[int, ...],
    global_starts: list[torch.Tensor],
    extents: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each window's maximum (the first strict one in row-major order, as torch's kernel
    keeps) and its index flat over the pooled ``extents``. ``starts[i]`` and
    ``global_starts[i]``: per local plane, per output along pooled dim ``i``, the window's
    start in ``cells`` and in the input."""
    n = len(starts)
    values, flat = cells, None
    for i in reversed(range(n)):
        dim = cells.ndim - n + i
        stride = math.prod(extents[i + 1 :])
        best, best_at = None, None
        for m in range(kernel[i]):
            where = _along(starts[i] + m, values, dim)
            candidate = values.gather(dim, where)
            position = _along(global_starts[i] + m, values, dim) * stride
            if flat is not None:
                position = position + flat.gather(dim, where)
            if best is None:
                best, best_at = candidate, position
                continue
            better = candidate > best
            best = torch.where(better, candidate, best)
            best_at = torch.where(better, position, best_at)
        values, flat = best, best_at
    return values, flat


def _along(index: torch.Tensor, like: torch.Tensor, dim: int) -> torch.Tensor:
    """``index`` (per plane, per output along ``dim``) laid out as ``like`` with ``dim``
    holding the outputs, for ``gather``."""
    planes = index.ndim - 1
    shape = [*index.shape[:-1], *([1] * (dim - planes)), index.shape[-1]]
    shape += [1] * (like.ndim - dim - 1)
    target = list(like.shape)
    target[dim] = index.shape[-1]
    return index.reshape(shape).expand(target)
