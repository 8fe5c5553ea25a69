"""Pairwise distances ``torch.cdist`` on points split by rows, batch or feature, ungathered.

``d[..., i, j] = ||x1[..., i, :] - x2[..., j, :]||_p`` for ``x1`` of shape ``(..., P, M)`` and
``x2`` of shape ``(..., R, M)``. Handled at aten's ``_cdist_forward`` and ``_cdist_backward``,
below autograd, so the sharded forward and both gradients are the one pair of kernels, on
shards; and at ``_euclidean_dist`` (p = 2 by matrix products, which ``cdist`` takes past 25
rows), whose backward is a formula of products autograd runs on the shards. Per mesh axis:

- an axis splitting ``x1``'s rows (``P``), ``x2`` not split on it: each rank's rows against
  all of ``x2``; the distances are split on ``P`` alike;
- an axis splitting ``x2``'s rows (``R``), ``x1`` not split on it: the distances are split on
  their last dim by ``x2``'s rows (two such axes, one per input, give 2-D blocks);
- an axis splitting the batch dims, or the feature dim ``M``, of both alike: batch rows stay
  where they are; a split ``M`` makes each rank's distance over its features a partial norm,
  reduced right away (NOTE [A split feature dim of cdist]).

An axis splitting the rows of both inputs, batch dims that broadcast, or inputs split unlike
on a batch or feature dim are gathered (``_gathered_ops``): a ring of ``x2``'s row blocks
(``_ring_product``'s rule) would serve the first and is not written.

# NOTE [A split feature dim of cdist]
A p-norm is not linear, so a pending sum of partial norms would be wrong. Its p-th power is a
sum over features: each rank computes ``sum_k |x1_ik - x2_jk|^p`` over its features, one
all-reduce (sum) of that ``(..., P, R)`` block makes it whole, and the p-th root follows
(``p = 0``: a count of differing features, summed; ``p = inf``: a max, max-reduced). The
inputs never move; the distances are replicated over the feature axes. The backward is
local: ``d d_ij / d x1_ik`` depends on feature ``k`` and the whole ``d_ij`` alone, which every
rank holds.

# NOTE [The gradient of cdist is a pending sum]
``x1``'s gradient sums over ``x2``'s rows: ``g1_ik = sum_j grad_ij d d_ij / d x1_ik``. Where an
axis splits ``x2``'s rows each rank holds the sum over its rows, and ``x1``'s gradient is left
a pending sum over that axis (``Partial``) rather than all-reduced here: a graph's
distances feed several terms whose gradients add into the same tensor, and a replicated
``x2`` (autograd computes its gradient by the same kernel with the inputs swapped, its rows
being ``x1``'s) is typically a parameter or a set of query points whose gradient is summed
once, where it is read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from shardsci.tensor._api import ShardTensor
from shardsci.tensor._binding import bind
from shardsci.tensor._ops._gathered_ops import gathered
from shardsci.tensor._redistribute import redistribute_local
from shardsci.tensor._registry import register_aten_handler
from shardsci.tensor._spec import DimSharding, ShardTensorSpec, replicated_spec

aten = torch.ops.aten


@dataclass(frozen=True)
class _Plan:
    """Where a cdist's work lies, from its inputs' layouts.

    Attributes
    ----------
    shardings : tuple of DimSharding
        The distances' ``(..., P, R)`` shardings.
    features : tuple of int
        Mesh axes splitting the feature dim of both inputs.
    rows2 : tuple of int
        Mesh axes splitting ``x2``'s rows.
    """

    shardings: tuple[DimSharding, ...]
    features: tuple[int, ...]
    rows2: tuple[int, ...]


def _plan(s1: ShardTensorSpec, s2: ShardTensorSpec) -> _Plan | None:
    """The plan for ``x1`` and ``x2`` laid out as ``s1`` and ``s2``, or None to gather."""
    n = s1.ndim
    if s1.partial or s2.partial or s2.ndim != n or s1.shape[:-2] != s2.shape[:-2]:
        return None
    by1, by2 = s1.sharding_by_dim, s2.sharding_by_dim
    if any(by1.get(d) != by2.get(d) for d in (*range(n - 2), n - 1)):
        return None
    rows1, rows2 = by1.get(n - 2), by2.get(n - 2)
    axes1 = {a for s in s1.shardings for a in s.axes}
    axes2 = {a for s in s2.shardings for a in s.axes}
    if (rows1 and set(rows1.axes) & axes2) or (rows2 and set(rows2.axes) & axes1):
        return None
    shardings = [s for s in s1.shardings if s.dim < n - 2]
    if rows1:
        shardings.append(rows1)
    if rows2:
        shardings.append(DimSharding(n - 1, rows2.axes, rows2.sizes))
    features = by1.get(n - 1)
    return _Plan(tuple(shardings), features.axes if features else (), rows2.axes if rows2 else ())


def _distances_spec(
    mesh: DeviceMesh,
    plan: _Plan,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    pending: Placement | None = None,
) -> ShardTensorSpec:
    """The distances' spec: ``plan``'s shardings, ``pending`` (if any) on its feature axes."""
    placements: list[Placement] = [Replicate()] * mesh.ndim
    for axis in plan.features if pending else ():
        placements[axis] = pending
    for s in plan.shardings:
        for axis in s.axes:
            placements[axis] = Shard(s.dim)
    return ShardTensorSpec.build(
        mesh,
        placements,
        shape,
        dtype,
        {s.dim: s.sizes for s in plan.shardings},
        order={s.dim: s.axes for s in plan.shardings},
    )


def _specs(*tensors: object) -> list[ShardTensorSpec]:
    """Each tensor's spec; a plain tensor is replicated on the ShardTensors' mesh."""
    mesh = next(t._spec.mesh for t in tensors if isinstance(t, ShardTensor))
    return [t._spec if isinstance(t, ShardTensor) else replicated_spec(t, mesh) for t in tensors]


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t._local if isinstance(t, ShardTensor) else t).contiguous()


def _laid_out(t: torch.Tensor, spec: ShardTensorSpec) -> torch.Tensor:
    """This rank's shard of ``t`` laid out as ``spec`` (a slice where ``t`` is whole)."""
    spec = spec.with_dtype(t.dtype)
    if not isinstance(t, ShardTensor):
        return spec.narrow(t).contiguous()
    return redistribute_local(t._local, t._spec, spec).contiguous()


@register_aten_handler(aten._cdist_forward.default)
def _cdist_forward(func, args, kwargs):
    a = bind(func, args, kwargs)
    s1, s2 = _specs(a.x1, a.x2)
    plan = _plan(s1, s2)
    if plan is None:
        return gathered(func, args, kwargs)
    p, shape = a.p, (*s1.shape[:-1], s2.shape[-2])
    out = func(_local(a.x1), _local(a.x2), p, a.compute_mode)
    spec = _distances_spec(s1.mesh, plan, shape, out.dtype)
    if not plan.features:
        return ShardTensor(out, spec)
    powered = 0 < p < math.inf
    pending = Partial("max" if p == math.inf else "sum")
    src = _distances_spec(s1.mesh, plan, shape, out.dtype, pending)
    out = redistribute_local(out.pow(p) if powered else out, src, spec)
    return ShardTensor(out.pow(1 / p) if powered else out, spec)


@register_aten_handler(aten._euclidean_dist.default)
def _euclidean_dist(func, args, kwargs):
    """``torch.cdist``'s p = 2 by matrix products (more than 25 rows): as ``p = 2`` above.
    Its backward is a formula of products autograd runs on the shards."""
    a = bind(func, args, kwargs)
    s1, s2 = _specs(a.x1, a.x2)
    plan = _plan(s1, s2)
    if plan is None:
        return NotImplemented  # the default path: the products' own rules
    shape = (*s1.shape[:-1], s2.shape[-2])
    out = func(_local(a.x1), _local(a.x2))
    spec = _distances_spec(s1.mesh, plan, shape, out.dtype)
    if not plan.features:
        return ShardTensor(out, spec)
    src = _distances_spec(s1.mesh, plan, shape, out.dtype, Partial())
    return ShardTensor(redistribute_local(out.square(), src, spec).sqrt(), spec)


@register_aten_handler(aten._cdist_backward.default)
def _cdist_backward(func, args, kwargs):
    a = bind(func, args, kwargs)
    s1, s2, dist = _specs(a.x1, a.x2, a.cdist)
    plan = _plan(s1, s2)
    if plan is None:
        return gathered(func, args, kwargs)
    spec = _distances_spec(s1.mesh, plan, dist.shape, dist.dtype)
    grad, cdist = _laid_out(a.grad, spec), _laid_out(a.cdist, spec)
    out = func(grad, _local(a.x1), _local(a.x2), a.p, cdist)
    out_spec = ShardTensorSpec.from_shardings(
        s1.mesh, s1.shardings, s1.shape, out.dtype, pending=plan.rows2
    )
    return ShardTensor(out, out_spec)
