"""A linear layer on the shards in one autograd node.

NOTE [A linear layer is one autograd node]
Where each rank multiplies its own rows by the whole weight (the input's features unsplit, no
pending sum, no ring, no held dim) and adds the bias, if any, inside the kernel (NOTE [A
linear layer runs torch's linear on the shards] in ``_matmul_ops``), and where it multiplies
its own term of a pending sum (NOTE [A linear layer of a pending sum runs on each rank's
term]), ``F.linear`` on a ShardTensor records one autograd Function. The composition records
up to four Python Functions (the input's ``to_local``, the weight's and the bias's
promotions, the output's ``from_local``; two on a mesh of one rank) and torch's own nodes for
the local product (a 3-D input's views, ``t`` and ``addmm``), and a Python Function's apply
was the largest single cost of a step (13-19 % of a one-rank ViT or Transolver step,
``benchmarks/records/2026-11-29-host-cost-per-call``).
The node's forward is torch's linear of the local blocks; its backward computes the local
gradients as torch's linear backward does and returns each as the composition would:
- the input's as its shard, laid out as the input with Partial on the mesh axes that shard
  the output where it was Replicate (``_matmul_ops._grad_placements``);
- a plain weight's and bias's through their promotion (``promoted_gradient``: handed to a
  gradient sink, summed over the mesh now, or, on a mesh of one rank with no sink, as it is);
- a replicated ShardTensor weight's or bias's as its pending sum over those axes.
A backward that builds a graph (``create_graph=True``) recomputes the composition from the
saved inputs and differentiates it, so that second derivatives are the composition's. Under
torch.compile the composition is traced (its nodes end in one graph there).
Under autocast the composition runs instead (``_matmul_ops._linear``): torch's own nodes save
the copies autocast cast to bfloat16 or float16 for the backward, where this node would save
its float32 input and weight and recompute outside autocast. Measured before that rule: every
bf16 step with a linear layer raised in this backward (an H200, ``scripts/gpu_check.sh``,
2026-11-29), and with the dtypes mended the node saved 1.36-1.46x the bytes for backward that
plain torch does (one-rank ViT and Transolver; ``tests/test_autocast.py`` checks both).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement

from shardsci.tensor._api import ShardTensor, _as_placed, local_gradient
from shardsci.tensor._promotion import Promotion, promoted_gradient, promotion_of
from shardsci.tensor._spec import ShardTensorSpec

__all__ = ["LinearPlan", "linear_node"]


@dataclass(frozen=True)
class LinearPlan:
    """The layouts of a linear layer run as one node (NOTE above), the same for every call
    with the same operand layouts.

    Attributes
    ----------
    output : ShardTensorSpec
        The output's layout, ``(*B, O)`` for an input ``(*B, I)``.
    input_grad : ShardTensorSpec
        The layout the input's gradient is returned in.
    weight_grad : tuple of Placement
        The placements a weight's or bias's local gradient is read with: Partial on the mesh
        axes that shard the output, else Replicate.
    """

    output: ShardTensorSpec
    input_grad: ShardTensorSpec
    weight_grad: tuple[Placement, ...]


def linear_node(
    x: ShardTensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    plan: LinearPlan,
    composed: Callable[[ShardTensor, torch.Tensor, torch.Tensor | None], ShardTensor],
) -> ShardTensor:
    """``F.linear(x, weight, bias)`` of a ShardTensor ``x`` (shape ``(*B, I)``) and a whole
    ``weight`` ``(O, I)`` and ``bias`` ``(O,)``, plain or replicated ShardTensors, in one
    autograd node; ``composed`` is the same product as the composition of NOTE above, which a
    backward that builds a graph differentiates instead."""
    mesh = plan.output.mesh
    routes = (
        _gradient_route(weight, mesh, plan.weight_grad),
        _gradient_route(bias, mesh, plan.weight_grad),
    )
    return _LinearNode.apply(x, weight, bias, plan, routes, composed)


# How a weight's or bias's local gradient is returned: a ShardTensor's as a pending sum laid
# out as the spec; a plain tensor's through its promotion (None: as it is).
_Route = ShardTensorSpec | Promotion | None


def _gradient_route(
    t: torch.Tensor | None, mesh: DeviceMesh, placements: Sequence[Placement]
) -> _Route:
    if t is None or not (t.requires_grad and torch.is_grad_enabled()):
        return None
    if isinstance(t, ShardTensor):
        return _as_placed(t._spec, tuple(placements))
    return promotion_of(t, mesh, placements)


def _routed(route: _Route, grad: torch.Tensor) -> torch.Tensor | None:
    if isinstance(route, ShardTensorSpec):
        return ShardTensor(grad, route.with_dtype(grad.dtype))
    return promoted_gradient(route, grad)


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t._local if isinstance(t, ShardTensor) else t


class _LinearNode(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: ShardTensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        plan: LinearPlan,
        routes: tuple[_Route, _Route],
        composed: Callable,
    ) -> ShardTensor:
        out = F.linear(x._local, _local(weight), _local(bias))
        ctx.save_for_backward(x, weight, bias)
        ctx.plan, ctx.routes, ctx.composed = plan, routes, composed
        return ShardTensor(out, plan.output.with_dtype(out.dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, weight, bias = ctx.saved_tensors
        if torch.is_grad_enabled():
            return (*_composed_gradients(ctx, x, weight, bias, grad), None, None, None)
        plan = ctx.plan
        g = local_gradient(grad, plan.output)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        rows = g.reshape(-1, g.shape[-1])  # a copy of a broadcast gradient, made once
        if need_x:
            w = _local(weight)
            local = rows.mm(w).view(*g.shape[:-1], w.shape[-1])  # an empty shard: no -1
            grad_x = ShardTensor(local, plan.input_grad.with_dtype(g.dtype))
        if need_w:
            x_rows = x._local.reshape(-1, x._local.shape[-1])
            grad_w = _routed(ctx.routes[0], rows.t().mm(x_rows))
        if need_b:
            grad_b = _routed(ctx.routes[1], rows.sum(0))
        return grad_x, grad_w, grad_b, None, None, None


def _composed_gradients(
    ctx: Any,
    x: ShardTensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    grad: torch.Tensor,
) -> list[torch.Tensor | None]:
    """The gradients of the composition, differentiable (``create_graph=True``)."""
    inputs = [t for t, need in zip((x, weight, bias), ctx.needs_input_grad) if need]
    out = ctx.composed(x, weight, bias)
    found = iter(torch.autograd.grad(out, inputs, grad, create_graph=True, allow_unused=True))
    return [next(found) if need else None for need in ctx.needs_input_grad[:3]]
