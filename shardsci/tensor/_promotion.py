"""Replicated operands (module weights) entering a sharded computation, and where their
gradients are summed.

# NOTE [Where the gradient of a replicated parameter is summed]
A plain tensor that requires grad and meets a ShardTensor (a module's weight) enters the
sharded computation replicated, through ``promote_replicated``; every handler that takes such
an operand calls it (``__torch_function__``'s generic promotion, ``replicated_local``, the
norms' and einsum's parameters). The backward of a use hands the promotion this rank's
contribution, a gradient that is Partial (or Shard, or Replicate) over the mesh axes: the
weight's gradient is the sum of the contributions over the mesh. It is summed one of two ways.

- **Eager** (the default): the promotion's backward redistributes its contribution to
  Replicate at once (an all-reduce per use, issued synchronously in backward), so whatever
  reaches the weight through autograd is complete.
- **Deferred**: while a *gradient sink* is active and claims the weight
  (``shardsci.parallel``'s reducer claims the parameters of the model it wraps, during that
  model's forward), the promotion's backward converts its contribution to a partial sum
  over the sink's mesh (``partial_contribution``: a local tensor of the weight's shape whose
  sum over the mesh is the gradient) and hands it to the sink, returning no gradient to
  autograd. The sink sums contributions of many weights in a few bucketed collectives
  overlapped with backward, and writes finished gradients.

The rule the deferred mode keeps: **a partial sum never reaches ``.grad``**. Contributions
travel beside autograd, into the sink's buffers, and the sink writes ``.grad`` only with
reduced values (NOTE [A reducer's gradients are final or absent] in
``shardsci/parallel/_reducer.py``). A use the sink cannot finish falls back to eager, decided
in backward where it is known: a backward that builds a graph (``create_graph=True``: the
gradient must stay differentiable) and ``torch.autograd.grad`` (its result is captured from
autograd, never written to ``.grad``); and, in forward, a ShardTensor on another mesh than
the sink's, a tensor the sink does not own (a weight derived from a parameter, ``w.t()`` or a
parametrisation: its gradient must flow back through autograd).

Compiled (``torch.compile`` traced through ShardTensors): while torch.compile traces, no sink can claim
(AOTAutograd runs the promotion on fake tensors, outside the model's forward), so the choice
moves to run time. A traced promotion's backward hands its gradient's local shard, with the
weight saved from forward (the Parameter itself when the compiled backward runs), to
``shardsci::summed_gradient``, an ordered effect: a live sink that owns the weight and can
finish it takes this rank's partial contribution and the op returns zeros; otherwise the op
redistributes the gradient to the weight's layout, as the eager path does (an all-gather for a
sharded gradient: an all-reduce of it padded with zeros sent 1056 bytes where eager sends 672,
``tests/test_torch_compile_through.py``, a positional parameter and no sink). Before, a
compiled ``domain_parallel`` step all-reduced each use in the graph and the reducer again
(the same test, a linear layer used twice: 5 all-reduces, eager 1).
A graph's uses are handed over in one op: AOTAutograd's joint graph passes through
``one_gradient_op_per_graph`` (after AOTAutograd's own joint passes and before a user's
``joint_custom_pass``, so under every backend: NOTE [torch.compile and ShardTensor]), which
replaces its
``summed_gradient`` effects by one ``summed_gradients`` (lists) where the last one was (the
compiled 2-rank ViT step: 56 effect calls, ~46 us each, became one; the same bytes and
collectives, ``tests/test_torch_compile_through.py``, the linear layer used twice and the
convolutions around a GroupNorm).
The weight must reach the op as the Parameter: inductor's layout optimisation fed every op of
a graph, and saved for backward, a channels-last copy of each convolution's weight, which no
sink owns (a convolution and a GroupNorm: 4 all-reduces, eager 2), so inductor declines it
for a graph holding shardsci's ops (``_torch_compile``). A weight the op meets as another tensor is still summed
correctly, in the graph.
"""

from __future__ import annotations

import math
import operator
import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate

from shardsci.tensor import _function_dispatch
from shardsci.tensor._api import (
    ShardTensor,
    _as_placed,
    _as_shard_tensor,
    from_local_spec,
    grad_spec,
    gradient_shard,
    moved_local,
)
from shardsci.tensor._redistribute import redistribute_local
from shardsci.tensor._spec import ShardTensorSpec, mesh_coordinate, replicated_spec
from shardsci.tensor._torch_compat import (
    EffectType,
    _will_engine_execute_node,
    register_effectful_op,
    with_effects,
)
from shardsci.tensor._torch_compile import allow_in_graph, in_graph

__all__ = [
    "GradientSink",
    "Promotion",
    "gradient_sink",
    "one_gradient_op_per_graph",
    "partial_contribution",
    "promote_replicated",
    "promoted_gradient",
    "promoted_local",
    "promotion_of",
]


class GradientSink(Protocol):
    """Where deferred gradient contributions go (see the NOTE above)."""

    def claim(self, tensor: torch.Tensor, mesh: DeviceMesh) -> int | None:
        """The sink's index for ``tensor`` promoted onto ``mesh``, or None (eager)."""

    def accumulator(self, index: int) -> Any:
        """The autograd ``AccumulateGrad`` node of the tensor at ``index``."""

    def accept(self, index: int, contribution: torch.Tensor) -> None:
        """Add a partial sum over the sink's mesh to the tensor at ``index``."""


_SINK: list[GradientSink | None] = [None]
# Sinks alive in this process: a compiled backward looks up the one that owns a weight.
_LIVE_SINKS: weakref.WeakSet[Any] = weakref.WeakSet()
# The specs of traced promotions and of their gradients, by the indices their backward's op
# carries (a custom op takes no spec). An intern table, not a cache (NOTE [Caches are keyed
# by value]): compiled graphs hold its indices, so an entry is never evicted nor cleared; one
# per distinct layout a promotion or its gradient was traced with in this process.
_TRACED_SPECS: list[ShardTensorSpec] = []
# Whether this process has said that parameter gradients are summed one use at a time.
_EAGER_SUMS_SAID = [False]


def register_sink(sink: GradientSink) -> None:
    """Make ``sink`` reachable from compiled backward graphs while it lives."""
    _LIVE_SINKS.add(sink)


def unregister_sink(sink: GradientSink) -> None:
    _LIVE_SINKS.discard(sink)


@contextmanager
def gradient_sink(sink: GradientSink | None) -> Iterator[None]:
    """Promotions inside the block defer the tensors ``sink`` claims."""
    previous = _SINK[0]
    _SINK[0] = sink
    try:
        yield
    finally:
        _SINK[0] = previous


def promote_replicated(tensor: torch.Tensor, mesh: DeviceMesh) -> ShardTensor:
    """``tensor``, held whole by every rank, as a replicated ShardTensor on ``mesh``;
    differentiable, its gradient summed over the mesh (NOTE above)."""
    spec = replicated_spec(tensor, mesh)
    if in_graph() and tensor.requires_grad:
        if mesh.size() > 1:
            return _traced_promotion(tensor, spec)
        # A mesh of one rank sums nothing: the eager road traces to no op, where a traced
        # promotion costs a custom op per use at run time (about 50 us each, 64 a UNet step);
        # a data-parallel reducer reads the gradient as a plain use's.
        return from_local_spec(tensor, spec)
    sink, index = _claimed(tensor, spec)
    if sink is not None:
        return _DeferredPromotion.apply(tensor, spec, sink, index)
    return from_local_spec(tensor, spec)


def promoted_local(
    tensor: torch.Tensor, mesh: DeviceMesh, grad_placements: Sequence[Placement]
) -> torch.Tensor:
    """``promote_replicated(tensor, mesh).to_local(grad_placements=grad_placements)``: a
    weight as the local operand of a computation on shards, its gradient read with
    ``grad_placements`` and summed over the mesh (NOTE above). In eager code one autograd
    node, not two, and no ShardTensor in between: every use of a weight by a handler
    (convolutions, norms, products) takes this path."""
    if in_graph():  # dynamo traces the two nodes (NOTE [torch.compile and ShardTensor])
        return promote_replicated(tensor, mesh).to_local(grad_placements=grad_placements)
    promotion = promotion_of(tensor, mesh, grad_placements)
    if promotion is None:
        return tensor
    return _PromotedLocal.apply(tensor, promotion)


@dataclass(frozen=True)
class Promotion:
    """How the gradient of one use of a weight promoted to ``spec`` is summed: its local
    gradient read as ``local_grad``, handed to ``sink`` at ``index`` or summed now (NOTE
    above)."""

    spec: ShardTensorSpec
    local_grad: ShardTensorSpec
    sink: GradientSink | None
    index: int | None


def promotion_of(
    tensor: torch.Tensor, mesh: DeviceMesh, grad_placements: Sequence[Placement]
) -> Promotion | None:
    """How ``promoted_local`` sums ``tensor``'s gradient; None where the weight is its own
    local operand (NOTE [A mesh of one rank sums nothing]). For an autograd Function that
    uses a weight's local operand directly (``_ops/_linear_node.py``)."""
    spec = replicated_spec(tensor, mesh)
    sink, index = _claimed(tensor, spec)
    if sink is None and math.prod(spec.mesh_shape) == 1:
        return None
    return Promotion(spec, _as_placed(spec, tuple(grad_placements)), sink, index)


def promoted_gradient(promotion: Promotion | None, grad: torch.Tensor) -> torch.Tensor | None:
    """The gradient a use of a weight, promoted as ``promotion``, returns for its local
    gradient ``grad``: ``grad`` itself where the weight was its own local operand, None where
    a sink takes it, else summed over the mesh now."""
    if promotion is None:
        return grad
    shard = gradient_shard(grad, promotion.local_grad.with_dtype(grad.dtype))
    return _summed(shard, promotion.spec, promotion.sink, promotion.index)


# NOTE [A mesh of one rank sums nothing]
# On a mesh of one rank, a weight's gradient summed over the mesh is its one contribution:
# the promotion's backward would redistribute a local gradient to Replicate over axes of
# size 1, which moves nothing. So where no sink claims the weight, ``promoted_local`` hands
# the handler the weight itself, and torch's own backward of the local op accumulates its
# gradient, as in plain torch: one autograd node fewer per use of a weight in forward and in
# backward (a one-rank ViT step: 54 of its 132 autograd Functions). The compiled road does the
# same (``promote_replicated`` under ``in_graph``); a sink that claims the weight still takes
# its contribution.


def _claimed(tensor: torch.Tensor, spec: ShardTensorSpec) -> tuple[GradientSink | None, int | None]:
    """The active sink and its index for ``tensor``, promoted to ``spec``, if it claims it,
    else ``(None, None)``: then the gradient is summed eagerly (said once for a parameter).
    The mesh's size is read from the spec (``DeviceMesh.size`` computes it on every call,
    and every use of a weight asks)."""
    sink = _SINK[0]
    if sink is not None:
        index = sink.claim(tensor, spec.mesh)
        if index is not None:
            return sink, index
    elif (
        isinstance(tensor, nn.Parameter) and tensor.requires_grad and math.prod(spec.mesh_shape) > 1
    ):
        _say_eager_sums_once()
    return None, None


def _say_eager_sums_once() -> None:
    """Warn, once per process and on rank 0 only, that a model trained without
    ``domain_parallel`` pays an all-reduce per use of every parameter in backward."""
    if _EAGER_SUMS_SAID[0] or not torch.is_grad_enabled():
        return
    _EAGER_SUMS_SAID[0] = True
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    warnings.warn(
        "shardsci: a parameter's gradient is all-reduced once per use, synchronously in "
        "backward, because the model is not wrapped; wrap it with "
        "shardsci.parallel.domain_parallel(model, mesh, domain_axes=...) to sum every "
        "parameter's gradient in a few bucketed all-reduces overlapped with backward",
        stacklevel=4,
    )


def partial_contribution(local: torch.Tensor, spec: ShardTensorSpec) -> torch.Tensor:
    """This rank's term of a sum over the mesh that gives whole the gradient whose local
    shard is ``local``, laid out as ``spec``.

    Partial axes keep the local values; Replicate axes keep them on coordinate 0 only; Shard
    axes place the local shard at its offset in zeros. Exact: only zeros are added.

    Returns
    -------
    Tensor
        A local tensor of ``grad``'s global shape.
    """
    coordinate = mesh_coordinate(spec.mesh)
    for axis, placement in enumerate(spec.placements):
        if isinstance(placement, Partial) and placement.reduce_op != "sum":
            raise NotImplementedError(f"a gradient with placement {placement} on axis {axis}")
        if isinstance(placement, Replicate) and coordinate[axis] != 0:
            return local.new_zeros(spec.shape)
    if not spec.shardings:
        return local
    whole = local.new_zeros(spec.shape)
    spec.narrow(whole).copy_(local)
    return whole


def _builds_no_graph_into(accumulator: Any) -> bool:
    """Whether the running backward accumulates into ``.grad`` through ``accumulator``
    without building a graph (not ``create_graph``, not ``torch.autograd.grad``)."""
    if torch.is_grad_enabled():
        return False
    try:
        return _will_engine_execute_node(accumulator)
    except RuntimeError:  # raised for a leaf's node under torch.autograd.grad
        return False


class _DeferredPromotion(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, tensor: torch.Tensor, spec: ShardTensorSpec, sink: GradientSink, index: int
    ) -> ShardTensor:
        ctx.spec, ctx.sink, ctx.index = spec, sink, index
        return ShardTensor(tensor.view_as(tensor), spec)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:  # type: ignore[override]
        return _summed(grad, ctx.spec, ctx.sink, ctx.index), None, None, None


class _PromotedLocal(torch.autograd.Function):
    """A promotion and ``to_local`` in one node (``promoted_local``)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, promotion: Promotion) -> torch.Tensor:  # type: ignore[override]
        ctx.promotion = promotion
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:  # type: ignore[override]
        return promoted_gradient(ctx.promotion, grad), None


def _summed(
    grad: torch.Tensor, spec: ShardTensorSpec, sink: GradientSink | None, index: int | None
) -> torch.Tensor | None:
    """The gradient a promotion to ``spec`` returns for ``grad``: None where ``sink`` takes
    this rank's contribution (NOTE above), else the gradient summed over the mesh now."""
    grad = _as_shard_tensor(grad, spec)
    if sink is not None and _builds_no_graph_into(sink.accumulator(index)):
        sink.accept(index, partial_contribution(grad._local, grad._spec))
        return None
    return moved_local(grad, grad_spec(spec).with_dtype(grad.dtype))


class _TracedPromotion(torch.autograd.Function):
    """A promotion traced by torch.compile: the sink is chosen when the backward runs."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, spec: ShardTensorSpec) -> ShardTensor:  # type: ignore[override]
        ctx.spec = spec
        ctx.save_for_backward(tensor)  # the Parameter itself when the compiled backward runs
        return ShardTensor(tensor.view_as(tensor), spec)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (tensor,) = ctx.saved_tensors
        grad = _as_shard_tensor(grad, ctx.spec)
        keys = [_traced_key(ctx.spec), _traced_key(grad._spec)]
        return torch.ops.shardsci.summed_gradient(grad._local, tensor, *keys), None


def _traced_key(spec: ShardTensorSpec) -> int:
    """``spec``'s index in ``_TRACED_SPECS``, added if new."""
    if spec not in _TRACED_SPECS:
        _TRACED_SPECS.append(spec)
    return _TRACED_SPECS.index(spec)


@allow_in_graph
def _traced_promotion(tensor: torch.Tensor, spec: ShardTensorSpec) -> ShardTensor:
    return _TracedPromotion.apply(tensor, spec)


def _gradient_sum(
    local: torch.Tensor, weight: torch.Tensor, key: int, grad_key: int
) -> torch.Tensor:
    """``weight``'s gradient from this rank's shard ``local`` of the gradient of traced
    promotion ``key`` (laid out as ``grad_key``), decided when the compiled backward runs:
    zeros where a live sink owns ``weight`` and takes this rank's partial contribution (NOTE
    above), else the gradient redistributed to the weight's layout, as eager code does (an
    all-gather for a sharded gradient, not an all-reduce of it padded with zeros).
    Contiguous, as its fake result: inductor lays ``local`` out as it likes (a conv weight's
    channels-last), and the compiled code trusts the fake's strides (NOTE [A traced
    collective is an effect]); and never ``local`` itself, which a custom op may not return."""
    spec, layout = _TRACED_SPECS[key], _TRACED_SPECS[grad_key]
    for sink in list(_LIVE_SINKS):
        index = sink.claim(weight, spec.mesh)
        if index is not None and _builds_no_graph_into(sink.accumulator(index)):
            sink.accept(index, partial_contribution(local, layout))
            return local.new_zeros(spec.shape)
    summed = redistribute_local(local, layout, grad_spec(spec).with_dtype(local.dtype))
    if summed.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
        return summed.clone(memory_format=torch.contiguous_format)
    return summed.contiguous()


@torch.library.custom_op("shardsci::summed_gradient", mutates_args=())
def _summed_gradient(
    local: torch.Tensor, weight: torch.Tensor, key: int, grad_key: int
) -> torch.Tensor:
    """``_gradient_sum`` as an op of a compiled backward."""
    return _gradient_sum(local, weight, key, grad_key)


@_summed_gradient.register_fake
def _(local, weight, key, grad_key):
    return local.new_empty(_TRACED_SPECS[key].shape)


@torch.library.custom_op("shardsci::summed_gradients", mutates_args=())
def _summed_gradients(
    contributions: list[torch.Tensor],
    weights: list[torch.Tensor],
    keys: list[int],
    grad_keys: list[int],
) -> list[torch.Tensor]:
    """``_gradient_sum`` of each entry in one op: every use of a weight in a compiled
    backward (``one_gradient_op_per_graph``)."""
    entries = zip(contributions, weights, keys, grad_keys, strict=True)
    return [_gradient_sum(*entry) for entry in entries]


@_summed_gradients.register_fake
def _(contributions, weights, keys, grad_keys):
    return [c.new_empty(_TRACED_SPECS[key].shape) for c, key in zip(contributions, keys)]


register_effectful_op(torch.ops.shardsci.summed_gradient.default, EffectType.ORDERED)
register_effectful_op(torch.ops.shardsci.summed_gradients.default, EffectType.ORDERED)


def one_gradient_op_per_graph(module: torch.fx.GraphModule, inputs: Any) -> torch.fx.GraphModule:
    """``module`` (AOTAutograd's joint graph, ``inputs`` its inputs) with its
    ``summed_gradient`` effects, one per use of a weight (~46 us each through the effect
    wrapper), replaced by one ``summed_gradients`` where the last of them was, and what reads
    the earlier ones' gradients (a sum over uses) moved after it; unchanged where the last one
    needs any of that."""
    graph = module.graph
    single = torch.ops.shardsci.summed_gradient.default
    nodes = [n for n in graph.nodes if n.target is with_effects and n.args[1] is single]
    if len(nodes) < 2:
        return module
    last = nodes[-1]
    outputs = [{user.args[1]: user for user in n.users} for n in nodes]  # 0: token, 1: gradient
    later = {out[1] for out in outputs[:-1] if 1 in out}
    moved = []
    for node in graph.nodes:
        if node is last:
            break
        if node not in later and any(a in later for a in node.all_input_nodes):
            later.add(node)
            moved.append(node)
    needed, stack = set(), [a for n in nodes for a in n.all_input_nodes]
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    if needed & later:
        return module
    for node, out in zip(nodes[:-1], outputs[:-1]):  # out of the effect chain
        if 0 in out:
            out[0].replace_all_uses_with(node.args[0])
    columns = [list(column) for column in zip(*(n.args[2:] for n in nodes))]
    values = [out[1].meta.get("val") if 1 in out else None for out in outputs]
    with graph.inserting_before(last):
        batch = graph.call_function(
            with_effects, (last.args[0], torch.ops.shardsci.summed_gradients.default, *columns)
        )
        token = graph.call_function(operator.getitem, (batch, 0))
        gradients = graph.call_function(operator.getitem, (batch, 1))
        results = [graph.call_function(operator.getitem, (gradients, i)) for i in range(len(nodes))]
    token.meta["val"] = outputs[-1][0].meta.get("val") if 0 in outputs[-1] else None
    gradients.meta["val"] = values
    batch.meta["val"] = (token.meta["val"], values)
    for result, value in zip(results, values):
        result.meta["val"] = value
    if 0 in outputs[-1]:
        outputs[-1][0].replace_all_uses_with(token)
    for out, result in zip(outputs, results):
        if 1 in out:
            out[1].replace_all_uses_with(result)
    after = results[-1]
    for node in moved:
        after.append(node)
        after = node
    for node in reversed(nodes):
        for user in list(node.users):
            graph.erase_node(user)
        graph.erase_node(node)
    graph.lint()
    module.recompile()
    return module


_function_dispatch.bind_promotion(ShardTensor, promote_replicated)
