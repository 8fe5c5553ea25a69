"""Output layouts the op tests state (NOTE [An output's layout is stated] in
``shardsci/testing/_reference.py``), worked out from the documented rules, not by the library.

- :func:`parse` reads a layout written out in short form, for outputs no simple rule covers.
- :func:`renamed`, :func:`reduced` follow sharded dims through views and reductions.
- :func:`windowed` gives each output cell of a windowed op (convolution, pooling, padding,
  interpolation) to the rank holding the input cell it is anchored on (NOTE [Which rank owns
  an output of a windowed op] in ``shardsci/tensor/_ops/_windows.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor._ops._math_ops import _NormPartial

from shardsci.testing import ExpectedLayout, Layout
from tests.boxes import dim_shardings

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
    0 over both axes; ``"R,P"`` is (Replicate, Partial sum); ``"S1,S0; 0=1/3; 1=2/1"``. Tokens:
    ``S<dim>``, ``R``, ``P`` (sum), ``Pavg``, ``Pmax``, ``Pmin``, ``Pnorm`` (the 2-norm partial).
    """
    head, *dims = [part.strip() for part in text.split(";")]
    placements = tuple(
        Shard(int(token[1:])) if token.startswith("S") else _PLACEMENTS[token]
        for token in (t.strip() for t in head.split(","))
    )
    sizes = {}
    for part in dims:
        dim, values = part.split("=")
        sizes[int(dim)] = tuple(int(v) for v in values.split("/"))
    return Layout(placements, sizes)


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


def owned(sizes: Sequence[int], anchors: Sequence[int]) -> tuple[int, ...]:
    """Shard sizes of an output whose cell ``j`` belongs to the shard holding input cell
    ``anchors[j]`` (clamped into the domain; empty shards hold no cell)."""
    extent = sum(sizes)
    bounds = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    result = [0] * len(sizes)
    for anchor in anchors:
        cell = min(max(anchor, 0), extent - 1)
        result[next(k for k in range(len(sizes)) if bounds[k] <= cell < bounds[k + 1])] += 1
    return tuple(result)


def windowed(
    layout: Layout, shape: Sequence[int], mesh: Sequence[int], anchors: Mapping[int, Anchor]
) -> Callable[[Sequence[int]], Layout]:
    """The output layout, given the output's shape: dim ``d`` with an anchor rule gives output
    cell ``j`` to the rank holding input cell ``anchors[d](j)``; other dims keep their sizes."""

    def of(out_shape: Sequence[int]) -> Layout:
        sizes = _sizes(layout, shape, mesh)
        for d, anchor in anchors.items():
            if d in sizes:
                sizes[d] = owned(sizes[d], [anchor(j) for j in range(out_shape[d])])
        return Layout(layout.placements, sizes, layout.order)

    return of


def window_anchor(kernel: int, stride: int, padding: int, dilation: int) -> Anchor:
    """A sliding window's centre, rounded down: output ``j`` reads from ``j stride - padding``."""
    return lambda j: j * stride - padding + dilation * (kernel - 1) // 2


def transposed_anchor(kernel: int, stride: int, padding: int, dilation: int) -> Anchor:
    """An upsampling window: output ``i`` is centred on input ``(i + p - d (k - 1) // 2) // s``."""
    return lambda i: (i + padding - dilation * (kernel - 1) // 2) // stride


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


__all__ = [
    "ExpectedLayout",
    "counted",
    "every_shard_even",
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
    "windowed",
]
