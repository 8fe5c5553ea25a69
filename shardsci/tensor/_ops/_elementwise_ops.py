"""Elementwise ops that DTensor has no sharding rule for: the backward passes of activations
(hardtanh, hardswish, hardsigmoid, hard/soft shrink, elu, leaky_relu, softplus, rrelu,
log_sigmoid), ``log_sigmoid_forward``, ``hardswish``, ``complex``, ``polar``, prelu, ``normal`` with
tensor means or deviations and ``cauchy`` (each rank draws its own elements, as dropout does).

Each output element depends only on the input elements at the same index, so the op runs on
the shards once every tensor argument is laid out like the output: a ShardTensor of the
output's shape with other boundaries is moved, a plain or replicated one (broadcast to the
output's shape first) is sliced to this rank's block with no communication. An argument with
a pending reduction (Partial) is reduced first. Partly broadcast ShardTensor arguments (sharded
but not of the output's shape) are declined.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardsci.tensor._api import ShardTensor, redistribute
from shardsci.tensor._binding import bind
from shardsci.tensor._ops._common import accepts, reduced_now, sharding_axes
from shardsci.tensor._registry import register_aten_handler
from shardsci.tensor._spec import ShardTensorSpec

__all__ = ["elementwise"]

aten = torch.ops.aten

_ELEMENTWISE = (
    aten.hardtanh_backward.default,
    aten.hardswish.default,
    aten.hardswish_backward.default,
    aten.hardsigmoid_backward.default,
    aten.hardshrink_backward.default,
    aten.softshrink_backward.default,
    aten.elu_backward.default,
    aten.leaky_relu_backward.default,
    aten.softplus_backward.default,
    aten.rrelu_with_noise_backward.default,
    aten.log_sigmoid_forward.default,
    aten.log_sigmoid_backward.default,
    aten.mish_backward.default,
    aten.polar.default,
    aten.complex.default,
    aten._prelu_kernel.default,
    aten.normal.Tensor_Tensor,
    aten.normal.Tensor_float,
    aten.normal.float_Tensor,
    aten.cauchy.default,
)


@register_aten_handler(*_ELEMENTWISE)
def _elementwise(func, args, kwargs):
    return elementwise(func, args, kwargs)


def elementwise(func, args: tuple, kwargs: dict):
    """Run an elementwise ``func`` on the shards (see the module docstring); outputs take the
    layout of the first ShardTensor argument of the output's shape. NotImplemented when an
    argument cannot be laid out so."""
    ran = _run_on_shards(func, args, kwargs)
    if ran is NotImplemented:
        return NotImplemented
    out, spec = ran
    if isinstance(out, tuple):
        return tuple(ShardTensor(o, spec.with_dtype(o.dtype)) for o in out)
    return ShardTensor(out, spec.with_dtype(out.dtype))


def _run_on_shards(func, args: tuple, kwargs: dict):
    """``(local outputs, layout of the output)``, or NotImplemented."""
    if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
        return NotImplemented
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    reference = next((t for t in tensors if isinstance(t, ShardTensor) and t.shape == shape), None)
    if reference is None:  # every ShardTensor is broadcast: the first, expanded, sets the layout
        first = next((t for t in tensors if isinstance(t, ShardTensor)), None)
        if first is None:
            return NotImplemented
        reference = aten.expand.default(first, list(shape))
        args = tuple(reference if a is first else a for a in args)
    spec = reduced_now(reference)._spec
    local_args = []
    for a in args:
        local = _local_like(a, spec, shape) if isinstance(a, torch.Tensor) else a
        if local is NotImplemented:
            return NotImplemented
        local_args.append(local)
    return func(*local_args, **kwargs), spec


def _local_like(t: torch.Tensor, spec: ShardTensorSpec, shape: torch.Size):
    """This rank's block of ``t`` broadcast to ``shape`` and laid out as ``spec``."""
    if isinstance(t, ShardTensor):
        if t.shape == shape:
            t = reduced_now(t)
            return (
                t if t._spec.same_layout(spec) else redistribute(t, spec.with_dtype(t.dtype))
            )._local
        if t._spec.shardings:
            return NotImplemented
        t = reduced_now(t)._local
    if t.ndim == 0:
        return t
    return spec.narrow(t.expand(shape))


@register_aten_handler(aten._prelu_kernel_backward.default)
def _prelu_backward(func, args, kwargs):
    """The input's gradient is elementwise; the weight's sums over the elements each weight
    scales, here over this rank's: partial over the axes that shard dims the weight is
    broadcast along, sharded like the input along the dims it spans (channels)."""
    a = bind(func, args, kwargs)
    grad, x, weight = a.grad_output, a.self, a.weight
    if not accepts(grad, x, weight, partial=True, replicated=[weight]):
        return NotImplemented
    ran = _run_on_shards(func, (grad, x, weight), kwargs)
    if ran is NotImplemented:
        return NotImplemented
    (grad_input, grad_weight), spec = ran
    lead = spec.ndim - weight.ndim
    spanned = {
        s.dim - lead: s for s in spec.shardings if s.dim >= lead and weight.shape[s.dim - lead] > 1
    }
    partial_axes = set(sharding_axes(spec)) - {a for s in spanned.values() for a in s.axes}
    placements = [Partial() if a in partial_axes else Replicate() for a in range(spec.mesh.ndim)]
    for dim, s in spanned.items():
        for a in s.axes:
            placements[a] = Shard(dim)
    weight_spec = ShardTensorSpec.build(
        spec.mesh, placements, weight.shape, grad_weight.dtype,
        {d: s.sizes for d, s in spanned.items()}, order={d: s.axes for d, s in spanned.items()},
    )  # fmt: skip
    return (
        ShardTensor(grad_input, spec.with_dtype(grad_input.dtype)),
        ShardTensor(grad_weight.sum_to_size(weight_spec.local_shape()), weight_spec),
    )
