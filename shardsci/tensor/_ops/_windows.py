"""Sliding-window ops along sharded dims: who owns which output, which input it needs.

# NOTE [Outputs keep their input's layout]
An op or module whose output has its input's spatial dims returns the input's placements and
shard sizes, unless the user redistributes: pointwise ops, 'same' convolutions and pads
(``_conv_ops``; a crop by negative pads is a slice), views that flatten and unflatten again
(``_view_ops``: an unflatten returns to the layout remembered before the flatten), products
whose operands remember different layouts (the dispatch fast path merges their memory,
NOTE [Shard-size hints] in ``_spec``), FFT round trips (``_fft_ops``). A resampling op (pixel
shuffle and unshuffle, interpolation, a strided or transposed convolution, pooling of any
dtype torch pools) keeps the placements, with the sizes that the window rule below gives.
Where an operand other than the field is sharded (a bias over its channels), that operand is
made whole, a few numbers, never the field. Ops no handler takes follow DTensor's rules
(``_propagation``), which may still replicate.
Checked by ``tests/test_layouts_kept.py``, ``tests/test_layout_memory.py`` and every op test
that states ``out_layouts`` (NOTE [An output's layout is stated] in
``shardsci/testing/_reference.py``).

# NOTE [Which rank owns an output of a windowed op]
Output ``j`` of a window with kernel ``k``, stride ``s``, dilation ``d`` and left padding
``p`` reads input cells ``j s - p + m d`` for ``m < k``. It is owned by the rank whose input
range holds the window's anchor, ``j s - p + (d (k - 1)) // 2`` (the centre, rounded down),
clamped into the domain; empty shards own nothing. So a 'same' convolution keeps the input's
layout, and a stride-2 conv or pool gives output ``j`` to the owner of input ``2 j``. For
transposed windows (upsampling) output ``i`` goes to the owner of the input it is centred on,
``(i + p - (d (k - 1)) // 2) // s``, so downsample -> upsample returns to the input's layout
when shard boundaries are even. An output whose window is centred beyond the domain may read
no cell near the clamped centre (a dilated or strided window reaching past the edge reads
only its cells inside): an output that reads one shard's cells alone is on that shard, as
it needs nothing else (NOTE [An output cell belongs to the shard it depends on] in
``tests/expected_layouts.py``), and every other output's centre owner is held between the
last such shard before it and the first after it, so that the shards stay in rank order
(``_with_single_readers``; where those shards decrease along the dim no split can keep them
all, and the centres' rule stands). Where the clamped centre lies between the first and
last cells an output reads (any window inside the domain, a 'same' convolution), this
changes nothing. When a layout of the output's extent is remembered in the input's hints
(the layout before the downsampling), it is used instead, whatever the boundaries. Not by a pad that crops the dim's other side (``F.pad(x, (-1, 1))``, ``Window.
shifted``): it moves every cell by the crop, so the layout remembered for that extent, the
one before the crop, would put each shard boundary's cell on its owner's neighbour; each
cell stays with its owner and the padding goes to the edge shards. A dim left with no cell
(cropped away, then padded) has its padding on the first shard. Each rank then gathers,
with the halo exchange, the input cells its outputs read, and runs the op locally without
padding: padding cells are materialised by the boundary.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardsci.tensor._api import ShardTensor, from_local_spec, grad_spec, gradient_shard
from shardsci.tensor._box_packing import narrowed
from shardsci.tensor._caches import cached
from shardsci.tensor._halo import (
    Extension,
    extend,
    extended,
    extension,
    start_extend,
    summed_to_owners,
)
from shardsci.tensor._halo_plan import domain_range
from shardsci.tensor._ops._common import connected_empty
from shardsci.tensor._spec import DimSharding, ShardTensorSpec, merged_hints, mesh_coordinate
from shardsci.tensor._torch_compile import in_graph

__all__ = [
    "Halo",
    "Subdivide",
    "TransposedWindow",
    "Window",
    "gather_windows",
    "gather_windows_of",
    "output_spec",
    "overlapped_windows",
    "owned_sizes",
    "pad_with_halo",
    "window_plan",
]


@dataclass(frozen=True)
class Window:
    """One dim of a sliding-window op (convolution, pooling, padding).

    Attributes
    ----------
    kernel, stride, dilation : int
    pad_left, pad_right : int
        Padding before and after the input, materialised by the boundary.
    ceil_mode : bool
        Pooling's ceil mode: a last, partial window may run past the padded input.
    shifted : bool
        A pad of a dim it also crops on the other side: every cell moves by the crop, so a
        layout remembered for the output's extent describes other cells and is not taken.
    """

    kernel: int
    stride: int = 1
    dilation: int = 1
    pad_left: int = 0
    pad_right: int = 0
    ceil_mode: bool = False
    shifted: bool = False

    @property
    def span(self) -> int:
        return self.dilation * (self.kernel - 1) + 1

    def output_extent(self, extent: int) -> int:
        padded = extent + self.pad_left + self.pad_right
        if padded < self.span:
            return 0
        if not self.ceil_mode:
            return (padded - self.span) // self.stride + 1
        count = -(-(padded - self.span) // self.stride) + 1
        if (count - 1) * self.stride >= extent + self.pad_left:
            count -= 1
        return count

    def first_inside(self, position: int) -> int:
        """The first output whose window starts at or after input ``position``."""
        return -(-(position + self.pad_left) // self.stride)

    def last_inside(self, stop: int) -> int:
        """One past the last output whose window ends at or before input ``stop``."""
        reach = stop + self.pad_left - self.span
        return reach // self.stride + 1 if reach >= 0 else 0

    def first_owned(self, position: int) -> int:
        """The first output whose anchor is at or after input ``position``."""
        anchor_offset = (self.span - 1) // 2 - self.pad_left
        return -(-(position - anchor_offset) // self.stride)

    def reads(self, i: int, extent: int) -> tuple[int, int] | None:
        """The first and last domain cells output ``i`` reads; None if only padding."""
        start = i * self.stride - self.pad_left
        first = max(0, -(start // self.dilation))
        last = min(self.kernel - 1, (extent - 1 - start) // self.dilation)
        if first > last:
            return None
        return start + first * self.dilation, start + last * self.dilation

    def input_range(self, first: int, stop: int, extent: int) -> tuple[int, int]:
        """Input cells (global, padding included) read by outputs ``[first, stop)``."""
        if stop <= first:
            return (0, 0)
        lo = first * self.stride - self.pad_left
        hi = (stop - 1) * self.stride - self.pad_left + self.span
        return lo, min(hi, extent + self.pad_right)


@dataclass(frozen=True)
class TransposedWindow:
    """One dim of a transposed convolution (output cell ``i`` gathers inputs ``j`` with
    ``i + padding = j stride + m dilation``)."""

    kernel: int
    stride: int = 1
    dilation: int = 1
    padding: int = 0
    output_padding: int = 0

    @property
    def span(self) -> int:
        return self.dilation * (self.kernel - 1) + 1

    def output_extent(self, extent: int) -> int:
        return (extent - 1) * self.stride - 2 * self.padding + self.span + self.output_padding

    def first_owned(self, position: int) -> int:
        """The first output centred on input ``position`` or later."""
        return position * self.stride - self.padding + (self.span - 1) // 2

    def reads(self, i: int, extent: int) -> tuple[int, int] | None:
        """The first and last inputs output ``i`` gathers; None if none."""
        read = [
            j
            for m in range(self.kernel)
            for j, rest in [divmod(i + self.padding - m * self.dilation, self.stride)]
            if rest == 0 and 0 <= j < extent
        ]
        return (min(read), max(read)) if read else None

    def input_range(self, first: int, stop: int, extent: int) -> tuple[int, int]:
        """Inputs contributing to outputs ``[first, stop)``, clipped to the domain."""
        if stop <= first:
            return (0, 0)
        lo = -(-(first + self.padding - self.span + 1) // self.stride)
        hi = (stop - 1 + self.padding) // self.stride + 1
        return max(lo, 0), max(min(hi, extent), max(lo, 0))


@dataclass(frozen=True)
class Subdivide:
    """One dim of an op that splits each input cell into ``factor`` output cells: output ``i``
    is made from input ``i // factor`` alone (pixel shuffle's H and W, pixel unshuffle's
    channels). Each rank's outputs are its own cells' by default: no cell moves."""

    factor: int

    def output_extent(self, extent: int) -> int:
        return extent * self.factor

    def first_owned(self, position: int) -> int:
        return position * self.factor

    def reads(self, i: int, extent: int) -> tuple[int, int] | None:
        return i // self.factor, i // self.factor

    def input_range(self, first: int, stop: int, extent: int) -> tuple[int, int]:
        if stop <= first:
            return (0, 0)
        return first // self.factor, (stop - 1) // self.factor + 1


WindowLike = Window | TransposedWindow | Subdivide


def owned_sizes(
    window: WindowLike, sharding: DimSharding, out_extent: int, hints: Sequence[DimSharding]
) -> tuple[int, ...]:
    """Output shard sizes along one dim (NOTE [Which rank owns an output of a windowed op])."""
    if isinstance(window, Window) and window.shifted:
        hints = ()
    for hint in reversed(hints):
        if hint.axes == sharding.axes and hint.extent == out_extent:
            return hint.sizes
    if isinstance(window, (Window, TransposedWindow, Subdivide)):
        return _owned_sizes(window, sharding.sizes, out_extent)
    # an interpolation (``_interpolate_ops.Resample``): each output's centre is a cell it reads
    return _anchored_sizes(window, sharding.sizes, out_extent)


@cached("window owners", 4096)
def _owned_sizes(window: WindowLike, shards: tuple[int, ...], out_extent: int) -> tuple[int, ...]:
    return _with_single_readers(window, shards, _anchored_sizes(window, shards, out_extent))


def _anchored_sizes(window, shards: tuple[int, ...], out_extent: int) -> tuple[int, ...]:
    """Output shard sizes giving each output to the owner of its anchor."""
    offsets = [sum(shards[:k]) for k in range(len(shards))]
    # a dim with no cells (a pad of a dim cropped away): the first shard holds the padding
    nonempty = [k for k, size in enumerate(shards) if size] or [0]
    sizes = [0] * len(shards)
    for k in nonempty:
        first = 0 if k == nonempty[0] else window.first_owned(offsets[k])
        stop = out_extent if k == nonempty[-1] else window.first_owned(offsets[k] + shards[k])
        first, stop = min(max(first, 0), out_extent), min(max(stop, 0), out_extent)
        sizes[k] = max(stop - first, 0)
    return tuple(sizes)


def _with_single_readers(
    window: WindowLike, shards: tuple[int, ...], sizes: tuple[int, ...]
) -> tuple[int, ...]:
    """``sizes`` (the anchors' owners) with every output that reads one shard's cells alone
    on that shard (NOTE [Which rank owns an output of a windowed op]): each other output's
    anchor owner clamped between the last such shard before it and the first after it.
    Unchanged where those shards decrease along the dim (no split keeps them all)."""
    extent = sum(shards)
    bounds = [sum(shards[: k + 1]) for k in range(len(shards))]
    anchored = [k for k, n in enumerate(sizes) for _ in range(n)]
    single: list[int | None] = []
    for i in range(len(anchored)):
        read = window.reads(i, extent)
        owner = None
        if read is not None:
            lo, hi = (bisect_right(bounds, cell) for cell in read)
            owner = lo if lo == hi else None
        single.append(owner)
    known = [k for k in single if k is not None]
    if known != sorted(known) or all(k == a for k, a in zip(single, anchored) if k is not None):
        return sizes
    after: list[int | None] = [None] * len(single)
    for i in reversed(range(len(single) - 1)):
        after[i] = single[i + 1] if single[i + 1] is not None else after[i + 1]
    owners, before = [], None
    for i, anchor in enumerate(anchored):
        if single[i] is not None:
            before = single[i]
            owners.append(before)
            continue
        owner = anchor if before is None else max(anchor, before)
        owners.append(owner if after[i] is None else min(owner, after[i]))
    return tuple(owners.count(k) for k in range(len(shards)))


@cached("window plans", 4096)
def window_plan(
    spec: ShardTensorSpec,
    windows: tuple[tuple[int, WindowLike], ...],
    boundary: tuple[tuple[int, str], ...],
) -> tuple[Extension, dict[int, tuple[int, ...]], dict[int, tuple[int, int]]]:
    """The extension that gathers, along each windowed dim, the input cells this rank's
    outputs read; the output shard sizes of sharded dims; this rank's output ranges.

    Cached per layout and windows: nothing of it is recomputed per call.
    """
    bounds = dict(boundary)
    out_sizes: dict[int, tuple[int, ...]] = {}
    out_ranges: dict[int, tuple[int, int]] = {}
    requests = []
    for dim, window in windows:
        extent = spec.shape[dim]
        out_extent = window.output_extent(extent)
        sharding = spec.sharding_by_dim.get(dim)
        if sharding is None:
            requests.append((dim, (window.input_range(0, out_extent, extent),), bounds[dim]))
            out_ranges[dim] = (0, out_extent)
            continue
        sizes = owned_sizes(window, sharding, out_extent, spec.hints)
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        ranges = tuple(window.input_range(a, a + n, extent) for a, n in zip(starts, sizes))
        requests.append((dim, ranges, bounds[dim]))
        index = sharding.flat_index(spec.mesh_shape, mesh_coordinate(spec.mesh))
        out_sizes[dim] = sizes
        out_ranges[dim] = (starts[index], starts[index] + sizes[index])
    return extension(spec, tuple(requests)), out_sizes, out_ranges


def gather_windows(
    local: torch.Tensor,
    spec: ShardTensorSpec,
    windows: dict[int, WindowLike],
    boundary: dict[int, str],
    fill: float = 0.0,
) -> tuple[torch.Tensor, dict[int, tuple[int, ...]], dict[int, tuple[int, int]]]:
    """Gather, along each windowed dim, the input cells this rank's outputs read.

    Parameters
    ----------
    local : Tensor
        This rank's shard (differentiable).
    windows : dict
        Tensor dim -> its window.
    boundary : dict
        Tensor dim -> how padding cells are filled (``zeros`` uses ``fill``).

    Returns
    -------
    extended : Tensor
        The cells, padding materialised, for every windowed dim.
    out_sizes : dict
        Sharded dim -> output shard sizes.
    out_ranges : dict
        Windowed dim -> this rank's output range ``[first, stop)``.
    """
    ext, out_sizes, out_ranges = window_plan(
        spec, tuple(sorted(windows.items())), tuple(sorted(boundary.items()))
    )
    return extend(local, ext, fill), out_sizes, out_ranges


# NOTE [A padded tensor carries the halo its convolution reads]
# ``nn.ConvNd`` with ``padding_mode`` circular, reflect or replicate pads with ``F.pad`` and
# convolves the padded tensor with ``padding=0``: two halo exchanges per layer, one for the
# boundary cells of the edge ranks, one for the faces between neighbours. So ``F.pad`` in these
# modes gathers, in its one exchange, each rank's own cells widened by the pad widths on both
# sides along sharded dims (neighbours' faces and boundary cells alike: what a window of that
# reach reads), returns the padded shard as a view of that buffer and keeps the buffer with the
# result (``Halo``, in ``ShardTensor._halo``). A windowed op on the padded tensor whose every
# rank reads within the buffer (``gather_windows_of``) takes its cells from it, exchanging
# nothing. The buffer is the one the pad filled, so it is used only while the padded tensor is
# unchanged (its version counter) and under the grad mode it was made in; every rank decides
# from the layouts alone (and SPMD in-place ops), so all take the same path. The cost: a
# circular, reflect or replicate pad that no windowed op follows moves the faces for nothing.
# Under ``overlap_halos()`` the pad gathers only what it needs, and the convolution overlaps
# the faces' exchange with its interior instead.


@dataclass(frozen=True, eq=False)
class Halo:
    """This rank's cells around a padded shard (NOTE above).

    Attributes
    ----------
    buffer : Tensor
        The cells, differentiable; the padded shard is a view of it.
    covers : dict
        Padded dim -> the range (padded coordinates) every member's buffer spans.
    origins : dict
        Padded dim -> the padded coordinate of this rank's first buffer cell.
    version : int
        The padded tensor's version counter when it was made (in-place ops on a
        ShardTensor count there, not on its local tensor).
    grad_enabled : bool
        The grad mode it was filled under.
    """

    buffer: torch.Tensor
    covers: dict[int, tuple[tuple[int, int], ...]]
    origins: dict[int, int]
    version: int
    grad_enabled: bool

    def cells_for(self, padded: ShardTensor, ext: Extension) -> torch.Tensor | None:
        """The cells ``ext`` would gather from ``padded`` for this rank, if every rank's lie in
        its buffer."""
        if padded._version != self.version or torch.is_grad_enabled() != self.grad_enabled:
            return None
        if set(self.covers) - {step.dim for step in ext.steps}:
            return None
        cells = self.buffer
        for step in ext.steps:
            covered = self.covers.get(step.dim)
            if covered is None:
                if not step.plan.moves_nothing():
                    return None
                continue
            wanted = step.plan.ranges
            if any(
                hi > lo and not (a <= lo and hi <= b) for (lo, hi), (a, b) in zip(wanted, covered)
            ):
                return None
            lo, hi = wanted[step.me]
            start = lo - self.origins[step.dim] if hi > lo else 0
            cells = cells.narrow(step.dim, start, max(hi - lo, 0))
        return cells


@cached("pad plans", 1024)
def _pad_plan(
    spec: ShardTensorSpec,
    windows: tuple[tuple[int, Window], ...],
    boundary: tuple[tuple[int, str], ...],
) -> tuple[Extension, dict[int, tuple[int, ...]], tuple[tuple[int, int, int], ...], dict, dict]:
    """A pad's extension widened by the pad widths along sharded dims (NOTE above); the
    output shard sizes; where the padded shard lies in the buffer; the ``Halo`` ranges."""
    bounds = dict(boundary)
    requests, out_sizes, padded, covers, origins = [], {}, [], {}, {}
    for dim, window in windows:
        extent = spec.shape[dim]
        sharding = spec.sharding_by_dim.get(dim)
        if sharding is None:
            ranges = (window.input_range(0, window.output_extent(extent), extent),)
            wide, me = ranges, 0
        else:
            sizes = owned_sizes(window, sharding, window.output_extent(extent), spec.hints)
            starts = [sum(sizes[:k]) for k in range(len(sizes))]
            ranges = tuple(window.input_range(a, a + n, extent) for a, n in zip(starts, sizes))
            offsets = [sum(sharding.sizes[:k]) for k in range(len(sharding.sizes))]
            wide = tuple(
                (min(lo, o - window.pad_left), max(hi, o + n + window.pad_right)) if n else (lo, hi)
                for (lo, hi), o, n in zip(ranges, offsets, sharding.sizes)
            )
            out_sizes[dim] = sizes
            me = sharding.flat_index(spec.mesh_shape, mesh_coordinate(spec.mesh))
        requests.append((dim, wide, bounds[dim]))
        padded.append((dim, ranges[me][0] - wide[me][0], ranges[me][1] - ranges[me][0]))
        covers[dim] = tuple((lo + window.pad_left, hi + window.pad_left) for lo, hi in wide)
        origins[dim] = covers[dim][me][0]
    return extension(spec, tuple(requests)), out_sizes, tuple(padded), covers, origins


def pad_with_halo(
    x: ShardTensor, windows: dict[int, Window], boundary: dict[int, str], shape: Sequence[int]
) -> ShardTensor:
    """``F.pad`` of ``x`` along ``windows`` (size-1 windows) to the global ``shape``, carrying
    the halo a convolution of the padded tensor reads (NOTE above)."""
    ext, out_sizes, padded, covers, origins = _pad_plan(
        x._spec, tuple(sorted(windows.items())), tuple(sorted(boundary.items()))
    )
    buffer = extend_shard(x, ext)
    local = narrowed(buffer, padded)
    result = from_local_spec(local, output_spec(x._spec, shape, out_sizes, local.dtype))
    result._halo = Halo(buffer, covers, origins, result._version, torch.is_grad_enabled())
    return result


def gather_windows_of(
    x: ShardTensor, windows: dict[int, WindowLike], boundary: dict[int, str], fill: float = 0.0
) -> tuple[torch.Tensor, dict[int, tuple[int, ...]], dict[int, tuple[int, int]]]:
    """``gather_windows`` of a ShardTensor, taking the cells from the halo it carries when it
    holds them (NOTE above)."""
    spec = x._spec
    ext, out_sizes, out_ranges = window_plan(
        spec, tuple(sorted(windows.items())), tuple(sorted(boundary.items()))
    )
    if x._halo is not None:
        cells = x._halo.cells_for(x, ext)
        if cells is not None:
            return cells, out_sizes, out_ranges
    return extend_shard(x, ext, fill), out_sizes, out_ranges


# NOTE [A shard extended in one autograd step]
# ``extend(x.to_local(), ext)`` records two Python autograd nodes: ``to_local``'s, whose backward
# wraps the gradient in a ShardTensor, and the extension's, whose backward sends the halo
# gradients to their owners. ``extend_shard`` records one node doing both: the extension of
# ``x``'s shard in forward, the owners' sums wrapped in ``to_local``'s gradient layout
# (``grad_spec``) in backward. A zeros extension that is a local pad (NOTE [A local extension
# is a pad]), one that moves nothing, and torch.compile's traces (which take ``to_local`` as
# dynamo sees it, NOTE [torch.compile and ShardTensor]) keep the two steps.
class _ExtendShard(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: ShardTensor, ext: Extension, fill: float) -> torch.Tensor:  # type: ignore[override]
        ctx.ext, ctx.grad_spec = ext, grad_spec(x._spec)
        return extended(x._local, ext, fill)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[ShardTensor, None, None]:  # type: ignore[override]
        owned = summed_to_owners(grad, ctx.ext)
        return gradient_shard(owned, ctx.grad_spec.with_dtype(owned.dtype)), None, None


def extend_shard(x: ShardTensor, ext: Extension, fill: float = 0.0) -> torch.Tensor:
    """``extend(x.to_local(), ext, fill)`` in one autograd step where it exchanges (NOTE
    above)."""
    if ext.identity or ext.constant_pad is not None or in_graph():
        return extend(x.to_local(), ext, fill)
    return _ExtendShard.apply(x, ext, fill)


def output_spec(
    spec: ShardTensorSpec,
    shape: Sequence[int],
    out_sizes: dict[int, tuple[int, ...]],
    dtype: torch.dtype,
) -> ShardTensorSpec:
    """``spec`` with a new global shape; windowed dims take ``out_sizes``, others keep theirs."""
    return _output_spec(spec, tuple(shape), tuple(sorted(out_sizes.items())), dtype)


@cached("window output layouts", 4096)
def _output_spec(
    spec: ShardTensorSpec,
    shape: tuple[int, ...],
    out_sizes: tuple[tuple[int, tuple[int, ...]], ...],
    dtype: torch.dtype,
) -> ShardTensorSpec:
    out_sizes = dict(out_sizes)
    return ShardTensorSpec.build(
        spec.mesh,
        spec.placements,
        shape,
        dtype,
        {s.dim: out_sizes.get(s.dim, s.sizes) for s in spec.shardings},
        order={s.dim: s.axes for s in spec.shardings},
        hints=merged_hints(spec.hints, spec.shardings),
    )


def overlapped_windows(
    local: torch.Tensor,
    spec: ShardTensorSpec,
    windows: dict[int, Window],
    boundary: dict[int, str],
    dim: int,
    local_op,
    channels: int,
    params: tuple[torch.Tensor | None, ...],
    fill: float = 0.0,
) -> tuple[torch.Tensor, dict[int, tuple[int, ...]], dict[int, tuple[int, int]]]:
    """``local_op`` over this rank's windows, overlapping the halo exchange of sharded ``dim``
    (the only sharded windowed dim) with the outputs that read only this rank's own cells.

    ``channels`` is the op's output size along dim 1 and ``params`` the tensors it uses besides
    the input (an empty output stays connected to them). Returns the local output, the output
    shard sizes and this rank's output ranges, as ``gather_windows`` plus the op would.
    """
    others = {d: w for d, w in windows.items() if d != dim}
    local, _, out_ranges = gather_windows(local, spec, others, boundary, fill)
    prior_real = []
    for d, w in others.items():
        lo, hi = w.input_range(0, w.output_extent(spec.shape[d]), spec.shape[d])
        _, start, stop = domain_range(d, lo, hi, spec.shape[d])
        if boundary[d] == "zeros" and (start, stop) != (0, hi - lo):
            prior_real.append((d, start, stop - start))
    window = windows[dim]
    sharding = spec.sharding_by_dim[dim]
    extent = spec.shape[dim]
    sizes = owned_sizes(window, sharding, window.output_extent(extent), spec.hints)
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    ranges = tuple(window.input_range(a, a + n, extent) for a, n in zip(starts, sizes))
    index = sharding.flat_index(spec.mesh_shape, mesh_coordinate(spec.mesh))
    first, stop = starts[index], starts[index] + sizes[index]
    out_ranges[dim] = (first, stop)
    ext = extension(spec, ((dim, ranges, boundary[dim]),), tuple(prior_real))
    shard, finish = start_extend(local, ext, fill)
    own = sum(sharding.sizes[:index])
    inner_first = max(first, window.first_inside(own))
    inner_stop = min(stop, window.last_inside(own + sharding.sizes[index]))
    pieces = []
    edges = [(first, stop)]
    if inner_stop > inner_first:
        lo, hi = window.input_range(inner_first, inner_stop, extent)
        pieces.append((inner_first, local_op(shard.narrow(dim, lo - own, hi - lo))))
        edges = [(first, inner_first), (inner_stop, stop)]
    extended = finish()
    extended_start = ranges[index][0]
    for edge_first, edge_stop in edges:
        if edge_stop > edge_first:
            lo, hi = window.input_range(edge_first, edge_stop, extent)
            pieces.append(
                (edge_first, local_op(extended.narrow(dim, lo - extended_start, hi - lo)))
            )
    pieces.sort(key=lambda item: item[0])
    if not pieces:
        shape = list(extended.shape)
        shape[1] = channels
        for d, (a, b) in out_ranges.items():
            shape[d] = b - a
        return connected_empty(shape, extended, extended, *params), {dim: sizes}, out_ranges
    out = torch.cat([p for _, p in pieces], dim) if len(pieces) > 1 else pieces[0][1]
    return out + extended.sum() * 0, {dim: sizes}, out_ranges
