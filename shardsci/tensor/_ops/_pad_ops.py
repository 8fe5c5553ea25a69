"""``aten.constant_pad_nd`` (``torch.constant_pad_nd``, and the backward of every constant
pad: the same op with the pads negated) on sharded dims, keeping the input's layout.

``F.pad`` is taken before it reaches aten (``_conv_ops._pad``); this is the aten op itself,
which DTensor replicates. The rule is the pad's window rule (NOTE [Which rank owns an output
of a windowed op] in ``_windows``, a window of one cell anchored on ``j - left``): negative
pads crop (a slice of the ShardTensor, which keeps the placements), then each rank gathers the
cells its outputs copy, the padding cells materialised with ``value`` by the edge shards. A
cell of the input moves only where the window rule gives it to a neighbour (an empty shard's
neighbour), never to every rank.
"""

from __future__ import annotations

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
    pairs = [(pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2)]
    for i, (left, right) in enumerate(pairs):
        dim = x.ndim - 1 - i
        begin, end = max(-left, 0), x.shape[dim] - max(-right, 0)
        if begin or end < x.shape[dim]:
            x = aten.slice.Tensor(x, dim, begin, end)
    windows = {
        x.ndim - 1 - i: Window(1, pad_left=max(left, 0), pad_right=max(right, 0))
        for i, (left, right) in enumerate(pairs)
        if left > 0 or right > 0
    }
    if not windows:
        return aten.clone.default(x) if x is a.self else x
    spec = x._spec
    boundary = dict.fromkeys(windows, "zeros")
    extended, out_sizes, _ = gather_windows(x._local, spec, windows, boundary, value or 0.0)
    return ShardTensor(extended.contiguous(), output_spec(spec, shape, out_sizes, extended.dtype))
