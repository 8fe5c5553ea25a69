"""``torch.gradient`` along sharded dims: finite differences on each rank's shard extended by
a halo, the output in the input's layout.

torch computes it as a composite of slices: ``(x[2:] - x[:-2]) / 2h`` inside and one-sided
differences at the edges, joined by a ``cat``. On shards the two slices have different shard
sizes, the difference takes one of them, and the output's boundaries moved by a cell or two
(values right, layout not: the next op redistributes). Here each rank extends its shard
along the differentiated dim by ``edge_order`` cells from its neighbours (never beyond the
domain: at the domain's edges torch's one-sided formulas see the domain's own cells),
differentiates the extended block locally and keeps its own cells: every output cell is
computed where its centre cell lies, the cells moved are the halo's (NOTE [An output cell
belongs to the shard it depends on] in ``tests/expected_layouts.py``). Coordinates given as
``spacing`` tensors are cut to the extended range. Differentiable: the halo's adjoint sends
the gradients of the borrowed cells back to their owners.
"""

from __future__ import annotations

import numbers

import torch

from shardsci.tensor._api import ShardTensor, from_local_spec
from shardsci.tensor._binding import bind
from shardsci.tensor._halo import extend, extension
from shardsci.tensor._ops._common import accepts, connected_empty, dim_layout
from shardsci.tensor._registry import register_function_handler
from shardsci.tensor._shape_probe import probe_on_meta
from shardsci.tensor._spec import ShardTensorSpec


def _gradient_signature(input, *, spacing=None, dim=None, edge_order=1):
    """``torch.gradient``'s overloads: ``spacing`` a number, numbers or coordinates per dim."""


@register_function_handler(torch.gradient)
def _gradient(func, args, kwargs):
    a = bind(func, args, kwargs, signature=_gradient_signature)
    x = a.input
    if not isinstance(x, ShardTensor) or x.ndim == 0:
        return NotImplemented
    dims = range(x.ndim) if a.dim is None else [a.dim] if isinstance(a.dim, int) else a.dim
    dims = [d % x.ndim for d in dims]
    spacing = _per_dim(a.spacing, len(dims))
    if (
        spacing is None
        or any(isinstance(h, ShardTensor) for h in spacing)
        or not accepts(x, sharded=dims, floating=True)
    ):
        return NotImplemented
    probe_on_meta(func, args, kwargs)  # torch's errors (too few cells, spacing), on every rank
    return tuple(_differentiated(x, d, h, a.edge_order) for d, h in zip(dims, spacing))


def _per_dim(spacing: object, count: int) -> list | None:
    """One spacing (a number or a coordinate tensor) per differentiated dim; None to decline
    what this handler does not read (torch's errors then come from the default path)."""
    if spacing is None:
        return [1.0] * count
    if isinstance(spacing, numbers.Number):
        return [spacing] * count
    if (
        isinstance(spacing, (list, tuple))
        and len(spacing) == count
        and all(isinstance(h, (numbers.Number, torch.Tensor)) for h in spacing)
    ):
        return list(spacing)
    return None


def _differentiated(
    x: ShardTensor, dim: int, spacing: float | torch.Tensor, edge_order: int
) -> ShardTensor:
    """``torch.gradient(x, spacing=[spacing], dim=dim, edge_order=edge_order)`` in ``x``'s
    layout (module docstring)."""
    spec: ShardTensorSpec = x._spec
    local = x.to_local()
    if dim in spec.sharding_by_dim:
        sharding, group, starts = dim_layout(spec, dim)
        extent = spec.shape[dim]
        ranges = tuple(
            (max(o - edge_order, 0), min(o + n + edge_order, extent)) if n else (o, o)
            for o, n in zip(starts, sharding.sizes)
        )
        block = extend(local, extension(spec, ((dim, ranges, "zeros"),)))
        first, own = ranges[group.index][0], starts[group.index] - ranges[group.index][0]
    else:
        block, first, own = local, 0, 0
    if local.numel() == 0:
        return from_local_spec(connected_empty(list(local.shape), local, block), spec)
    if isinstance(spacing, torch.Tensor):
        spacing = spacing.narrow(0, first, block.shape[dim])
    out = torch.gradient(block, spacing=[spacing], dim=dim, edge_order=edge_order)[0]
    return from_local_spec(out.narrow(dim, own, local.shape[dim]), spec)
