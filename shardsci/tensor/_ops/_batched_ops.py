"""Ops that act on some trailing (core) dims and independently along the others, run on the
shards when only the independent dims are sharded.

Padding as aten ops (``reflection_pad*``, ``replication_pad*``; ``F.pad`` itself has a halo
handler) and their backward, ``unfold`` along a whole dim, average-pooling backward,
``im2col``/``col2im`` with only the batch sharded, and ``renorm`` along the sharded dim (across
it, a function handler reduces each slice's norm over the mesh instead): each
rank computes its block of the output from its shards, with no communication, and the output
keeps the input's shardings (the independent dims keep their positions). An op whose core
dims are sharded is computed on gathered inputs (``_gathered_ops``), except two with
handlers of their own, below, that gather at most a halo: ``unfold`` along a sharded dim,
and pixel (un)shuffle, which keep the input's placements with the sizes of the window rule
(NOTE [Which rank owns an output of a windowed op] in ``_windows``). A rank whose shard is
empty does not call the kernel: the output's shape comes from running the op on meta tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardsci.tensor._api import ShardTensor, from_local_spec
from shardsci.tensor._binding import Arguments, bind
from shardsci.tensor._copies import CopyOf
from shardsci.tensor._dispatch import local_of
from shardsci.tensor._ops._common import accepts, connected_empty
from shardsci.tensor._ops._gathered_ops import gathered
from shardsci.tensor._ops._windows import (
    Subdivide,
    Window,
    WindowLike,
    gather_windows,
    output_spec,
)
from shardsci.tensor._registry import register_aten_handler, register_function_handler
from shardsci.tensor._shape_probe import probe_on_meta, shape_probe
from shardsci.tensor._spec import ShardTensorSpec

aten = torch.ops.aten

# op -> the core dims of its first tensor argument, from (ndim, the call bound).
_CORE: dict[object, Callable[[int, Arguments], set[int]]] = {}


def _trailing(count: Callable[[Arguments], int]) -> Callable[[int, Arguments], set[int]]:
    return lambda ndim, a: set(range(ndim - count(a), ndim))


def _padded(a: Arguments) -> int:
    return len(a.padding) // 2


for _n in (1, 2, 3):
    _CORE[getattr(aten, f"reflection_pad{_n}d").default] = _trailing(_padded)
    _CORE[getattr(aten, f"replication_pad{_n}d").default] = _trailing(_padded)
    _CORE[getattr(aten, f"reflection_pad{_n}d_backward").default] = _trailing(_padded)
    _CORE[getattr(aten, f"replication_pad{_n}d_backward").default] = _trailing(_padded)
_CORE[aten.avg_pool2d_backward.default] = _trailing(lambda a: 2)
_CORE[aten.avg_pool3d_backward.default] = _trailing(lambda a: 3)
_CORE[aten.im2col.default] = _trailing(lambda a: 3)
_CORE[aten.col2im.default] = _trailing(lambda a: 2)
_CORE[aten.renorm.default] = lambda ndim, a: set(range(ndim)) - {a.dim % ndim}
_CORE[aten.unfold.default] = lambda ndim, a: {a.dimension % ndim}


@register_aten_handler(*_CORE)
def _batched(func, args, kwargs):
    tensors = [a for a in args if isinstance(a, torch.Tensor)]  # the first is the input
    first = tensors[0]
    if not accepts(first, partial=True):
        return NotImplemented
    spec = first._spec
    core = _CORE[func](first.ndim, bind(func, args, kwargs))
    if (
        spec.partial
        or any(s.dim in core for s in spec.shardings)
        or any(not _laid_out_like(t, spec) for t in tensors[1:])
    ):
        return gathered(func, args, kwargs)
    local_args = [local_of(a) for a in args]
    out = _run_local(func, local_args, kwargs)
    shape = list(out.shape)
    for s in spec.shardings:
        shape[s.dim] = spec.shape[s.dim]
    return ShardTensor(out, _with_shape(spec, shape, out.dtype))


def _renorm_signature(input, p, dim, maxnorm):
    """``torch.renorm`` and ``Tensor.renorm``."""


@register_function_handler(torch.renorm, torch.Tensor.renorm)
def _renorm_across_shards(func, args, kwargs):
    """``renorm`` with dims other than ``dim`` (the core dims) sharded: each slice's p-norm is
    reduced over the mesh by ``vector_norm``'s own handler (one all-reduce of a number per
    slice), then every rank scales its cells by torch's factor, ``maxnorm / (norm + 1e-7)``
    where the norm exceeds ``maxnorm``. The output keeps the input's layout (the aten path
    gathers the core dims) and the gradient is autograd's through the norm, as
    ``renorm_backward`` computes it."""
    a = bind(func, args, kwargs, signature=_renorm_signature)
    x = a.input
    if not isinstance(x, ShardTensor) or x.ndim == 0:
        return NotImplemented
    dim = a.dim % x.ndim
    core = [d for d in range(x.ndim) if d != dim]
    if not accepts(x, sharded=core, floating=True):
        return NotImplemented
    probe_on_meta(func, args, kwargs)  # torch's errors (a non-positive p), on every rank
    norm = torch.linalg.vector_norm(x, a.p, dim=core, keepdim=True)
    factor = torch.where(norm > a.maxnorm, a.maxnorm / (norm + 1e-7), torch.ones_like(norm))
    return x * factor


def _laid_out_like(t: torch.Tensor, spec: ShardTensorSpec) -> bool:
    """Another tensor argument is sharded like the first on the same dims (a backward op's
    gradient and input), or neither is sharded nor has the sharded dims."""
    if isinstance(t, ShardTensor):
        return not t._spec.partial and t._spec.shardings == spec.shardings
    return not spec.shardings


def _run_local(func, local_args: list, kwargs: dict) -> torch.Tensor:
    """The op on the shards; on empty shards only its shape, from meta tensors.

    Kernels such as reflection padding and their meta functions reject an empty dim even
    where they do not act on it, so the probe gives each empty dim extent 1 and the output
    has extent 0 there: the op keeps the positions of the dims it runs along independently,
    and only those are sharded (NOTE [A rank with an empty shard computes nothing])."""
    tensors = [a for a in local_args if isinstance(a, torch.Tensor)]
    empty = {d for t in tensors for d, n in enumerate(t.shape) if n == 0}
    if not empty:
        return func(*local_args, **kwargs)
    with shape_probe():
        meta = [_probe(a, empty) if isinstance(a, torch.Tensor) else a for a in local_args]
        out = func(*meta, **kwargs)
    shape = [0 if d in empty else n for d, n in enumerate(out.shape)]
    return torch.zeros(shape, dtype=out.dtype, device=local_args[0].device)


def _probe(t: torch.Tensor, empty: set[int]) -> torch.Tensor:
    """A meta tensor like ``t`` with extent 1 along ``empty``."""
    shape = [1 if d in empty else n for d, n in enumerate(t.shape)]
    return torch.empty(shape, dtype=t.dtype, device="meta")


def _with_shape(spec: ShardTensorSpec, shape: list[int], dtype: torch.dtype) -> ShardTensorSpec:
    return ShardTensorSpec.build(
        spec.mesh,
        spec.placements,
        shape,
        dtype,
        {s.dim: s.sizes for s in spec.shardings},
        order={s.dim: s.axes for s in spec.shardings},
        hints=spec.hints,
    )


@register_aten_handler(aten.unfold_backward.default)
def _unfold_backward(func, args, kwargs):
    """The gradient of an unfold along a whole dim: on the shards, with the input's sizes made
    this rank's."""
    a = bind(func, args, kwargs)
    grad, input_sizes, size, step = a.grad_in, a.input_sizes, a.size, a.step
    if not accepts(grad):
        return NotImplemented
    spec = grad._spec
    dim = a.dim % len(input_sizes)
    if dim in spec.sharding_by_dim:
        return gathered(func, args, kwargs)

    def local(g: torch.Tensor) -> torch.Tensor:
        local_sizes = list(input_sizes)
        for s in spec.shardings:
            local_sizes[s.dim] = g.shape[s.dim]
        return func(g, local_sizes, dim, size, step)

    out = _run_local(local, [grad._local], {})
    return ShardTensor(out, _with_shape(spec, list(input_sizes), out.dtype))


@register_function_handler(torch.Tensor.unfold, torch.unfold_copy)
def _unfold_sharded(func, args, kwargs):
    """``x.unfold(dim, size, step)`` (and ``torch.unfold_copy``) along a sharded dim: each rank
    gathers the elements its windows reach across the boundary (a halo), as a convolution of
    kernel ``size`` and stride ``step`` does, and unfolds them; the windows stay sharded along
    ``dim``."""
    a = bind(func, args, kwargs)
    x, size, step = a.input, a.size, a.step
    dim = a.dimension % max(x.ndim, 1)
    if not accepts(x, sharded=[dim]):
        return NotImplemented
    spec = x._spec
    windows = {dim: Window(size, step)}
    extended, out_sizes, ranges = gather_windows(x.to_local(), spec, windows, {dim: "zeros"})
    count = ranges[dim][1] - ranges[dim][0]
    if count:
        out = func(extended, dim, size, step)
    else:
        local_shape = [*extended.shape, size]
        local_shape[dim] = 0
        out = connected_empty(local_shape, extended, extended)
    shape = [*x.shape, size]
    shape[dim] = windows[dim].output_extent(x.shape[dim])
    result = from_local_spec(out, output_spec(spec, shape, out_sizes, out.dtype))
    if func is torch.Tensor.unfold:  # torch's view is a copy here: a write into it raises
        result._copy_of = CopyOf(aten.unfold.default, True, agreed=True)
    return result


@register_aten_handler(aten.pixel_shuffle.default, aten.pixel_unshuffle.default)
def _pixel_shuffle(func, args, kwargs):
    """Pixel shuffle by ``r``, ``(*, C r^2, H, W) -> (*, C, H r, W r)``, and its inverse, on
    the shards: each of the last three dims is a window (NOTE [Which rank owns an output of a
    windowed op] in ``_windows``). Shuffle: output row ``i`` comes from input row ``i // r``
    (``Subdivide``), so shard sizes along H and W grow by ``r`` with no communication, and
    output channel ``c`` reads input channels ``[c r^2, (c + 1) r^2)``. Unshuffle: output row
    ``j`` reads input rows ``[j r, (j + 1) r)`` and belongs to the owner of row ``j r + (r -
    1) // 2``; shard boundaries that are multiples of ``r`` move nothing, others are realigned
    by a halo exchange of the rows a rank lacks. Leading dims keep their shardings. The
    backward of each is the other, through this handler."""
    a = bind(func, args, kwargs)
    x = a.self
    if not accepts(x, partial=True) or x.ndim < 3:
        return NotImplemented
    spec = x._spec
    shuffle = func is aten.pixel_shuffle.default
    r = a.upscale_factor if shuffle else a.downscale_factor
    shape = probe_on_meta(func, (x, r)).shape
    core = range(x.ndim - 3, x.ndim)
    spatial: WindowLike = Subdivide(r) if shuffle else Window(r, r)
    channels: WindowLike = Window(r * r, r * r) if shuffle else Subdivide(r * r)
    windows = {d: channels if d == x.ndim - 3 else spatial for d in core}
    windows = {d: w for d, w in windows.items() if d in spec.sharding_by_dim}
    extended, out_sizes, ranges = gather_windows(
        x._local, spec, windows, dict.fromkeys(windows, "zeros")
    )
    out_spec = output_spec(spec, shape, out_sizes, spec.dtype)
    if extended.numel() == 0:
        return ShardTensor(extended.new_zeros(out_spec.local_shape()), out_spec)
    out = func(extended, r)
    for dim, window in windows.items():
        first, stop = ranges[dim]
        lo = window.input_range(first, stop, spec.shape[dim])[0]
        start = lo * window.factor if isinstance(window, Subdivide) else lo // window.stride
        out = out.narrow(dim, first - start, stop - first)
    return ShardTensor(out, out_spec)
