"""Interpolation (``F.interpolate``, ``nn.Upsample``) on spatially sharded tensors.

Every mode without antialiasing is separable: along each spatial dim, output ``i`` is a
weighted sum of a few input cells, ``out[i] = sum_k weight[i, k] * in[index[i, k]]``. The taps
are computed as ATen's CPU forward kernels compute them (``ATen/native/UpSample.h``), in the
input's opmath type, with ``scale`` = ``1 / scale_factor`` when a scale factor reaches the
kernel (``recompute_scale_factor`` not set) and ``n_in / n_out`` otherwise:
- ``nearest``, ``nearest-exact``: one cell, ``floorf`` of a source coordinate (``_nearest``:
  the 2-D kernels use other rules than the 1-D and 3-D ones);
- ``linear`` (``bilinear``, ``trilinear``): source ``scale (i + 0.5) - 0.5`` clamped at 0, or
  ``(n_in - 1) / (n_out - 1) i`` with ``align_corners``; two neighbours; equal sizes copy;
- ``bicubic``: the same source unclamped, four neighbours weighted by the cubic convolution
  with A = -0.75, their indices clamped into the domain;
- ``area``: adaptive average pooling, the mean of cells ``[floor(i n_in / n_out),
  ceil((i + 1) n_in / n_out))``.
Every index lies inside the domain, so no cell beyond the boundary is ever read. The backward
is autograd's, the exact adjoint of the forward. Torch's CPU backward kernels are not, in
corner cases of bicubic and of 1-D and 3-D nearest (an output as long as its input at a scale
factor other than 1, or twice as long at one other than 2: the backward copies where the
forward interpolates).

Each spatial dim is a window for ``_windows`` (NOTE [Which rank owns an output of a windowed
op]): output ``i`` goes to the rank holding the input cell it is centred on (the cell nearest
its source coordinate, clamped into the domain; the middle of its range for ``area``), unless
the input's hints remember a layout of the output's extent. Each rank gathers the cells its
outputs read with the halo exchange, then applies the taps to them, one dim after another,
with differentiable ``index_select`` and weighted sums.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardsci.tensor._api import from_local_spec
from shardsci.tensor._binding import bind
from shardsci.tensor._caches import cached
from shardsci.tensor._ops._common import accepts
from shardsci.tensor._ops._windows import gather_windows, output_spec
from shardsci.tensor._registry import register_function_handler
from shardsci.tensor._shape_probe import shape_probe
from shardsci.tensor._torch_compile import graph_constant, on_the_host

_MODES = ("nearest", "nearest-exact", "linear", "bilinear", "trilinear", "bicubic", "area")
_SELECTING = ("nearest", "nearest-exact")  # also defined for integer tensors
_NDIM = {"linear": 3, "bilinear": 4, "bicubic": 4, "trilinear": 5}


@dataclass(frozen=True, eq=False)
class Resample:
    """One dim of an interpolation, as a window for ``gather_windows``.

    Attributes
    ----------
    index : Tensor
        ``(M, K)`` int64: the input cells output ``i`` reads, non-decreasing along both axes.
    weight : Tensor or None
        ``(M, K)``: their weights, in the opmath type; None for a plain selection (``K = 1``).
    centres : tuple of int
        The input cell output ``i`` is centred on (non-decreasing): who owns it.
    identity : bool
        Output ``i`` is input ``i``: the dim needs no work.
    lows, highs : tuple of int
        The first and last input cell output ``i`` reads (non-decreasing).
    """

    index: torch.Tensor
    weight: torch.Tensor | None
    centres: tuple[int, ...]
    identity: bool
    lows: tuple[int, ...]
    highs: tuple[int, ...]

    def output_extent(self, extent: int) -> int:
        return len(self.centres)

    def first_owned(self, position: int) -> int:
        """The first output centred on input ``position`` or later."""
        return bisect_left(self.centres, position)

    def input_range(self, first: int, stop: int, extent: int) -> tuple[int, int]:
        """Input cells read by outputs ``[first, stop)`` (indices are monotone in outputs)."""
        if stop <= first:
            return (0, 0)
        return self.lows[first], self.highs[stop - 1] + 1

    def apply(self, local: torch.Tensor, dim: int, first: int, stop: int) -> torch.Tensor:
        """Outputs ``[first, stop)`` from ``local``, which holds ``input_range(first, stop)``."""
        lo = self.input_range(first, stop, 0)[0]
        index = (graph_constant(self.index, local)[first:stop] - lo).to(local.device)
        taps = index.shape[1]
        gathered = local.index_select(dim, index.reshape(-1))
        if self.weight is None:
            return gathered
        weight = graph_constant(self.weight, local)[first:stop]
        weight = weight.to(device=local.device, dtype=local.dtype)
        weight = weight.reshape(*weight.shape, *([1] * (local.ndim - dim - 1)))
        return (gathered.unflatten(dim, (stop - first, taps)) * weight).sum(dim + 1)


# ---------------------------------------------------------------------------- taps
def _scalar(value: float | int, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype)


def _scale(n_in: int, n_out: int, scale: float | None, dtype: torch.dtype) -> torch.Tensor:
    """ATen's ``compute_scales_value``: ``1 / scale_factor`` when given, else ``n_in / n_out``."""
    if scale is not None and scale > 0:
        return _scalar(1.0 / scale, dtype)
    return _scalar(n_in, dtype) / n_out


def _area_pixel_scale(
    n_in: int, n_out: int, align_corners: bool, scale: float | None, dtype: torch.dtype
) -> torch.Tensor:
    """ATen's ``area_pixel_compute_scale``."""
    if align_corners:
        return _scalar(n_in - 1, dtype) / (n_out - 1) if n_out > 1 else _scalar(0, dtype)
    return _scale(n_in, n_out, scale, dtype)


def _source(ratio: torch.Tensor, n_out: int, align_corners: bool) -> torch.Tensor:
    """ATen's ``area_pixel_compute_source_index`` before clamping, for every output."""
    i = torch.arange(n_out, dtype=ratio.dtype)
    return ratio * i if align_corners else ratio * (i + 0.5) - 0.5


def _floor_index(real: torch.Tensor, n_in: int) -> torch.Tensor:
    """``min(floorf(real), n_in - 1)``: ATen floors in float32 whatever the opmath type."""
    return real.to(torch.float32).floor().to(torch.int64).clamp_max(n_in - 1)


def _centres(real: torch.Tensor, n_in: int) -> torch.Tensor:
    return (real + 0.5).floor().to(torch.int64).clamp(0, n_in - 1)


def _nearest(
    n_in: int, n_out: int, scale: float | None, exact: bool, dtype: torch.dtype, legacy: bool
) -> torch.Tensor:
    """The input cell each output copies, at most ``n_in - 1``.

    ATen's generic kernels (1-D, 3-D) compute ``floorf(scale i)``, or for ``nearest-exact``
    ``floorf(max(scale (i + 0.5) - 0.5, 0) + 0.5)``, in the opmath type; its 2-D kernels
    (``legacy``) use ``nearest_idx``: a float32 scale, ``floorf(i scale)`` (copy for equal
    sizes, ``i // 2`` for doubled ones) or ``floorf((i + 0.5) scale)``.
    """
    i = torch.arange(n_out)
    if not legacy:
        ratio = _scale(n_in, n_out, scale, dtype)
        if exact:
            return _floor_index(_source(ratio, n_out, False).clamp_min(0) + 0.5, n_in)
        return _floor_index(_source(ratio, n_out, True), n_in)
    ratio = _scale(n_in, n_out, scale, torch.float32)
    if exact:
        return _floor_index((i.double() + 0.5) * ratio.double(), n_in)
    if n_out == n_in:
        return i
    if n_out == 2 * n_in:
        return i // 2
    return _floor_index(i.float() * ratio, n_in)


def _linear(
    n_in: int, n_out: int, scale: float | None, align_corners: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if n_out == n_in:
        i = torch.arange(n_out)
        return i[:, None], torch.ones(n_out, 1, dtype=dtype), i
    real = _source(
        _area_pixel_scale(n_in, n_out, align_corners, scale, dtype), n_out, align_corners
    )
    real = real.clamp_min(0)
    first = _floor_index(real, n_in)
    lam = (real - first).clamp(0, 1)
    index = torch.stack([first, (first + 1).clamp_max(n_in - 1)], 1)
    return index, torch.stack([1 - lam, lam], 1), _centres(real, n_in)


def _cubic(
    n_in: int, n_out: int, scale: float | None, align_corners: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    real = _source(
        _area_pixel_scale(n_in, n_out, align_corners, scale, dtype), n_out, align_corners
    )
    first = _floor_index(real, n_in)
    t = (real - first).clamp(0, 1)
    a = -0.75

    def near(x: torch.Tensor) -> torch.Tensor:
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x: torch.Tensor) -> torch.Tensor:
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    weight = torch.stack([far(t + 1), near(t), near(1 - t), far(2 - t)], 1)
    index = torch.stack([(first - 1 + k).clamp(0, n_in - 1) for k in range(4)], 1)
    return index, weight, _centres(real, n_in)


def _area(
    n_in: int, n_out: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Adaptive average pooling's ranges, padded to one width with zero-weight taps."""
    i = torch.arange(n_out)
    starts = (i * n_in) // n_out
    stops = -((-(i + 1) * n_in) // n_out)
    width = int((stops - starts).max()) if n_out else 1
    taps = starts[:, None] + torch.arange(width)
    inside = taps < stops[:, None]
    index = torch.minimum(taps, stops[:, None] - 1)
    weight = inside / (stops - starts)[:, None].to(dtype)
    return index, weight.to(dtype), (starts + stops - 1) // 2


@cached("interpolation taps", 1024)
def resample(
    mode: str,
    n_in: int,
    n_out: int,
    scale: float | None,
    align_corners: bool,
    dtype: torch.dtype,
    spatial: int,
) -> Resample:
    """The taps of one dim of ``F.interpolate(mode=...)`` from ``n_in`` to ``n_out`` cells.

    ``scale`` is the scale factor the kernel receives (None when recomputed from the sizes);
    ``dtype`` the opmath type of the input; ``spatial`` the number of spatial dims.
    Computed on real tensors, also while torch.compile traces (``on_the_host``).
    """
    with on_the_host():
        return _resample(mode, n_in, n_out, scale, align_corners, dtype, spatial)


def _resample(mode, n_in, n_out, scale, align_corners, dtype, spatial) -> Resample:
    if mode in _SELECTING:
        index = _nearest(n_in, n_out, scale, mode == "nearest-exact", dtype, spatial == 2)
        index, weight, centres = index[:, None], torch.ones(n_out, 1, dtype=dtype), index
    elif mode == "bicubic":
        index, weight, centres = _cubic(n_in, n_out, scale, align_corners, dtype)
    elif mode == "area":
        index, weight, centres = _area(n_in, n_out, dtype)
    else:
        index, weight, centres = _linear(n_in, n_out, scale, align_corners, dtype)
    on_row = index == torch.arange(n_out)[:, None]
    identity = (
        n_out == n_in
        and bool((weight * on_row).sum(1).eq(1).all())
        and bool((weight * ~on_row).eq(0).all())
    )
    plain = index.shape[1] == 1 and bool(weight.eq(1).all())
    return Resample(
        index,
        None if plain else weight,
        tuple(centres.tolist()),
        identity,
        tuple(index[:, 0].tolist()),
        tuple(index[:, -1].tolist()),
    )


# ---------------------------------------------------------------------------- handler
@register_function_handler(F.interpolate)
def _interpolate(func, args, kwargs):
    a = bind(func, args, kwargs)
    x, size, scale_factor, mode = a.input, a.size, a.scale_factor, a.mode
    align_corners, recompute, antialias = a.align_corners, a.recompute_scale_factor, a.antialias
    # Only the selecting modes take integers; torch's kernels raise their own error for others.
    if not accepts(x, floating=mode not in _SELECTING):
        return NotImplemented
    shape = _output_shape(func, x, size, scale_factor, mode, align_corners, recompute, antialias)
    spatial = range(2, x.ndim)
    scales = _kernel_scales(scale_factor, recompute, mode, len(spatial))
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    windows = {}
    for dim, scale in zip(spatial, scales):
        window = resample(
            mode, x.shape[dim], shape[dim], scale, bool(align_corners), dtype, len(spatial)
        )
        if not window.identity:
            windows[dim] = window
    spec = x._spec
    local, out_sizes, out_ranges = gather_windows(
        x.to_local(), spec, windows, dict.fromkeys(windows, "zeros")
    )
    if _kernel_reads_alike(mode, windows, local.shape, out_ranges, scales, dtype):
        local = func(local, None, scale_factor, mode, align_corners, recompute, antialias)
    else:
        for dim, window in windows.items():
            local = window.apply(local, dim, *out_ranges[dim])
    if not windows:
        local = local.clone()
    return from_local_spec(local, output_spec(spec, shape, out_sizes, local.dtype))


def _kernel_reads_alike(mode, windows, local_shape, out_ranges, scales, dtype) -> bool:
    """Whether torch's own kernel, run on the gathered cells with the same scale factors,
    selects for this rank's outputs the cells the global interpolation does (nearest modes
    given a scale factor; e.g. 2x upsampling of shards at even offsets): then it runs, forward
    and backward, instead of the index gathers."""
    if mode not in _SELECTING or not windows or any(s is None for s in scales):
        return False
    if 0 in local_shape:  # NOTE [A rank with an empty shard computes nothing]
        return False
    spatial = len(local_shape) - 2
    return all(
        _local_selection_matches(
            mode, window, local_shape[dim], *out_ranges[dim], scales[dim - 2], dtype, spatial
        )
        for dim, window in windows.items()
    )


@cached("local resampling checks", 1024)
def _local_selection_matches(
    mode: str,
    window: Resample,
    n_local: int,
    first: int,
    stop: int,
    scale: float,
    dtype: torch.dtype,
    spatial: int,
) -> bool:
    if stop <= first or int(n_local * scale) != stop - first:
        return False
    lo = window.input_range(first, stop, 0)[0]
    local = resample(mode, n_local, stop - first, scale, False, dtype, spatial)
    with on_the_host():
        return torch.equal(local.index, window.index[first:stop] - lo)


def _output_shape(func, x, size, scale_factor, mode, align_corners, recompute, antialias):
    """The global output shape, with torch's own errors for bad arguments, on every rank
    before any communication. Probed on a meta tensor with a mode whose meta kernel is cheap
    (those of the linear and cubic modes are Python decompositions, milliseconds per call);
    every mode shares the size rules. The batch and channel dims of the probe are at least 1:
    torch's meta kernels reject empty ones (its real kernels accept them), and the output
    keeps them as they are."""
    leading = x.shape[:2]
    with on_the_host(), shape_probe():
        probe = torch.empty(
            (*(max(n, 1) for n in leading), *x.shape[2:]), dtype=x.dtype, device="meta"
        )
        shape = _probed_shape(
            func, probe, size, scale_factor, mode, align_corners, recompute, antialias
        )
    return torch.Size((*leading, *shape[2:]))


def _probed_shape(func, probe, size, scale_factor, mode, align_corners, recompute, antialias):
    if antialias or mode not in _MODES or _NDIM.get(mode, probe.ndim) != probe.ndim:
        func(probe, size, scale_factor, mode, align_corners, recompute, antialias)
        raise NotImplementedError(
            f"F.interpolate(mode={mode!r}, antialias={antialias}) is not supported on a "
            f"sharded ShardTensor; supported modes: {', '.join(_MODES)}, without antialias"
        )
    if mode in ("area", *_SELECTING):
        cheap = "area" if mode == "area" else "nearest-exact"
        return func(probe, size, scale_factor, cheap, align_corners, recompute).shape
    return func(probe, size, scale_factor, "nearest-exact", None, recompute).shape


def _kernel_scales(
    scale_factor: float | tuple[float, ...] | None, recompute: bool | None, mode: str, n: int
) -> tuple[float | None, ...]:
    """The scale factors ``F.interpolate`` hands to the kernel: none when they are recomputed
    from the output size (always for ``area``)."""
    if scale_factor is None or recompute or mode == "area":
        return (None,) * n
    if isinstance(scale_factor, (tuple, list)):
        return tuple(float(s) for s in scale_factor)
    return (float(scale_factor),) * n
