"""Ops whose result is one Python value for the whole tensor: ``item``, ``equal``,
``allclose``.

Run on the shards, they would answer for each rank's piece only, and differently on each
rank (``item`` of a one-element tensor raises on the ranks whose shard is empty). Here the
answer is computed on the whole tensor: ``item`` reads the value after a move to Replicate
(one element), ``equal`` and ``allclose`` reduce the elementwise comparison over every shard
(one all-reduce of a flag), so every rank returns the same value.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate

from shardsci.tensor._api import ShardTensor
from shardsci.tensor._binding import bind
from shardsci.tensor._registry import register_aten_handler

aten = torch.ops.aten


def _value(t: torch.Tensor) -> bool | int | float | complex:
    if isinstance(t, ShardTensor):
        t = t.redistribute(placements=[Replicate()] * t._spec.mesh.ndim)._local
    return aten._local_scalar_dense.default(t)


@register_aten_handler(aten._local_scalar_dense.default)
def _item(func, args, kwargs):
    return _value(bind(func, args, kwargs).self)


@register_aten_handler(aten.equal.default)
def _equal(func, args, kwargs):
    a = bind(func, args, kwargs)
    if a.self.shape != a.other.shape:
        return False
    return bool(_value(aten.all.default(aten.eq.Tensor(a.self, a.other))))


@register_aten_handler(aten.allclose.default)
def _allclose(func, args, kwargs):
    a = bind(func, args, kwargs)
    close = aten.isclose.default(a.self, a.other, a.rtol, a.atol, a.equal_nan)
    return bool(_value(aten.all.default(close)))
