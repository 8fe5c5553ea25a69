"""``aten.constant_pad_nd`` (``torch.constant_pad_nd``, and the backward of every constant
pad: the same op with the pads negated) on sharded dims, keeping the input's layout.

``F.pad`` is taken before it reaches aten (``_conv_ops._pad``); this is the aten op itself,
which DTensor replicates. The rule is the pad's window rule (NOTE [Which rank owns an output
of a windowed op] in ``_windows``, a window of one cell anchored on ``j - left``): negative
pads crop (a slice of the ShardTensor, which keeps the placements), then each rank gathers the
cells its outputs copy, the padding cells materialised with ``value`` by the edge shards. A
cell of the input moves only where the window rule gives it to a neighbour (an empty shard's
neighbour), never to every rank.

``crop_then_pad`` and ``cropped`` are shared with ``F.pad``'s handler (``_conv_ops._pad``):
a pad by negative amounts, in any mode, is taken as a crop then a pad wherever torch's
result is that composition.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from shardsci.tensor._api import ShardTensor
from shardsci.tensor._binding import bind
from shardsci.tensor._ops._common import accepts
from shardsci.tensor._ops._windows import Window, gather_windows, output_spec
from shardsci.tensor._registry import register_aten_handler
from shardsci.tensor._shape_probe import probe_on_meta

aten = torch.ops.aten


@register_aten_handler(aten.constant_pad_nd.default)
def _constant_pad_nd(func, args, kwargs):
    a = bind(func, args, kwargs)
    x, pad, value = a.self, list(a.pad), a.value
    if not accepts(x):
        return NotImplemented
    # torch's error for a bad pad list, on every rank before any collective
    shape = list(probe_on_meta(func, (x, pad, value)).shape)
    plan = crop_then_pad("constant", pad, x.shape)
    x = cropped(x, plan)
    windows = pad_windows(plan, x.ndim)
    if not windows:
        return aten.clone.default(x) if x is a.self else x
    spec = x._spec
    boundary = dict.fromkeys(windows, "zeros")
    extended, out_sizes, _ = gather_windows(x._local, spec, windows, boundary, value or 0.0)
    return ShardTensor(extended.contiguous(), output_spec(spec, shape, out_sizes, extended.dtype))


class Crop(NamedTuple):
    """One padded dim of a pad taken as a crop then a pad: keep input cells ``[begin, end)``
    of ``extent``, then pad by ``left``, ``right`` >= 0."""

    begin: int
    end: int
    left: int
    right: int
    extent: int

    @property
    def crops(self) -> bool:
        return self.begin > 0 or self.end < self.extent


def crop_then_pad(mode: str, pad: Sequence[int], shape: Sequence[int]) -> list[Crop] | None:
    """torch's pad of ``shape`` by ``pad`` (negative amounts crop) as a crop then a pad by
    non-negative amounts, one ``Crop`` per padded dim, innermost first;
    None where torch's result is not such a composition.

    torch crops first, then pads from the cells left, in every mode (a circular pad wraps
    within them), with two exceptions. A reflect pad reflects about the input's edge cells,
    which is the cropped cells' reflection only while the pad is shorter than them: None
    beyond. Where the crop leaves no cell, a constant pad is all fill and a replicate pad
    copies the input's cell on the side it pads (one cell kept, padded by one less); circular
    and reflect give None. ``shape`` is the input's, and torch has accepted the pad.
    """
    plan = []
    for i in range(len(pad) // 2):
        left, right, extent = pad[2 * i], pad[2 * i + 1], shape[len(shape) - 1 - i]
        begin, end = max(-left, 0), extent - max(-right, 0)
        left, right = max(left, 0), max(right, 0)
        kept = end - begin
        if kept <= 0 and (left or right):
            out = kept + left + right
            if mode == "constant":
                begin = end = 0
            elif mode == "replicate":
                begin, end, out = (0, 1, out - 1) if left else (extent - 1, extent, out - 1)
            else:
                return None
            left, right = (out, 0) if left else (0, out)
        elif mode in ("circular", "reflect") and max(left, right) > kept - (mode == "reflect"):
            return None
        plan.append(Crop(begin, end, left, right, extent))
    return plan


def cropped(x: ShardTensor, plan: Sequence[Crop]) -> ShardTensor:
    """``x`` sliced to the cells each dim of ``plan`` keeps: the placements are kept, each
    kept cell on the rank that holds it."""
    for i, crop in enumerate(plan):
        if crop.crops:
            x = aten.slice.Tensor(x, x.ndim - 1 - i, crop.begin, crop.end)
    return x


def pad_windows(plan: Sequence[Crop], ndim: int) -> dict[int, Window]:
    """The size-1 windows of the padded dims of a cropped tensor of ``ndim`` dims. A dim
    cropped on one side and padded on the other is shifted (NOTE [Which rank owns an output
    of a windowed op]): its cells stay with their owners."""
    return {
        ndim - 1 - i: Window(1, pad_left=crop.left, pad_right=crop.right, shifted=crop.crops)
        for i, crop in enumerate(plan)
        if crop.left or crop.right
    }
