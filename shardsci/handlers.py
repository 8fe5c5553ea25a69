"""Writing a handler: the public API for giving an op a shard-aware implementation.

A handler is ``handler(func, args, kwargs)``, registered for the ops it implements, that
returns the op's result as ShardTensors or ``NotImplemented`` to decline (the op then takes the
default path: DTensor's placement rules with shardsci's shard sizes). The how-to, with a
complete example, is ``docs/handlers.md``. The pieces:

- :func:`register_function_handler` (above autograd: compose differentiable ops, the backward
  comes from autograd) and :func:`register_aten_handler` (below autograd: one aten overload,
  its backward ops need handlers of their own). A second handler for one op warns
  (:class:`DuplicateHandlerWarning`) unless ``replace=True``.
- :func:`scoped_handlers`: registrations made inside the block are undone when it ends, so a
  test's handler does not outlive the test.
- :func:`bind`: the call's arguments by parameter name, defaults filled in; the one way a
  handler reads them.
- :func:`accepts`: whether the handler takes the call, from the layouts of its arguments
  (which must be ShardTensors, which dims must be sharded or whole, Partial inputs, dtypes,
  replicated parameters); the one way a handler decides to decline, alike on every rank.
- ``x.local`` (the shard, outside autograd), ``x.to_local()`` (the shard, differentiable) and
  ``x.spec`` (the :class:`ShardTensorSpec` layout, the same on every rank) of a ShardTensor.
- :func:`sum_over_shards`: a differentiable sum of per-shard partial results over the ranks
  that hold the shards of one dim (counted by ``shardsci.comm_counter``).
- :func:`from_local_spec`: the differentiable ShardTensor of this rank's result shard and
  its layout.
"""

from __future__ import annotations

from typing import Any

import torch

from shardsci.tensor._api import ShardTensor
from shardsci.tensor._api import from_local_spec as _from_local_spec
from shardsci.tensor._binding import Arguments, bind
from shardsci.tensor._collectives import AxisGroup, all_reduce, axis_group
from shardsci.tensor._ops._common import accepts
from shardsci.tensor._registry import (
    DuplicateHandlerWarning,
    register_aten_handler,
    register_function_handler,
    scoped_handlers,
)
from shardsci.tensor._spec import ShardTensorSpec

__all__ = [
    "Arguments",
    "DuplicateHandlerWarning",
    "ShardTensor",
    "ShardTensorSpec",
    "accepts",
    "bind",
    "from_local_spec",
    "register_aten_handler",
    "register_function_handler",
    "scoped_handlers",
    "sum_over_shards",
]


def from_local_spec(local: torch.Tensor, spec: ShardTensorSpec) -> ShardTensor:
    """The ShardTensor whose shard on this rank is ``local``, laid out by ``spec``.

    Differentiable (the gradient of the result flows back to ``local``) and free of
    communication: ``spec`` already states every rank's shard sizes. The result's dtype is
    ``local``'s.

    Parameters
    ----------
    local : Tensor
        This rank's shard of the result, shape ``spec.local_shape()``.
    spec : ShardTensorSpec
        The result's layout, e.g. an input's ``x.spec`` for an output laid out like it.

    Raises
    ------
    ValueError
        When ``local`` is not the shard ``spec`` gives this rank: a bug in the handler, caught
        before the wrong sizes reach a collective.
    """
    expected = spec.local_shape()
    if local.shape != expected:
        raise ValueError(
            f"a handler's result shard has shape {tuple(local.shape)}, but its spec {spec} "
            f"gives this rank a shard of shape {tuple(expected)}"
        )
    if local.dtype != spec.dtype:
        spec = spec.with_dtype(local.dtype)
    return _from_local_spec(local, spec)


def sum_over_shards(local: torch.Tensor, spec: ShardTensorSpec, dim: int) -> torch.Tensor:
    """The sum of ``local`` over the ranks that hold the shards of ``dim`` of ``spec``.

    For a reduction along a sharded dim: each rank reduces its shard, and this adds up the
    partial results of the ranks along the mesh axes sharding ``dim`` (one all-reduce,
    counted by ``shardsci.comm_counter``); every one of them gets the total. ``local`` itself
    when ``dim`` is not sharded. Differentiable: the gradient is summed the same way, since
    each rank's partial result feeds every rank's total.

    Every rank along those axes must call it with a tensor of the same shape: decide whether
    to from the spec, which all ranks share, or the ranks that call it wait for the others.

    Parameters
    ----------
    local : Tensor
        This rank's partial result, e.g. ``x.to_local().sum(dim, keepdim=True)``.
    spec : ShardTensorSpec
        The layout of the tensor reduced (``x.spec``).
    dim : int
        The tensor dim reduced.
    """
    sharding = spec.sharding_by_dim.get(dim % max(spec.ndim, 1))
    if sharding is None:
        return local
    return _SumOverShards.apply(local, axis_group(spec.mesh, sharding.axes))


class _SumOverShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: AxisGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return all_reduce(local, group, "sum")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return all_reduce(grad, ctx.group, "sum"), None
