"""Output layouts the op tests state (NOTE [An output's layout is stated] in
``shardsci/testing/_reference.py``), worked out from the documented rules, not by the library.

- :func:`parse` reads a layout written out in short form, for outputs no simple rule covers.
- :func:`renamed`, :func:`reduced` follow sharded dims through views and reductions.
- :func:`windowed` gives each output cell of a windowed op (convolution, pooling, padding,
  interpolation) to the rank holding the input cell it is anchored on (NOTE [Which rank owns
  an output of a windowed op] in ``shardsci/tensor/_ops/_windows.py``).
- :func:`cell_owners` states the layout of any op's output by what each output cell depends
  on (NOTE [An output cell belongs to the shard it depends on]): the op-database sweep's
  expectation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor._ops._math_ops import _NormPartial

from shardsci.testing import ExpectedLayout, Layout
from tests.boxes import box, coordinates, dim_shardings

_PLACEMENTS: dict[str, Placement] = {
    "R": Replicate(),
    "P": Partial("sum"),
    "Pavg": Partial("avg"),
    "Pmax": Partial("max"),
    "Pmin": Partial("min"),
    "Pnorm": _NormPartial(2),
}


def parse(text: str) -> Layout:
    """A layout in short form: placements per mesh axis, then each sharded dim's sizes.

    ``"S2; 2=7/4"`` is ``Layout((Shard(2),), {2: (7, 4)})``; ``"S0,S0; 0=2/1/1/1"`` nests dim
    0 over both axes, axis 0 outermost, and ``"S0,S0; 0[1,0]=2/1/1/1"`` axis 1 outermost;
    ``"R,P"`` is (Replicate, Partial sum); ``"S1,S0; 0=1/3; 1=2/1"``. Tokens: ``S<dim>``, ``R``,
    ``P`` (sum), ``Pavg``, ``Pmax``, ``Pmin``, ``Pnorm`` (the 2-norm partial).
    """
    head, *dims = [part.strip() for part in text.split(";")]
    placements = tuple(
        Shard(int(token[1:])) if token.startswith("S") else _PLACEMENTS[token]
        for token in (t.strip() for t in head.split(","))
    )
    sizes, order = {}, {}
    for part in dims:
        dim, values = part.split("=")
        if "[" in dim:
            dim, axes = dim.rstrip("]").split("[")
            order[int(dim)] = tuple(int(a) for a in axes.split(","))
        sizes[int(dim)] = tuple(int(v) for v in values.split("/"))
    return Layout(placements, sizes, order)


def _sizes(layout: Layout, shape: Sequence[int], mesh: Sequence[int]) -> dict[int, tuple]:
    return {d: sizes for d, (_, sizes) in dim_shardings(layout, shape, mesh).items()}


def renamed(
    layout: Layout,
    shape: Sequence[int],
    mesh: Sequence[int],
    dims: Mapping[int, int | None],
    scale: Mapping[int, int] | None = None,
) -> Layout:
    """``layout`` with sharded dim ``d`` now called ``dims[d]`` (default: unchanged); None
    replicates its axes. ``scale[d]`` multiplies its sizes (a dim that absorbed others)."""
    sizes = _sizes(layout, shape, mesh)
    placements = []
    for p in layout.placements:
        if isinstance(p, Shard):
            new = dims.get(p.dim % len(shape), p.dim % len(shape))
            placements.append(Replicate() if new is None else Shard(new))
        else:
            placements.append(p)
    kept = {}
    for d, s in sizes.items():
        new = dims.get(d, d)
        if new is not None:
            kept[new] = tuple(x * (scale or {}).get(d, 1) for x in s)
    return Layout(tuple(placements), kept)


def reduced(
    layout: Layout,
    shape: Sequence[int],
    mesh: Sequence[int],
    reduced_dims: Sequence[int],
    placement: Placement,
    keepdim: bool = False,
) -> Layout:
    """A reduction over ``reduced_dims``: their axes hold ``placement``; the other sharded
    dims keep their sizes, renumbered unless ``keepdim``."""
    reduced_dims = [d % len(shape) for d in reduced_dims]
    kept = [d for d in range(len(shape)) if d not in reduced_dims]
    number = {d: (d if keepdim else kept.index(d)) for d in kept}
    sizes = _sizes(layout, shape, mesh)
    placements = tuple(
        (placement if p.dim % len(shape) in reduced_dims else Shard(number[p.dim % len(shape)]))
        if isinstance(p, Shard)
        else p
        for p in layout.placements
    )
    return Layout(placements, {number[d]: s for d, s in sizes.items() if d in number})


def over_sharded_axes(layout: Layout, placement: Placement) -> Layout:
    """Every sharding axis holds ``placement`` (a full reduction); other axes unchanged."""
    return Layout(tuple(placement if isinstance(p, Shard) else p for p in layout.placements))


def every_shard_even(layout: Layout, shape: Sequence[int], mesh: Sequence[int]) -> bool:
    return all(s[0] > 0 and len(set(s)) == 1 for s in _sizes(layout, shape, mesh).values())


# ---------------------------------------------------------------------------- windows
Anchor = Callable[[int], int]


class WindowAnchor:
    """A window's anchor rule that also knows which input cells each output reads (padding
    included): ``owned`` then puts an output reading one shard's cells alone on that shard."""

    def __init__(self, centre: Anchor, cells: Callable[[int], list[int]]) -> None:
        self.centre, self.cells = centre, cells

    def __call__(self, j: int) -> int:
        return self.centre(j)


def owned(
    sizes: Sequence[int], anchors: Sequence[int], reads: Sequence[list[int]] | None = None
) -> tuple[int, ...]:
    """Shard sizes of an output whose cell ``j`` belongs to the shard holding input cell
    ``anchors[j]`` (clamped into the domain; empty shards hold no cell). With ``reads`` (the
    input cells each output reads), an output whose cells in the domain lie in one shard
    belongs to it, and every other output's anchor shard is held between the last such
    shard before it and the first after it, unless those shards decrease along the dim
    (NOTE [Which rank owns an output of a windowed op])."""
    extent = sum(sizes)
    bounds = [sum(sizes[:k]) for k in range(len(sizes) + 1)]

    def shard(cell: int) -> int:
        return next(k for k in range(len(sizes)) if bounds[k] <= cell < bounds[k + 1])

    owners = [shard(min(max(anchor, 0), extent - 1)) for anchor in anchors]
    if reads is not None:
        lone = []
        for cells in reads:
            shards = {shard(c) for c in cells if 0 <= c < extent}
            lone.append(shards.pop() if len(shards) == 1 else None)
        known = [k for k in lone if k is not None]
        if known == sorted(known):
            for j, k in enumerate(lone):
                before = [b for b in lone[:j] if b is not None]
                after = [a for a in lone[j + 1 :] if a is not None]
                low, high = max(before, default=0), min(after, default=len(sizes))
                owners[j] = k if k is not None else min(max(owners[j], low), high)
    return tuple(owners.count(k) for k in range(len(sizes)))


def windowed(
    layout: Layout, shape: Sequence[int], mesh: Sequence[int], anchors: Mapping[int, Anchor]
) -> Callable[[Sequence[int]], Layout]:
    """The output layout, given the output's shape: dim ``d`` with an anchor rule gives output
    cell ``j`` to the rank holding input cell ``anchors[d](j)``; other dims keep their sizes."""

    def of(out_shape: Sequence[int]) -> Layout:
        sizes = _sizes(layout, shape, mesh)
        for d, anchor in anchors.items():
            if d in sizes:
                cells = getattr(anchor, "cells", None)
                outputs = range(out_shape[d])
                reads = None if cells is None else [cells(j) for j in outputs]
                sizes[d] = owned(sizes[d], [anchor(j) for j in outputs], reads)
        return Layout(layout.placements, sizes, layout.order)

    return of


def window_anchor(kernel: int, stride: int, padding: int, dilation: int) -> Anchor:
    """A sliding window's centre, rounded down: output ``j`` reads from ``j stride - padding``."""
    return WindowAnchor(
        lambda j: j * stride - padding + dilation * (kernel - 1) // 2,
        lambda j: [j * stride - padding + m * dilation for m in range(kernel)],
    )


def transposed_anchor(kernel: int, stride: int, padding: int, dilation: int) -> Anchor:
    """An upsampling window: output ``i`` is centred on input ``(i + p - d (k - 1) // 2) // s``
    and reads inputs ``j`` with ``i + p = j s + m d``."""
    return WindowAnchor(
        lambda i: (i + padding - dilation * (kernel - 1) // 2) // stride,
        lambda i: [
            (i + padding - m * dilation) // stride
            for m in range(kernel)
            if (i + padding - m * dilation) % stride == 0
        ],
    )


def _per_dim(value: int | Sequence[int], n: int) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * n


def module_anchors(module: nn.Module, ndim: int) -> dict[int, Anchor]:
    """Anchor rules of a convolution or pooling module's spatial dims, for an input of
    ``ndim`` dims (the spatial dims are the last ones)."""
    n = ndim - 2
    kernel = _per_dim(module.kernel_size, n)
    stride = _per_dim(module.stride or module.kernel_size, n)
    dilation = _per_dim(getattr(module, "dilation", 1), n)
    padding = module.padding
    if padding == "valid":
        padding = (0,) * n
    elif padding == "same":
        padding = tuple(d * (k - 1) // 2 for k, d in zip(kernel, dilation))
    padding = _per_dim(padding, n)
    rule = transposed_anchor if isinstance(module, nn.modules.conv._ConvTransposeNd) else None
    rule = rule or window_anchor
    first = ndim - n
    return {first + i: rule(kernel[i], stride[i], padding[i], dilation[i]) for i in range(n)}


def pad_anchors(pad: Sequence[int], ndim: int) -> dict[int, Anchor]:
    """``F.pad``: padding cells belong to the edge shards (anchor ``j - left``)."""
    return {ndim - 1 - i: (lambda j, left=pad[2 * i]: j - left) for i in range(len(pad) // 2)}


def interpolation_anchors(
    shape: Sequence[int],
    dims: Sequence[int],
    call: Callable[[torch.Tensor], torch.Tensor],
    area: bool,
) -> dict[int, Anchor]:
    """Interpolation: output ``i`` is anchored on the input cell nearest its source coordinate
    (for ``area``, the middle of its range, rounded down), read off ``call`` applied to a ramp
    of input indices along each spatial dim of ``shape`` (N, C, ...) (every mode reproduces a ramp: nearest picks its source
    cell, linear and cubic weights interpolate it, area averages its range); an anchor beyond
    the edge is clamped."""
    anchors = {}
    whole = (1, 1, *shape[2:])
    for d in dims:
        along = [1] * len(shape)
        along[d] = shape[d]
        ramp = torch.arange(shape[d], dtype=torch.float64).reshape(along).expand(whole)
        out = call(ramp.contiguous())
        source = out[tuple(slice(None) if k == d else 0 for k in range(out.ndim))]
        cells = (source if area else source + 0.5).floor().to(torch.int64).tolist()
        anchors[d] = lambda j, cells=cells: cells[j]
    return anchors


def counted(sizes: Sequence[int], kept: Sequence[int]) -> tuple[int, ...]:
    """Shard sizes after keeping global indices ``kept`` (a slice) of a sharded dim."""
    bounds = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    return tuple(sum(1 for i in kept if bounds[k] <= i < bounds[k + 1]) for k in range(len(sizes)))


def on_multiples(sizes: Sequence[int], step: int) -> tuple[int, ...]:
    """Shard boundaries moved to the nearest multiples of ``step`` (Python's ``round``),
    sizes divided by ``step``: a sharded dim split into ``(n / step, step)``."""
    total = sum(sizes)
    boundaries = [round(sum(sizes[: k + 1]) / step) for k in range(len(sizes))]
    boundaries[-1] = total // step
    return tuple(b - a for a, b in zip([0, *boundaries[:-1]], boundaries))


# ---------------------------------------------------------------------------- dependencies
# NOTE [An output cell belongs to the shard it depends on]
# Which rank should hold an output cell of an op nobody wrote a rule for? The one holding the
# input it is computed from: then the op needs no communication for that cell, and no rank
# holds what another already holds. ``cell_owners`` finds, on one process, which shard of a
# sharded input dim each output cell depends on: it perturbs the input one shard's block at a
# time and sees which output cells change. A cell that changes with exactly one block is
# *owned* by that block's coordinate along the axis; one that changes with none or with
# several (a reduction over the sharded dim, a window straddling two shards) is not.
# An output dim ``e`` *carries* the axis when every index along ``e`` has at most one owner
# among its owned cells and the owners never decrease along ``e``; the output must then be
# sharded along ``e`` on that axis with every owned cell on its owner's shard (cells of no
# owner may go to either neighbour). That is the window rule for convolutions and pooling, the
# renaming rule for views, and "keep the sizes" for elementwise ops, found without knowing
# the op. An output of the input's shape keeps the input's sizes (NOTE [An output's layout is
# stated] in ``shardsci/testing/_reference.py``) unless another dim alone carries the axis
# with the input dim's own owners, index for index (a transpose renames the dim, it does not
# move its boundaries): dependencies that only move the boundaries within the same dim (a
# roll, a masked scan whose masked cells depend on nothing) do not override it, nor does a dim
# that carries the axis only through a mask (a masked scan along the sharded dim: output cell
# (i, j) reads rows up to i where the mask allows, so the columns whose masked rows end early
# look like the first rank's). Where one rank holds the whole split dim, every output dim
# carries the axis with that one owner: the output may be sharded along any dim that rank
# holds whole (``rot90`` of a split held by one rank moves it to the other dim, as it does any
# split; each layout moves nothing). Where every cell that depends on the input combines several
# shards (a contraction over the split dim: ``x @ w`` with ``x``'s last dim split, whose output
# only happens to have ``x``'s shape), partial values on the axis are as good: they move
# nothing. A dim whose owners never increase along it (a flip: ``flip``, ``rot90``, whose
# transpose moves the split to the other dim) carries the axis *mirrored*: no layout in
# rank order moves nothing there, and the dim holds the split dim's own sizes, as a flip
# along the split dim keeps them (``rot90`` of a square split by rows is sharded by columns
# with the rows' sizes; before, the square shape made it keep Shard(0) of a dim no rank split).
# The probe cannot move a NaN or an infinity: a cell unmoved by a block holding one may still
# read it (``nansum`` of ``[nan, 2]`` split between the two), so it is owned by no block.
# Where no dim (or more than one) carries the axis of an output of another shape, nothing is
# stated. The probe runs the op on one process only: the library's answer plays no part in
# the expectation.


@dataclass(frozen=True)
class AxisRule:
    """What one mesh axis of an output must look like.

    Attributes
    ----------
    axis : int
        The mesh axis.
    dim : int
        The output dim the axis must shard.
    owners : tuple of (int or None)
        Per index along ``dim``: the coordinate along ``axis`` that must hold it (None: any).
    rule : str
        ``"depends"`` (found by :func:`cell_owners`), ``"same-shape"`` (the input's sizes) or
        ``"same-shape or partial"`` (the input's sizes, or partial values on the axis) or
        ``"mirrored"`` (the input's sizes along the dim that carries the split reversed) or
        ``"one holder"`` (one coordinate holds the whole split dim, and every output dim
        carries it: sharded along any dim that coordinate holds whole).
    documented : str
        A layout the library documents for this op where the rule states another (NOTE [A
        layout an op documents over its dependencies]): ``""`` (none), ``"moved"`` (sharded
        along another dim, or nested with other axes on ``dim``), ``"pending sum"``
        (Partial(sum)), ``"computed alike"`` (Replicate: every rank computes the same values)
        or ``"either window"`` (``owners`` has no owner for the cells that windows from two
        shards cover).
    reads_elsewhere : bool
        Of a same-shape rule: whether some output cell along ``dim`` depends on the split dim
        elsewhere than at its own index's block (on several blocks, or on another one: a
        transform or a scan along the split dim), so that no cell along ``dim`` need stay with
        its index's block.
    """

    axis: int
    dim: int
    owners: tuple[int | None, ...]
    rule: str
    documented: str = ""
    reads_elsewhere: bool = False

    @property
    def text(self) -> str:
        return f"{self.rule} or {self.documented}" if self.documented else self.rule


@dataclass(frozen=True)
class Dependence:
    """How one output's cells depend on the blocks of a split input dim.

    Attributes
    ----------
    carrying : dict of int to tuple of (int or None)
        Output dim -> the owner of each index along it, for the output dims that carry the
        split (see the NOTE).
    combined : bool
        Whether every cell that depends on the input depends on two blocks or more (a
        contraction or a reduction over the split dim), so that no cell has an owner.
    mirrored : dict of int to tuple of (int or None)
        Output dim -> the owner of each index along it, for the output dims whose owners
        take two values or more and never increase along it (a flip, see the NOTE).
    """

    carrying: dict[int, tuple[int | None, ...]]
    combined: bool = False
    mirrored: dict[int, tuple[int | None, ...]] = field(default_factory=dict)


def _differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: whether ``a`` and ``b`` differ (NaN equals NaN)."""
    same = a == b
    if a.is_floating_point() or a.is_complex():
        same = same | (a.isnan() & b.isnan())
    return ~same


#: How each block is moved to see what depends on it: up, down and both ways at random, each
#: element by its own magnitude (a histogram's bin changes with the elements that leave it
#: or come into it), and past every other element, up and down (a maximum or minimum over a
#: window reaching two blocks changes with either only when a moved element passes the
#: other's: a move by its own magnitude left a larger maximum in the other block unmoved,
#: and the window was taken for that block's alone).
_DIRECTIONS = ("up", "down", "random", "past up", "past down")


def _perturbed(
    x: torch.Tensor, dim: int, start: int, size: int, direction: str, seed: int
) -> torch.Tensor:
    """``x`` with its block ``[start, start + size)`` along ``dim`` moved in ``direction`` by
    one to two times its elements' magnitudes plus one, or (``"past ..."``) by one to two
    times ``2 M + 1``, ``M`` the largest finite magnitude in ``x``."""
    generator = torch.Generator().manual_seed(seed)
    block = x.narrow(dim, start, size)
    step = 1 + torch.rand(block.shape, dtype=block.real.dtype, generator=generator)
    if direction.endswith("down"):
        step = -step
    elif direction == "random":
        step = step * torch.randn(block.shape, dtype=block.dtype, generator=generator).sgn()
    if direction.startswith("past"):
        finite = x.detach().abs()
        finite = finite[finite.isfinite()]
        reach = 2 * (finite.max().item() if finite.numel() else 0.0) + 1
    else:
        reach = block.abs() + 1
    moved = x.detach().clone()
    moved.narrow(dim, start, size).add_(step * reach)
    return moved


def cell_owners(
    call: Callable[[torch.Tensor], Sequence[object]],
    x: torch.Tensor,
    dim: int,
    sizes: Sequence[int],
) -> list[Dependence] | None:
    """Per output of ``call(x)``: how its cells depend on the blocks of ``x``'s ``dim`` split
    into ``sizes`` (NOTE [An output cell belongs to the shard it depends on]). None when ``x``
    cannot be perturbed (not floating point), ``call`` raises on a perturbed input, or an
    output changes shape.

    ``call`` must be deterministic (reseed its random ops) and return a flat sequence.
    """
    if not (x.is_floating_point() or x.is_complex()):
        return None
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    movable = [bool(x.narrow(dim, a, n).isfinite().all()) for a, n in zip(starts, sizes)]
    try:
        with torch.no_grad():
            base = list(call(x))
            # per block: per output, the cells that changed with any move of the block
            changed: list[list[torch.Tensor | None]] = []
            for k, (start, size) in enumerate(zip(starts, sizes)):
                seen: list[torch.Tensor | None] = [None] * len(base)
                for direction in _DIRECTIONS if size else ():
                    moved = list(call(_perturbed(x, dim, start, size, direction, seed=k + 1)))
                    if len(moved) != len(base):
                        return None
                    for i, (m, b) in enumerate(zip(moved, base)):
                        if isinstance(b, torch.Tensor) and b.layout == torch.strided:
                            if not isinstance(m, torch.Tensor) or m.shape != b.shape:
                                return None
                            diff = _differs(m, b)
                            seen[i] = diff if seen[i] is None else seen[i] | diff
                changed.append(seen)
    except Exception:
        return None
    result = []
    for i, b in enumerate(base):
        if not isinstance(b, torch.Tensor) or b.layout != torch.strided:
            result.append(Dependence({}))
            continue
        per_block = [
            torch.zeros(b.shape, dtype=torch.bool) if seen[i] is None else seen[i]
            for seen in changed
        ]
        blocks_read = sum(block.to(torch.int64) for block in per_block)
        # a cell unmoved by a block holding NaN or infinity may still read it: not owned
        unsure = torch.zeros(b.shape, dtype=torch.bool)
        for block, finite in zip(per_block, movable):
            if not finite:
                unsure |= ~block
        single = (blocks_read == 1) & ~unsure
        combined = bool((blocks_read > 1).any()) and not bool(single.any())
        carrying, mirrored = _carrying_dims(per_block, single, b.shape)
        result.append(Dependence(carrying, combined, mirrored))
    return result


def _carrying_dims(
    per_block: Sequence[torch.Tensor], single: torch.Tensor, shape: Sequence[int]
) -> tuple[dict[int, tuple[int | None, ...]], dict[int, tuple[int | None, ...]]]:
    """Output dim -> owners along it, for the dims that carry the axis and for those that
    carry it mirrored (see the NOTE); ``single`` marks the cells owned by one block."""
    if not per_block or math.prod(shape) == 0:
        return {}, {}
    stacked = torch.stack(list(per_block))  # (blocks, *shape)
    owner = torch.where(single, stacked.to(torch.int64).argmax(0), -1)
    carrying, mirrored = {}, {}
    for e in range(len(shape)):
        along = owner.movedim(e, 0).reshape(shape[e], -1)
        highest = along.max(1).values
        lowest = torch.where(along >= 0, along, len(per_block)).min(1).values
        if bool(((highest >= 0) & (lowest != highest)).any()):
            continue  # an index along e with cells of two owners
        owners = tuple(int(o) if o >= 0 else None for o in highest.tolist())
        known = [o for o in owners if o is not None]
        if known and known == sorted(known):
            carrying[e] = owners
        elif len(set(known)) > 1 and known == sorted(known, reverse=True):
            mirrored[e] = owners
    return carrying, mirrored


def axis_rules(
    dependences: Mapping[int, Dependence],
    input_layout: Layout,
    input_shape: Sequence[int],
    output_shape: Sequence[int],
    mesh: Sequence[int],
) -> list[AxisRule]:
    """The rules one output's axes must follow, for each axis sharding the input dim ``d``:

    - an output of the input's shape keeps ``d``'s sizes (the rule of NOTE [An output's
      layout is stated]), or may be partial where every cell combines several shards,
      unless its cells depend on the shards along another dim alone, with ``d``'s owners
      index for index (a transpose): then that dim carries the axis;
    - any other output is sharded along the dim that alone carries the axis (with two or
      more owners, or the only one with any), if there is one;
    - where no dim carries it with two owners or more but one dim carries it mirrored (a
      flip), that dim holds ``d``'s sizes, as a flip along ``d`` keeps them;
    - else, and for an output with no cell (which no layout makes any rank hold), nothing
      is stated.
    """
    rules = []
    if math.prod(output_shape) == 0:
        return rules  # no cell: every layout of it holds nothing
    shardings = dim_shardings(input_layout, input_shape, mesh)
    same_shape = tuple(output_shape) == tuple(input_shape)
    for axis, p in enumerate(input_layout.placements):
        if not isinstance(p, Shard):
            continue
        dim = p.dim % len(input_shape)
        dependence = dependences.get(axis, Dependence({}))
        carrying = dependence.carrying
        spread = [e for e, o in carrying.items() if len({x for x in o if x is not None}) > 1]
        chosen = spread if spread else list(carrying)
        carried = chosen[0] if len(chosen) == 1 else None
        axes, sizes = shardings[dim]
        kept = tuple(k for k, n in enumerate(sizes) for _ in range(n))
        renamed = carried is not None and _renames(carrying[carried], kept)
        mirror = list(dependence.mirrored)
        flip = mirror[0] if not spread and len(mirror) == 1 and axes == (axis,) else None
        if flip is not None and output_shape[flip] == len(kept):
            rules.append(AxisRule(axis, flip, kept, "mirrored"))
            continue
        if same_shape and axes == (axis,) and (carried in (None, dim) or not renamed):
            rule = "same-shape or partial" if dependence.combined else "same-shape"
            if carried is None and len(chosen) > 1 and len(set(kept)) == 1:
                rule = "one holder"  # every carrying dim has the one owner: any may hold it
            elsewhere = not _renames(carrying.get(dim, ()), kept)
            rules.append(AxisRule(axis, dim, kept, rule, reads_elsewhere=elsewhere))
        elif carried is not None:
            rules.append(AxisRule(axis, carried, carrying[carried], "depends"))
    return rules


# NOTE [A layout an op documents over its dependencies]
# Two kinds of op leave an output, on purpose and documented, where the cells' dependencies
# (NOTE [An output cell belongs to the shard it depends on]) state another layout; the rule
# takes the documented one as well, for those ops and those axes only:
# - a transform along a split dim (``fft.*``): the library moves the dim's axes onto another
#   dim, one all-to-all, where ending on the input's dim would take a second (NOTE [Where a
#   distributed FFT leaves the spectrum] in ``shardsci/tensor/_ops/_fft_ops.py``; its inverse
#   returns to the input's layout). Such an axis may shard another dim, or its own nested with
#   other axes (a 2-D block transformed along both dims is split along one of them over both
#   axes): "moved". It applies to an output of the input's shape whose cells along the split
#   dim read it elsewhere than at their own block: every shard (no cell has an owner, so no
#   split moves less than another), or only some, where the transform keeps only some input
#   modes (``irfft`` and ``hfft`` read the first ``n // 2 + 1``: with those on one shard, every
#   cell depends on that shard alone, and the same-shape rule would hold the output to the
#   input's sizes, a layout no more local than the documented one). A transform along a dim
#   the input does not split keeps the strict rule, as does a split held by one rank (the
#   library transforms it where it lies).
# - a lookup by value along a split dim, which rank holds a looked-up cell being data
#   (``PENDING_SUMS``: a row of a table split along its vocabulary, ``nn.functional.embedding``'s
#   dim 0, NOTE [A split table is looked up where it lies] in
#   ``shardsci/tensor/_ops/_embedding_ops.py``; the log-probability of a target's class with
#   the classes split, ``nn.functional.nll_loss``'s class dim, NOTE [A loss over split classes
#   is a pending sum] in ``shardsci/tensor/_ops/_loss_ops.py``; the bin an element falls in,
#   ``histc`` and ``histogram`` split along any dim, NOTE [A histogram is a pending sum of each
#   rank's counts] in ``shardsci/tensor/_ops/_reduction_ops.py``): an output cell depends on the
#   shards holding what it looks up, which the values decide and no layout can depend on; the
#   library returns a pending sum over the axes splitting that dim, each rank's terms. Such an
#   axis may be Partial(sum). A histogram's bin edges are not a lookup: every rank computes
#   them alike, from the given bins or range or from the global minimum and maximum (one
#   all-reduce each, a reduction over every element); the probe sees them depend on the
#   shard that holds those, or take the input's shape when ``bins + 1`` equals it. That
#   output (``PendingSum.alike``) may be Replicate ("computed alike").
# - a scatter by value into cells that windows from two shards may write (``max_unpool``
#   after a pooling whose windows overlap, kernel 3 stride 2): a cell takes the value of
#   whichever window's maximum it is, which the ``indices`` argument decides (the probe holds
#   them fixed and sees one owner), and the library gives it to the rank of the last window
#   starting at or before it (``shardsci/tensor/_ops/_unpool_ops.py``). Such a cell, worked
#   out from the sample's kernel, stride and padding (``SCATTERED_BY_WINDOWS``), may be held
#   by any rank whose windows cover it: "either window" (its owner is any).
# Anything else (a replicated output; a pending sum of a lookup in a table split by columns,
# whose output keeps the columns' split) still breaks the rule.


@dataclass(frozen=True)
class PendingSum:
    """An op whose outputs are a pending sum over the axes splitting some dims of its first
    tensor argument, as a NOTE in the library states.

    Attributes
    ----------
    dims : callable
        The first argument's number of dims -> the dims it looks up along.
    note : str
        The NOTE that states it (its title).
    """

    dims: Callable[[int], Sequence[int]]
    note: str
    alike: tuple[int, ...] = ()
    """The outputs (by position) every rank computes alike instead, replicated."""


#: OpInfo key -> the dims along which it looks up by value (NOTE [A layout an op documents
#: over its dependencies]).
_HISTOGRAM = PendingSum(range, "A histogram is a pending sum of each rank's counts", alike=(1,))
PENDING_SUMS = {
    "nn.functional.embedding": PendingSum(
        lambda ndim: (0,), "A split table is looked up where it lies"
    ),
    "nn.functional.nll_loss": PendingSum(
        lambda ndim: (min(1, ndim - 1),), "A loss over split classes is a pending sum"
    ),
    "histc": _HISTOGRAM,
    "histogram": _HISTOGRAM,
}


#: OpInfo key -> the number of spatial dims of an op that scatters by value into its
#: windows' cells (NOTE [A layout an op documents over its dependencies]).
SCATTERED_BY_WINDOWS = {
    f"nn.functional.max_unpool{n}d{variant}": n for n in (1, 2, 3) for variant in ("", ".grad")
}


def window_covers(
    sizes: Sequence[int], extent: int, kernel: int, stride: int, padding: int
) -> list[set[int]]:
    """Per output cell of a dim of ``extent`` cells: the blocks (of a pooled dim split into
    ``sizes``) whose windows cover it; pooled cell ``i``'s window is ``[i s - p, i s - p +
    k)``."""
    covers: list[set[int]] = [set() for _ in range(extent)]
    starts = [sum(sizes[:block]) for block in range(len(sizes))]
    for block, (start, n) in enumerate(zip(starts, sizes)):
        for i in range(start, start + n):
            first = i * stride - padding
            for j in range(max(0, first), min(extent, first + kernel)):
                covers[j].add(block)
    return covers


def _either_window(
    rule: AxisRule,
    op: str,
    input_layout: Layout,
    shape: Sequence[int],
    mesh: Sequence[int],
    kwargs: Mapping[str, object],
) -> AxisRule | None:
    """``rule`` with any owner for the cells windows from two blocks cover, or None when no
    cell is so covered (NOTE [A layout an op documents over its dependencies])."""
    n = SCATTERED_BY_WINDOWS[op]
    p = input_layout.placements[rule.axis]
    dim = p.dim % len(shape) if isinstance(p, Shard) else -1
    spatial = dim - (len(shape) - n)
    axes, sizes = dim_shardings(input_layout, shape, mesh).get(dim, ((), ()))
    if spatial < 0 or rule.dim != dim or axes != (rule.axis,):
        return None

    def per_dim(name: str, default: object) -> int:
        value = kwargs.get(name)
        value = default if value is None else value
        return int(value[spatial] if isinstance(value, (tuple, list)) else value)  # type: ignore[index]

    kernel = per_dim("kernel_size", 1)
    stride, padding = per_dim("stride", kernel), per_dim("padding", 0)
    covers = window_covers(sizes, len(rule.owners), kernel, stride, padding)
    if not any(len(c) > 1 for c in covers):
        return None
    owners = tuple(None if len(c) > 1 else o for o, c in zip(rule.owners, covers))
    return replace(rule, owners=owners, documented="either window")


def documented(
    op: str,
    rules: Sequence[AxisRule],
    input_layout: Layout,
    ndim: int,
    shape: Sequence[int] = (),
    mesh: Sequence[int] = (),
    kwargs: Mapping[str, object] | None = None,
    output: int = 0,
) -> list[AxisRule]:
    """``rules`` for output number ``output`` of the op named ``op`` (an OpInfo key) of an
    ``ndim``-dim input laid out as ``input_layout``, each also taking the layout the op
    documents (NOTE [A layout an op documents over its dependencies]). An op of
    ``SCATTERED_BY_WINDOWS`` needs the input's ``shape``, the ``mesh`` and the sample's
    ``kwargs`` (its windows)."""
    placements = input_layout.placements
    pending = PENDING_SUMS.get(op)
    result = []
    for r in rules:
        also = ""
        if op.startswith("fft.") and r.rule.startswith("same-shape") and r.reads_elsewhere:
            also = "moved"
        elif pending is not None and placements[r.axis] in map(Shard, pending.dims(ndim)):
            also = "computed alike" if output in pending.alike else "pending sum"
        elif op in SCATTERED_BY_WINDOWS and kwargs is not None:
            either = _either_window(r, op, input_layout, shape, mesh, kwargs)
            if either is not None:
                result.append(either)
                continue
        result.append(replace(r, documented=also))
    return result


def _renames(owners: Sequence[int | None], kept: Sequence[int]) -> bool:
    """Whether an output dim's ``owners`` are the input dim's ``kept`` owners, index for index
    (an index of no owner agrees with any)."""
    return len(owners) == len(kept) and all(o is None or o == k for o, k in zip(owners, kept))


def held_where(
    rules: Sequence[AxisRule],
    placements: Sequence[Placement],
    sizes: Mapping[int, Sequence[int]],
    order: Mapping[int, Sequence[int]],
    shape: Sequence[int],
    mesh: Sequence[int],
) -> str:
    """What breaks ``rules`` in an output laid out as ``placements``/``sizes``/``order``
    (read off the output's spec); "" if nothing."""
    actual = Layout(tuple(placements), dict(sizes), dict(order))
    for rule in rules:
        p = placements[rule.axis]
        if rule.rule == "same-shape or partial" and isinstance(p, Partial):
            continue
        if rule.documented == "moved" and isinstance(p, Shard):
            e = p.dim % len(shape)
            axes_on_e = [q for q in placements if isinstance(q, Shard) and q.dim % len(shape) == e]
            if e != rule.dim or len(axes_on_e) > 1:
                continue  # on another dim, or nested with other axes on the same one
        if rule.documented == "pending sum" and p == Partial("sum"):
            continue
        if rule.documented == "computed alike" and isinstance(p, Replicate):
            continue
        if rule.rule == "one holder" and isinstance(p, Shard):
            e, holder = p.dim % len(shape), rule.owners[0]
            if all(
                box(actual, shape, mesh, c)[e][0] == box(actual, shape, mesh, c)[e][1]
                for c in coordinates(mesh)
                if c[rule.axis] != holder
            ):
                continue
        if not (isinstance(p, Shard) and p.dim % len(shape) == rule.dim):
            return (
                f"mesh axis {rule.axis} is {p}; expected Shard({rule.dim}) ({rule.text}: "
                f"{_owners_text(rule.owners)})"
            )
        for coordinate in coordinates(mesh):
            start, stop = box(actual, shape, mesh, coordinate)[rule.dim]
            misplaced = [
                j
                for j in range(start, stop)
                if rule.owners[j] is not None and rule.owners[j] != coordinate[rule.axis]
            ]
            if misplaced:
                return (
                    f"the rank at {coordinate} holds dim {rule.dim} indices {misplaced[:6]} "
                    f"owned by coordinates {[rule.owners[j] for j in misplaced[:6]]} of mesh "
                    f"axis {rule.axis} ({rule.text}: {_owners_text(rule.owners)})"
                )
    return ""


def _owners_text(owners: Sequence[int | None]) -> str:
    """``0x3 ?x1 1x4``: runs of owners along a dim (``?``: any)."""
    runs: list[list] = []
    for o in owners:
        if runs and runs[-1][0] == o:
            runs[-1][1] += 1
        else:
            runs.append([o, 1])
    return " ".join(f"{'?' if o is None else o}x{n}" for o, n in runs)


__all__ = [
    "PENDING_SUMS",
    "SCATTERED_BY_WINDOWS",
    "AxisRule",
    "ExpectedLayout",
    "PendingSum",
    "WindowAnchor",
    "axis_rules",
    "cell_owners",
    "counted",
    "documented",
    "every_shard_even",
    "held_where",
    "interpolation_anchors",
    "module_anchors",
    "on_multiples",
    "over_sharded_axes",
    "owned",
    "pad_anchors",
    "parse",
    "reduced",
    "renamed",
    "transposed_anchor",
    "window_anchor",
    "window_covers",
    "windowed",
]
