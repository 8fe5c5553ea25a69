"""Convolutions, transposed convolutions and padding on spatially sharded tensors.

Each rank gathers the input cells its outputs read (``_windows``: NOTE [Which rank owns an
output of a windowed op]) and runs the op on them without padding. ``nn.ConvNd`` with
``padding_mode`` circular / reflect / replicate pads with ``F.pad`` first, which is a window
of size 1 whose padding cells come from the boundary (periodic, reflect, replicate), so the
padded tensor keeps the input's layout with the padding on the edge ranks, and the
convolution that follows keeps it too; the pad gathers the cells that convolution reads in the
same exchange (NOTE [A padded tensor carries the halo its convolution reads] in ``_windows``).
A pad by negative amounts crops: a slice of the cropped dims (placements kept), then the pad
by the positive amounts, in every mode where torch's result is that composition
(``_pad_ops.crop_then_pad``).
Weights and biases are replicated: their gradients are summed over the shards
(``replicated_local``). Sharded input channels are made whole first (each output cell reads
all of them), the spatial shardings kept: the output is replicated over the axes that sharded
the channels, not over every axis.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from shardsci.tensor._api import ShardTensor, from_local_spec
from shardsci.tensor._binding import bind
from shardsci.tensor._ops._common import (
    accepts,
    connected_empty,
    cut_to,
    no_empty_shard,
    padded_to,
    replicated_local,
    sharding_axes,
    unsplit,
    with_dims_whole,
)
from shardsci.tensor._ops._pad_ops import crop_then_pad, cropped, pad_windows
from shardsci.tensor._ops._windows import (
    TransposedWindow,
    Window,
    gather_windows,
    gather_windows_of,
    output_spec,
    overlapped_windows,
    pad_with_halo,
)
from shardsci.tensor._options import halo_overlap_enabled
from shardsci.tensor._registry import register_function_handler
from shardsci.tensor._shape_probe import probe_on_meta
from shardsci.tensor._torch_compat import nn_pad

_CONV = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3}
_CONV_TRANSPOSE = {F.conv_transpose1d: 1, F.conv_transpose2d: 2, F.conv_transpose3d: 3}
_PAD_MODES = {
    "constant": "zeros",
    "circular": "periodic",
    "reflect": "reflect",
    "replicate": "replicate",
}


def _tuple(value: int | tuple[int, ...] | list[int], n: int) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * n


def _convolution(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """The parameters of ``F.conv1d/2d/3d`` (builtins with two aten schemas: int and string
    padding)."""


def _pending(bias: torch.Tensor | None) -> bool:
    return isinstance(bias, ShardTensor) and bias._spec.partial


def _whole(bias: torch.Tensor | None) -> torch.Tensor | None:
    """A bias sharded over its channels, made whole (``C_out`` numbers, not a field), so that
    the output keeps the input's layout; declined, it would be computed whole on every rank."""
    if isinstance(bias, ShardTensor) and bias._spec.shardings:
        return with_dims_whole(bias, {0})
    return bias


def _channels_whole(x: ShardTensor, n: int) -> ShardTensor:
    """``x`` with its input channels (dim 1, or 0 unbatched) made whole, its other shardings
    kept: every output cell reads every input channel, so channel shards would leave each
    rank a partial sum. The axes that sharded the channels replicate the output; declined,
    the default path would replicate every dim."""
    return with_dims_whole(x, {x.ndim - n - 1})


# ---------------------------------------------------------------------------- conv
# The input's channels are dim 1, or dim 0 unbatched: dim -(n + 1) of an n-d convolution.
@register_function_handler(*_CONV)
def _conv(func, args, kwargs):
    a = bind(func, args, kwargs, signature=_convolution)
    x, weight, bias, stride = a.input, a.weight, a.bias, a.stride
    padding, dilation, groups = a.padding, a.dilation, a.groups
    n = _CONV[func]
    if not accepts(x, replicated=[weight]) or _pending(bias) or x.ndim not in (n + 1, n + 2):
        return NotImplemented
    x, bias = _channels_whole(x, n), _whole(bias)
    if x.ndim == n + 1:  # unbatched (C, *spatial)
        return func(x.unsqueeze(0), weight, bias, stride, padding, dilation, groups).squeeze(0)
    first = x.ndim - n
    if unsplit(x._spec, range(first, x.ndim)):
        spec = x._spec
        axes = sharding_axes(spec)
        w = replicated_local(weight, spec.mesh, axes)
        b = replicated_local(bias, spec.mesh, axes)
        out = func(x.to_local(), w, b, stride, padding, dilation, groups)
        return _wrapped_whole(x, out, range(1, x.ndim))
    kernel = weight.shape[2:]
    stride, dilation = _tuple(stride, n), _tuple(dilation, n)
    pads = _conv_padding(padding, kernel, dilation, n)
    windows = {first + i: Window(kernel[i], stride[i], dilation[i], *pads[i]) for i in range(n)}
    return _run_windowed(
        x, windows, dict.fromkeys(windows, "zeros"), weight, bias,
        lambda ext, w, b: func(ext, w, b, stride, 0, dilation, groups),
        channels=weight.shape[0],
    )  # fmt: skip


# NOTE [A windowed op on unsplit dims is the local op]
# When no windowed dim is split between ranks (unsharded, or sharded over mesh axes of size 1:
# a one-rank mesh), every rank holds all cells its outputs read: no halo, no exchange. The
# handler then runs torch's op on the local shard as it is, with the op's own padding, and
# wraps the result in the input's layout (those dims' one shard sized to the output), instead
# of planning windows and extending the shard in Python. The other dims (a sharded batch) and
# the parameters' gradients (``replicated_local``) are handled as on the windowed path. The
# same holds for a norm whose rows no rank splits (torch's group or layer norm on the shard,
# ``_norm_ops``) and attention whose sequence no rank splits (no ring or gather planned,
# ``_attention_ops``). A pad takes this path only when no shard is empty: torch's pad kernels
# refuse empty dims other than the batch.
def _wrapped_whole(x: ShardTensor, out: torch.Tensor, dims: Iterable[int]) -> ShardTensor:
    """``out``, the local op's result on the shard of ``x``, in the layout of ``x`` with the
    global extents of ``dims`` (each whole on this rank) taken from ``out``."""
    spec = x._spec
    shape = list(x.shape)
    for d in dims:
        shape[d] = out.shape[d]
    sizes = {d: (shape[d],) for d in dims if d in spec.sharding_by_dim}
    return from_local_spec(out, output_spec(spec, shape, sizes, out.dtype))


def _conv_padding(
    padding: int | tuple | str, kernel: tuple[int, ...], dilation: tuple[int, ...], n: int
) -> list[tuple[int, int]]:
    if padding == "valid":
        return [(0, 0)] * n
    if padding == "same":
        totals = [d * (k - 1) for k, d in zip(kernel, dilation)]
        return [(t // 2, t - t // 2) for t in totals]
    return [(p, p) for p in _tuple(padding, n)]


def _run_windowed(x, windows, boundary, weight, bias, local_op, *, channels, fill=0.0):
    """Gather each rank's windows, run ``local_op(extended, weight, bias)``, wrap the result
    with ``channels`` output channels (dim 1)."""
    spec = x._spec
    axes = sharding_axes(spec)
    w = replicated_local(weight, spec.mesh, axes)
    b = replicated_local(bias, spec.mesh, axes)
    sharded = [d for d in windows if d in spec.sharding_by_dim]
    if halo_overlap_enabled() and len(sharded) == 1:
        out, out_sizes, out_ranges = overlapped_windows(
            x.to_local(),
            spec,
            windows,
            boundary,
            sharded[0],
            lambda t: local_op(t, w, b),
            channels,
            (w, b),
            fill,
        )
        local_shape = list(out.shape)
    else:
        extended, out_sizes, out_ranges = gather_windows_of(x, windows, boundary, fill)
        local_shape = list(extended.shape)
        local_shape[1] = channels
        for dim, (first, stop) in out_ranges.items():
            local_shape[dim] = stop - first
        empty = [d for d in out_ranges if local_shape[d] == 0]
        if empty and _builds_graph_through(extended, w, b):
            out = _empty_by_probe(extended, w, b, local_op, {d: windows[d] for d in empty})
        elif empty:
            out = connected_empty(local_shape, extended, extended, w, b)
        else:
            out = local_op(extended, w, b)
    if list(out.shape) != local_shape:
        raise RuntimeError(
            f"shardsci internal error: local window op gave {tuple(out.shape)}, expected "
            f"{tuple(local_shape)}"
        )
    shape = list(x.shape)
    shape[1] = channels
    for dim, window in windows.items():
        shape[dim] = window.output_extent(x.shape[dim])
    return from_local_spec(out, output_spec(spec, shape, out_sizes, out.dtype))


# NOTE [An empty shard's convolution in a graph]
# A rank whose convolution output is empty (NOTE [A rank with an empty shard computes
# nothing]) must leave the same autograd graph as the other ranks, or a second derivative
# (``create_graph=True``, NOTE [Second derivatives through ShardTensors] in ``_api.py``)
# issues different collectives on the ranks and aborts or hangs them: ``connected_empty``'s
# zeros have gradients that depend on nothing (the empty rank's derivative in x did not require
# grad, the other rank's did), and making them depend on every input sends a bias's gradient
# through a mesh sum that the other ranks, whose input gradient does not depend on the bias,
# never issue (the ranks reduced the bias and the weight in different orders: gloo aborted).
# So where autograd records the op, the empty rank runs the convolution itself on its window
# padded with zeros to one output per empty dim, and keeps none of it: each gradient then
# depends on what the other ranks' does (the input's on the weight, the weight's on the
# input, the bias's on neither), all zeros, and the collectives match. A transposed
# convolution does the same on its input padded to one cell per empty dim, its output's
# zeros connected through the sum of that empty result (``_run_transposed``).
def _builds_graph_through(*inputs: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)


def _empty_by_probe(extended, w, b, local_op, windows):
    """``local_op(extended, w, b)`` where the windows of ``windows``' dims hold no output:
    run on ``extended`` padded with zeros to one output each, then cut to none (NOTE above)."""
    probe = padded_to(extended, {dim: window.span for dim, window in windows.items()})
    return cut_to(local_op(probe, w, b), dict.fromkeys(windows, 0))


# ---------------------------------------------------------------------------- conv_transpose
@register_function_handler(*_CONV_TRANSPOSE)
def _conv_transpose(func, args, kwargs):
    a = bind(func, args, kwargs)
    x, weight, bias, stride, padding = a.input, a.weight, a.bias, a.stride, a.padding
    output_padding, groups, dilation = a.output_padding, a.groups, a.dilation
    n = _CONV_TRANSPOSE[func]
    if not accepts(x, replicated=[weight]) or _pending(bias) or x.ndim not in (n + 1, n + 2):
        return NotImplemented
    x, bias = _channels_whole(x, n), _whole(bias)
    if x.ndim == n + 1:  # unbatched (C, *spatial)
        out = func(x.unsqueeze(0), weight, bias, stride, padding, output_padding, groups, dilation)
        return out.squeeze(0)
    kernel = weight.shape[2:]
    stride, padding = _tuple(stride, n), _tuple(padding, n)
    dilation, output_padding = _tuple(dilation, n), _tuple(output_padding, n)
    first = x.ndim - n
    windows = {
        first + i: TransposedWindow(
            kernel[i], stride[i], dilation[i], padding[i], output_padding[i]
        )
        for i in range(n)
    }
    channels = weight.shape[1] * groups
    return _run_transposed(x, windows, weight, bias, func, stride, dilation, groups, channels)


def _run_transposed(x, windows, weight, bias, func, stride, dilation, groups, channels):
    spec = x._spec
    axes = sharding_axes(spec)
    extended, out_sizes, out_ranges = gather_windows(
        x.to_local(), spec, windows, dict.fromkeys(windows, "zeros")
    )
    w = replicated_local(weight, spec.mesh, axes)
    b = replicated_local(bias, spec.mesh, axes)
    local_shape = [
        extended.shape[0],
        channels,
        *(stop - first for first, stop in out_ranges.values()),
    ]
    empty = [d for d in windows if extended.shape[d] == 0]
    if empty and _builds_graph_through(extended, w, b):
        padded = padded_to(extended, dict.fromkeys(empty, 1))
        probe = cut_to(
            func(padded, w, None, stride, 0, 0, groups, dilation), dict.fromkeys(empty, 0)
        )
        # NOTE [An empty shard's convolution in a graph]
        out = extended.new_zeros(local_shape) + probe.sum()
    elif empty:
        out = connected_empty(local_shape, extended, extended, w)
    else:
        full = func(extended, w, None, stride, 0, 0, groups, dilation)
        out = _placed(full, windows, out_ranges, spec)
    if b is not None:
        out = out + b.reshape(-1, *([1] * len(windows)))
    shape = [x.shape[0], channels, *(w_.output_extent(x.shape[d]) for d, w_ in windows.items())]
    return from_local_spec(out, output_spec(spec, shape, out_sizes, out.dtype))


def _placed(full, windows, out_ranges, spec):
    """Cut (or zero-pad) the transposed convolution of the gathered inputs to this rank's
    outputs: the gathered inputs ``[lo, hi)`` produce outputs from ``lo * stride - padding``."""
    out = full
    for dim, window in windows.items():
        first, stop = out_ranges[dim]
        lo, _ = window.input_range(first, stop, spec.shape[dim])
        begin = first - (lo * window.stride - window.padding)
        available = out.shape[dim]
        head = max(0, -begin)
        take = max(0, min(stop - first - head, available - max(begin, 0)))
        piece = out.narrow(dim, max(begin, 0), take)
        tail = stop - first - head - take
        if head or tail:
            piece = F.pad(piece.movedim(dim, -1), (head, tail)).movedim(-1, dim)
        out = piece
    return out


# ---------------------------------------------------------------------------- pad
@register_function_handler(F.pad)
def _pad(func, args, kwargs):
    a = bind(func, args, kwargs)
    x, mode, value = a.input, a.mode, a.value
    if not accepts(x) or mode not in _PAD_MODES:
        return NotImplemented
    # torch's error for a bad pad list, on every rank before any collective
    probe_on_meta(func, (x, a.pad, mode, value))
    plan = crop_then_pad(mode, a.pad, x.shape)
    if plan is None:
        return NotImplemented
    x = cropped(x, plan)
    windows = pad_windows(plan, x.ndim)
    if not windows:
        return x.clone()  # torch's pad returns a new tensor, never its input or a view
    if unsplit(x._spec, windows) and no_empty_shard(x._spec):
        pads = []  # as long as the user's list: torch's non-constant modes check its length
        for d in range(x.ndim - 1, x.ndim - 1 - len(a.pad) // 2, -1):
            w = windows.get(d)
            pads += [w.pad_left, w.pad_right] if w is not None else [0, 0]
        return _wrapped_whole(x, func(x.to_local(), pads, mode, value), windows)
    boundary = dict.fromkeys(windows, _PAD_MODES[mode])
    spec = x._spec
    shape = list(x.shape)
    for dim, window in windows.items():
        shape[dim] = window.output_extent(x.shape[dim])
    sharded = any(d in spec.sharding_by_dim for d in windows)
    if mode == "constant" or not sharded or halo_overlap_enabled():
        extended, out_sizes, _ = gather_windows(x.to_local(), spec, windows, boundary, value or 0.0)
        return from_local_spec(extended, output_spec(spec, shape, out_sizes, extended.dtype))
    return pad_with_halo(x, windows, boundary, shape)


@register_function_handler(nn_pad)
def _pad_as_dynamo_calls_it(func, args, kwargs):
    """Dynamo's graphs call ``F.pad`` by its C name (NOTE [torch.compile and ShardTensor])."""
    return _pad(F.pad, args, kwargs)
