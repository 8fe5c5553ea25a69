"""Max, average and adaptive pooling on spatially sharded tensors.

Pooling is a windowed op (NOTE [Which rank owns an output of a windowed op] in ``_windows``):
each rank gathers the input cells its outputs read, padding materialised by the boundary, and
pools them locally without padding. A ceil-mode window that runs past the padded input is
completed with more padding cells, so every local window is whole:

- max pooling pads with ``-inf``, which never wins. The indices it returns are flat over the
  input's pooled dims in global coordinates: the local argmax, shifted by where the gathered
  block starts.
- average pooling pads with zeros and takes window sums; the divisor is torch's, a product
  over the pooled dims of the window's length clipped to the padded input
  (``count_include_pad``) or to the input (without), or ``divisor_override``.
- integer tensors pool alike where torch's kernel takes their dtype (max pooling pads with
  the dtype's lowest value; average pooling divides exact integer window sums, truncating as
  torch does), so an integer field (a label map) keeps its layout too; a dtype torch's
  kernel refuses raises torch's error on every rank.
- adaptive pooling of a sharded dim whose extent is a multiple of the output size is a
  pooling with kernel = stride = extent / size; other sharded extents are declined (their
  windows differ in length and overlap). Unsharded pooled dims are pooled adaptively in place.

Every check of the arguments runs torch's own op on a meta tensor of the global shape first,
so bad input raises torch's error on every rank before any collective.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from shardsci.tensor._api import ShardTensor, from_local_spec
from shardsci.tensor._binding import bind
from shardsci.tensor._caches import cached
from shardsci.tensor._halo import extend, pad_locally
from shardsci.tensor._ops._common import accepts, connected_empty
from shardsci.tensor._ops._windows import Window, gather_windows, output_spec, window_plan
from shardsci.tensor._registry import register_aten_handler, register_function_handler
from shardsci.tensor._shape_probe import probe_on_meta

aten = torch.ops.aten

# The callables __torch_function__ receives: nn.MaxPoolNd and F.max_poolNd arrive as the
# ``boolean_dispatch`` wrapper (F.max_poolNd) or, with ``return_indices=True``, as
# F.max_poolNd_with_indices; likewise the adaptive max pools. The others are builtins.
_MAX = {
    F.max_pool1d: 1,
    F.max_pool2d: 2,
    F.max_pool3d: 3,
    torch.max_pool1d: 1,
    torch.max_pool2d: 2,
    torch.max_pool3d: 3,
}
_MAX_WITH_INDICES = {
    F.max_pool1d_with_indices: 1,
    F.max_pool2d_with_indices: 2,
    F.max_pool3d_with_indices: 3,
    torch.max_pool1d_with_indices: 1,
}
_AVG = {F.avg_pool1d: 1, F.avg_pool2d: 2, F.avg_pool3d: 3}
_ADAPTIVE_AVG = {F.adaptive_avg_pool1d: 1, F.adaptive_avg_pool2d: 2, F.adaptive_avg_pool3d: 3}
_ADAPTIVE_MAX = {F.adaptive_max_pool1d: 1, F.adaptive_max_pool2d: 2, F.adaptive_max_pool3d: 3}
_ADAPTIVE_MAX_WITH_INDICES = {
    F.adaptive_max_pool1d_with_indices: 1,
    F.adaptive_max_pool2d_with_indices: 2,
    F.adaptive_max_pool3d_with_indices: 3,
    torch.adaptive_max_pool1d: 1,
}
# F.max_poolNd and F.adaptive_max_poolNd are ``(*args, **kwargs)`` wrappers: their arguments
# are bound by the signature of the function they dispatch to.
_SIGNATURES = {
    F.max_pool1d: F.max_pool1d_with_indices,
    F.max_pool2d: F.max_pool2d_with_indices,
    F.max_pool3d: F.max_pool3d_with_indices,
    F.adaptive_max_pool1d: F.adaptive_max_pool1d_with_indices,
    F.adaptive_max_pool2d: F.adaptive_max_pool2d_with_indices,
    F.adaptive_max_pool3d: F.adaptive_max_pool3d_with_indices,
}
_LOCAL_MAX = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_LOCAL_AVG = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}
_LOCAL_ADAPTIVE_MAX = {1: F.adaptive_max_pool1d, 2: F.adaptive_max_pool2d, 3: F.adaptive_max_pool3d}
_LOCAL_ADAPTIVE_AVG = {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}

# local_op(extended, local_shape, out_ranges) -> values, or (values, indices).
LocalOp = Callable[[torch.Tensor, list[int], dict[int, tuple[int, int]]], object]


def _per_dim(value: int | tuple[int, ...] | list[int], n: int) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * n
    return tuple(value) * n if len(value) == 1 else tuple(value)


def _stride(
    value: int | tuple[int, ...] | list[int] | None, kernel: tuple[int, ...]
) -> tuple[int, ...]:
    """The stride per pooled dim; ``None`` or empty (torch's builtins) means the kernel."""
    if value is None or (not isinstance(value, int) and len(value) == 0):
        return kernel
    return _per_dim(value, len(kernel))


def _global_output_shape(func: Callable, x: ShardTensor, args: tuple, kwargs: dict) -> list[int]:
    """Run torch's op on a meta tensor of the global shape: it raises torch's error for bad
    arguments on every rank, before any collective, and gives the global output shape."""
    result = probe_on_meta(func, args, kwargs)
    return list((result[0] if isinstance(result, tuple) else result).shape)


def _pooling_windows(
    x: ShardTensor,
    n: int,
    kernel: tuple[int, ...],
    stride: tuple[int, ...],
    dilation: tuple[int, ...],
    padding: tuple[int, ...],
    ceil_mode: bool,
) -> dict[int, Window]:
    first = x.ndim - n
    return {
        first + i: Window(kernel[i], stride[i], dilation[i], padding[i], padding[i], ceil_mode)
        for i in range(n)
    }


def _poolable(x: object, kernel: Callable, n: int, with_indices: bool = False) -> bool:
    """Whether the handler takes ``x``: any ShardTensor. A dtype that torch's local
    ``kernel`` refuses raises torch's error here, on every rank before any collective (the
    default path would dispatch torch's op in pieces, some of which take dtypes the op
    refuses as a whole)."""
    if not accepts(x):
        return False
    if not x.dtype.is_floating_point:
        refusal = _kernel_refusal(kernel, n, x.dtype, x.device.type, with_indices)
        if refusal is not None:
            kind, message = refusal
            raise kind(message)
    return True


@cached("pooling kernels' dtypes", 256)
def _kernel_refusal(
    kernel: Callable, n: int, dtype: torch.dtype, device: str, with_indices: bool
) -> tuple[type[Exception], str] | None:
    """The error torch's ``kernel`` raises on ``dtype`` on ``device``, or None: one cell,
    kernel 1, with indices where the call asks for them (torch max-pools integers in 1-d only
    then). The same answer on every rank, where a shard would raise only on ranks whose
    shard is not empty, and a meta tensor not at all."""
    indices = {"return_indices": True} if with_indices else {}
    try:
        kernel(torch.zeros((1, 1) + (1,) * n, dtype=dtype, device=device), 1, **indices)
    except (RuntimeError, NotImplementedError) as error:
        return type(error), str(error)
    return None


def _lowest(dtype: torch.dtype) -> float:
    """The value that never wins a max: ``-inf``, or an integer dtype's minimum."""
    return float("-inf") if dtype.is_floating_point else torch.iinfo(dtype).min


# ---------------------------------------------------------------------------- max
@register_function_handler(*_MAX, *_MAX_WITH_INDICES)
def _max_pool(func, args, kwargs):
    a = bind(func, args, kwargs, signature=_SIGNATURES.get(func))
    x = a.input
    n = _MAX.get(func) or _MAX_WITH_INDICES.get(func)
    with_indices = func in _MAX_WITH_INDICES or bool(a.get("return_indices"))
    if not _poolable(x, _LOCAL_MAX[n], n, with_indices):
        return NotImplemented
    out_shape = _global_output_shape(func, x, args, kwargs)
    kernel = _per_dim(a.kernel_size, n)
    stride = _stride(a.stride, kernel)
    padding = _per_dim(a.padding, n)
    dilation = _per_dim(a.dilation, n)
    ceil_mode = bool(a.ceil_mode)
    windows = _pooling_windows(x, n, kernel, stride, dilation, padding, ceil_mode)
    local_max = _LOCAL_MAX[n]

    def local_op(extended, local_shape, out_ranges):
        if not any(padding):
            return local_max(extended, kernel, stride, 0, dilation, False, with_indices)
        values, indices = local_max(extended, kernel, stride, 0, dilation, False, True)
        starts = _starts(windows, out_ranges, range(x.ndim - n, x.ndim))
        indices = _first_in_bounds(indices, extended.shape[-n:], starts, dilation)
        values = extended.flatten(-n).gather(-1, indices.flatten(-n)).view_as(values)
        return (values, indices) if with_indices else values

    return _pool(x, n, windows, out_shape, local_op, _lowest(x.dtype), with_indices)


def _first_in_bounds(
    indices: torch.Tensor, extents: torch.Size, starts: list[int], dilation: tuple[int, ...]
) -> torch.Tensor:
    """Argmax indices pointing at a padding cell (a window whose cells are all ``-inf``)
    moved to the window's first cell inside the input, which is what torch returns; the
    values are then read at the indices, so that the gradient goes there too."""
    coordinates = _unravel(indices, extents)
    moved = [
        c + (-(c + start)).clamp(min=0).add(d - 1).div(d, rounding_mode="floor") * d
        for c, start, d in zip(coordinates, starts, dilation)
    ]
    return _ravel(moved, extents)


@register_aten_handler(
    aten.max_pool2d_with_indices_backward.default, aten.max_pool3d_with_indices_backward.default
)
def _max_pool_backward(func, args, kwargs):
    """The input gradient of a max pooling called as an aten op, laid out as the input: each
    rank adds its outputs' gradients at their argmax cells in the block of cells its windows
    read, and the halo exchange's adjoint returns the cells a neighbour holds. Declined
    (the default path) unless the gradient and the indices have the layout the window rule
    gives the pooling's output."""
    a = bind(func, args, kwargs)
    grad, x, indices = a.grad_output, a.self, a.indices
    if not accepts(x, floating=True) or not all(
        isinstance(t, ShardTensor) for t in (grad, indices)
    ):
        return NotImplemented
    n = 2 if func is aten.max_pool2d_with_indices_backward.default else 3
    kernel = _per_dim(a.kernel_size, n)
    stride = _stride(a.stride, kernel)
    windows = _pooling_windows(
        x, n, kernel, stride, _per_dim(a.dilation, n), _per_dim(a.padding, n), bool(a.ceil_mode)
    )
    spec = x._spec
    ext, out_sizes, out_ranges = window_plan(
        spec, tuple(sorted(windows.items())), tuple((d, "zeros") for d in sorted(windows))
    )
    expected = output_spec(spec, grad.shape, out_sizes, grad.dtype)
    if not (grad._spec.same_layout(expected) and indices._spec.same_layout(expected)):
        return NotImplemented
    with torch.enable_grad():
        own = x._local.detach().requires_grad_()
        cells = extend(own, ext)
        starts = _starts(windows, out_ranges, range(x.ndim - n, x.ndim))
        local = [c - start for c, start in zip(_unravel(indices._local, x.shape[-n:]), starts)]
        flat = _ravel(local, cells.shape[-n:]).flatten(-n)
        scattered = cells.new_zeros(cells.shape).flatten(-n)
        scattered.scatter_add_(-1, flat, grad._local.flatten(-n).to(cells.dtype))
        (out,) = torch.autograd.grad(cells, own, scattered.view_as(cells), allow_unused=True)
    return ShardTensor(torch.zeros_like(own) if out is None else out, spec.with_dtype(x.dtype))


# ---------------------------------------------------------------------------- avg
@register_function_handler(*_AVG)
def _avg_pool(func, args, kwargs):
    a = bind(func, args, kwargs)
    x = a.input
    n = _AVG[func]
    if not _poolable(x, _LOCAL_AVG[n], n):
        return NotImplemented
    out_shape = _global_output_shape(func, x, args, kwargs)
    kernel = _per_dim(a.kernel_size, n)
    stride = _stride(a.stride, kernel)
    padding = _per_dim(a.padding, n)
    ceil_mode = bool(a.ceil_mode)
    count_include_pad = bool(a.count_include_pad)
    divisor_override = a.get("divisor_override")  # avg_pool1d has none
    windows = _pooling_windows(x, n, kernel, stride, (1,) * n, padding, ceil_mode)
    local_mean = _LOCAL_AVG[n]
    volume = 1
    for k in kernel:
        volume *= k

    def local_op(extended, local_shape, out_ranges):
        if not extended.is_floating_point():
            sums = _window_sums(extended, windows)
            divisors = divisor_override or _divisors(
                windows, out_ranges, x.shape, count_include_pad, sums
            )
            return torch.div(sums, divisors, rounding_mode="trunc")
        means = local_mean(extended, kernel, stride, 0, False, True)
        if divisor_override:
            return means * (volume / divisor_override)
        divisors = _divisors(windows, out_ranges, x.shape, count_include_pad, means)
        return means * (volume / divisors)

    return _pool(x, n, windows, out_shape, local_op, 0.0)


def _window_sums(extended: torch.Tensor, windows: dict[int, Window]) -> torch.Tensor:
    """Exact sums over each whole local window (integer tensors: torch's average of
    integers truncates one exact sum, which a mean times a count would not reproduce)."""
    for dim, window in windows.items():
        extended = extended.unfold(dim, window.kernel, window.stride).sum(-1)
    return extended


def _divisors(
    windows: dict[int, Window],
    out_ranges: dict[int, tuple[int, int]],
    shape: torch.Size,
    count_include_pad: bool,
    like: torch.Tensor,
) -> torch.Tensor:
    """torch's average-pooling divisor for this rank's outputs: the window's cells within the
    padded input (``count_include_pad``) or within the input, a product over pooled dims."""
    product = like.new_ones(())
    for dim, window in windows.items():
        extent = shape[dim]
        first, stop = out_ranges[dim]
        starts = (
            torch.arange(first, stop, dtype=torch.int64, device=like.device) * window.stride
            - window.pad_left
        )
        ends = torch.clamp(starts + window.kernel, max=extent + window.pad_right)
        if not count_include_pad:
            starts, ends = starts.clamp(min=0), ends.clamp(max=extent)
        counts = (ends - starts).clamp(min=1).to(like.dtype)
        view = [1] * like.ndim
        view[dim] = stop - first
        product = product * counts.reshape(view)
    return product


# ---------------------------------------------------------------------------- adaptive
@register_function_handler(*_ADAPTIVE_AVG, *_ADAPTIVE_MAX, *_ADAPTIVE_MAX_WITH_INDICES)
def _adaptive_pool(func, args, kwargs):
    a = bind(func, args, kwargs, signature=_SIGNATURES.get(func))
    x = a.input
    if not accepts(x, floating=True):
        return NotImplemented
    out_shape = _global_output_shape(func, x, args, kwargs)
    n = _ADAPTIVE_AVG.get(func) or _ADAPTIVE_MAX.get(func) or _ADAPTIVE_MAX_WITH_INDICES[func]
    windows = {}
    for dim in range(x.ndim - n, x.ndim):
        if dim in x._spec.sharding_by_dim:
            kernel = _aligned_kernel(func, dim, x.shape[dim], out_shape[dim])
            windows[dim] = Window(kernel, kernel)
    if func in _ADAPTIVE_AVG:
        local_avg = _LOCAL_ADAPTIVE_AVG[n]

        def local_op(extended, local_shape, out_ranges):
            return local_avg(extended, local_shape[-n:])

        return _pool(x, n, windows, out_shape, local_op, 0.0)
    with_indices = func in _ADAPTIVE_MAX_WITH_INDICES or bool(a.get("return_indices"))
    local_max = _LOCAL_ADAPTIVE_MAX[n]

    def local_max_op(extended, local_shape, out_ranges):
        return local_max(extended, local_shape[-n:], with_indices)

    return _pool(x, n, windows, out_shape, local_max_op, float("-inf"), with_indices)


def _aligned_kernel(func: Callable, dim: int, extent: int, size: int) -> int:
    """The kernel (= stride) of an adaptive pooling along sharded ``dim``; it exists when the
    extent is a multiple of the output size, and is declined (on every rank alike) otherwise."""
    if size > 0 and extent % size == 0:
        return extent // size
    raise NotImplementedError(
        f"{getattr(func, '__name__', func)} on a ShardTensor sharded along dim {dim}: the "
        f"extent {extent} is not a multiple of the output size {size}, so the adaptive windows "
        "differ in length and overlap, which is not supported on a sharded dim; choose an "
        f"output size that divides {extent}, or redistribute dim {dim} to Replicate first"
    )


# ---------------------------------------------------------------------------- shared
def _pool(
    x: ShardTensor,
    n: int,
    windows: dict[int, Window],
    out_shape: list[int],
    local_op: LocalOp,
    fill: float,
    with_indices: bool = False,
):
    """Gather the windows of this rank's outputs, pool them with ``local_op``, wrap the
    result (and the indices, made global) laid out by the windows' ownership rule."""
    spec = x._spec
    boundary = dict.fromkeys(windows, "zeros")
    extended, out_sizes, out_ranges = gather_windows(x.to_local(), spec, windows, boundary, fill)
    extended = _whole_windows(extended, windows, out_ranges, fill)
    local_shape = list(extended.shape)
    for dim in range(x.ndim - n, x.ndim):
        first, stop = out_ranges.get(dim, (0, out_shape[dim]))
        local_shape[dim] = stop - first
    if 0 in local_shape:  # NOTE [A rank with an empty shard computes nothing]
        values = connected_empty(local_shape, extended, extended)
        indices = torch.zeros(local_shape, dtype=torch.int64, device=extended.device)
    else:
        result = local_op(extended, local_shape, out_ranges)
        values, indices = result if with_indices else (result, None)
    if list(values.shape) != local_shape:
        raise RuntimeError(
            f"shardsci internal error: local pooling gave {tuple(values.shape)}, expected "
            f"{tuple(local_shape)}"
        )
    out = from_local_spec(values, output_spec(spec, out_shape, out_sizes, values.dtype))
    if not with_indices:
        return out
    starts = _starts(windows, out_ranges, range(x.ndim - n, x.ndim))
    flat = _ravel(
        [c + start for c, start in zip(_unravel(indices, extended.shape[-n:]), starts)],
        x.shape[-n:],
    )
    return out, from_local_spec(flat, output_spec(spec, out_shape, out_sizes, flat.dtype))


def _whole_windows(
    extended: torch.Tensor,
    windows: dict[int, Window],
    out_ranges: dict[int, tuple[int, int]],
    fill: float,
) -> torch.Tensor:
    """Pad the gathered cells with ``fill`` where a ceil-mode window runs past the padded
    input, so that every local window is whole."""
    for dim, window in windows.items():
        first, stop = out_ranges[dim]
        if stop > first:
            missing = (stop - first - 1) * window.stride + window.span - extended.shape[dim]
            if missing > 0:
                extended = pad_locally(extended, dim, 0, missing, fill)
    return extended


def _starts(
    windows: dict[int, Window], out_ranges: dict[int, tuple[int, int]], dims: range
) -> list[int]:
    """The global cell the gathered block starts at along each of ``dims`` (negative in the
    left padding); dims without a window are whole."""
    return [
        out_ranges[d][0] * windows[d].stride - windows[d].pad_left if d in windows else 0
        for d in dims
    ]


def _unravel(flat: torch.Tensor, extents: torch.Size) -> list[torch.Tensor]:
    """Flat indices over ``extents`` -> one coordinate tensor per dim."""
    coordinates = []
    for extent in reversed(extents):
        coordinates.append(flat % extent)
        flat = flat // extent
    return coordinates[::-1]


def _ravel(coordinates: list[torch.Tensor], extents: torch.Size) -> torch.Tensor:
    flat = torch.zeros_like(coordinates[0])
    for c, extent in zip(coordinates, extents):
        flat = flat * extent + c
    return flat
