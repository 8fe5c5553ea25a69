"""``F.scaled_dot_product_attention`` on ShardTensors, the sequence dim sharded or not.

DTensor has no sharding rule for it: the default path decomposed the op (about 20 s of CPU
planning on first use, 257 s with a mask) and ran the fused CPU kernel on empty local queries
(SIGFPE). Here every call on a ShardTensor is handled:

1. The call is checked on meta tensors first, so bad shapes fail on every rank, before any
   collective, with torch's own message; ``dropout_p > 0`` is refused the same way.
2. Layouts are aligned to the query's: the query keeps its sharding of batch, head and sequence
   (L) dims (a Partial, or a head dim with grouped-query attention, are made whole first; a
   split feature dim moves, NOTE [A split feature dim moves to the rows]); key and value get the query's batch and head shardings and their key (S)
   dim is sharded over the mesh axes that shard L, in their own sizes when they already are
   (self-attention: no data moves), else ``torch.chunk``'s. A mask gets the query's shardings of
   the dims it does not broadcast along, and keeps every key; its gradient (float masks) comes
   back the same way.
3. ``_ring_attention`` computes each rank's query block against every key: locally when L is
   not sharded, else over the group of ranks along L's axes by the ring or the all-gather
   (NOTE [Ring or all-gather], in ``_ring``). The output has the query's layout.

NOTE [A split feature dim moves to the rows]
Every score reads a query's and a key's whole feature dim E. Where the caller splits E (a
channel-split field whose channels are the features), gathering E would give every rank whole
queries, keys and values; completing partial scores instead (one all-reduce of the L x S scores
per head, forward, and of ``dO v^T`` backward) receives more bytes than that gather wherever
L > E. So the axes splitting E split the rows instead, by one all-to-all of q, k and v each:
the largest batch or head dim no axis splits (``torch.chunk``'s sizes), where it has a row for
every rank of those axes, else L itself (nested inside L's own axes, keys' S alike, so the
ring runs over both). Attention is then local along those axes, and the output moves back to
the query's layout, its last dim E_v split like E (one all-to-all): no rank holds more than
its share of any operand. ``F.multi_head_attention_forward`` moves a split embedding dim the
same way before its in-projection, which contracts it (``_multi_head_attention``).

The CPU fused kernel's two aten ops (forward, backward) are handled the same way, for the
callers that reach them below ``__torch_function__`` (``nn.MultiheadAttention``).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from shardsci.tensor._api import ShardTensor, from_local_spec, grad_spec, redistribute
from shardsci.tensor._binding import bind, replaced
from shardsci.tensor._caches import cached
from shardsci.tensor._collectives import axis_group
from shardsci.tensor._gather_guard import asked_for
from shardsci.tensor._ops._common import accepts, unsplit
from shardsci.tensor._ops._ring import ring_chosen
from shardsci.tensor._ops._ring_attention import (
    AttentionPlan,
    attend,
    attention_backward,
    attention_forward,
)
from shardsci.tensor._registry import register_aten_handler, register_function_handler
from shardsci.tensor._shape_probe import probe_on_meta
from shardsci.tensor._spec import (
    DimSharding,
    ShardTensorSpec,
    nested_chunk_sizes,
    replicated_spec,
)

aten = torch.ops.aten


# ---------------------------------------------------------------------------- handlers
@register_function_handler(F.scaled_dot_product_attention)
def _scaled_dot_product_attention(func, args, kwargs):
    a = bind(func, args, kwargs)
    q, k, v, mask = a.query, a.key, a.value, a.attn_mask
    dropout_p, is_causal, scale, enable_gqa = a.dropout_p, a.is_causal, a.scale, a.enable_gqa
    if not accepts(q, k, v, mask, partial=True):
        return NotImplemented
    out = _probe(
        func, (q, k, v), mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa,
    )  # fmt: skip
    _check_dropout(dropout_p)
    q, k, v = _broadcast_batch_dims(q, k, v, enable_gqa)
    call = _Aligned.build(q, k, v, mask, scale, is_causal, enable_gqa)
    local = attend(call.q.to_local(), call.k.to_local(), call.v.to_local(), call.mask, call.plan)
    return call.returned(from_local_spec(local, call.output_spec(out.shape, local.dtype)))


def _broadcast_batch_dims(q, k, v, enable_gqa: bool) -> tuple:
    """Query, key and value expanded to the same batch dims, as SDPA broadcasts them (a 3-D
    query against 4-D keys): the layouts below index dims from the front. With grouped-query
    attention the head dims stay as they are."""
    per_item = 3 if enable_gqa and min(t.ndim for t in (q, k, v)) >= 3 else 2
    batches = [t.shape[:-per_item] for t in (q, k, v)]
    if batches[0] == batches[1] == batches[2]:
        return q, k, v  # the common case, without torch.broadcast_shapes (tens of us a call)
    batch = torch.broadcast_shapes(*batches)
    return tuple(
        t if t.shape[:-per_item] == batch else t.expand(*batch, *t.shape[-per_item:])
        for t in (q, k, v)
    )


# Fused kernels reached from inside composite functions (``F.multi_head_attention_forward``
# runs with ShardTensor's ``__torch_function__`` disabled, so its SDPA call arrives here, below
# autograd): the same computation, its forward and backward as two ops.
_FLASH_CPU = aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_CPU_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


@register_aten_handler(_FLASH_CPU)
def _flash_attention_cpu(func, args, kwargs):
    a = bind(func, args, kwargs)
    q, k, v, mask, scale = a.query, a.key, a.value, a.attn_mask, a.scale
    dropout_p, is_causal = a.dropout_p, a.is_causal
    out_meta, lse_meta = _probe(func, (q, k, v), mask, dropout_p, is_causal, scale=scale)
    _check_dropout(dropout_p)
    with torch.no_grad():
        call = _Aligned.build(q, k, v, mask, scale, is_causal, False)
        out, lse, _ = attention_forward(
            call.q._local, call.k._local, call.v._local, call.mask, call.plan
        )
    return (
        call.returned(ShardTensor(out, call.output_spec(out_meta.shape, out.dtype))),
        ShardTensor(lse.to(lse_meta.dtype), call.output_spec(lse_meta.shape, lse_meta.dtype)),
    )


@register_aten_handler(_FLASH_CPU_BACKWARD)
def _flash_attention_cpu_backward(func, args, kwargs):
    a = bind(func, args, kwargs)
    grad_out, q, k, v, out, lse = a.grad_out, a.query, a.key, a.value, a.out, a.logsumexp
    mask, scale, dropout_p, is_causal = a.attn_mask, a.scale, a.dropout_p, a.is_causal
    _check_dropout(dropout_p)
    with torch.no_grad():
        call = _Aligned.build(q, k, v, mask, scale, is_causal, False)
        grad_out, out, lse = (
            _moved(_as_shard_tensor(t, call.mesh), call.output_spec(t.shape, t.dtype))._local
            for t in (grad_out, out, lse)
        )
        grads = attention_backward(
            grad_out, call.q._local, call.k._local, call.v._local, call.mask, call.plan,
            out, lse, None, False,
        )  # fmt: skip
        return tuple(
            _returned(grad, aligned, given)
            for grad, aligned, given in zip(grads[:3], (call.q, call.k, call.v), (q, k, v))
        )


@register_function_handler(F.multi_head_attention_forward)
def _multi_head_attention(func, args, kwargs):
    """NOTE [A split feature dim moves to the rows], before the in-projection: it contracts
    the embedding dim E, so with E split each rank would hold every feature of its tokens'
    projections as a pending sum (a gather the guard reports), which the reshapes into heads
    reduce to Replicate. Instead a query, key or value whose E is split moves those
    axes onto its batch dim N where N has a row for each of their ranks, else onto its
    tokens, nested inside their own axes (one all-to-all each, every rank keeping its share:
    no gather); projections and attention are then local along those axes (keys split by
    tokens take the ring), and the output returns to the query's layout (one all-to-all).
    The attention weights keep the rows they were computed in. Weights and biases whole."""
    a = bind(func, args, kwargs)
    operands = {"query": a.query, "key": a.key, "value": a.value}
    parameters = (
        a.in_proj_weight, a.in_proj_bias, a.bias_k, a.bias_v, a.out_proj_weight,
        a.out_proj_bias, a.q_proj_weight, a.k_proj_weight, a.v_proj_weight, a.static_k,
        a.static_v,
    )  # fmt: skip
    split = {name: t for name, t in operands.items() if _features_split(t)}
    if not split or not accepts(*operands.values(), replicated=parameters):
        return NotImplemented
    moved: dict[int, ShardTensor] = {}  # by identity: self-attention keeps one packed projection
    for t in split.values():
        if id(t) not in moved:
            moved[id(t)] = redistribute(t, _features_moved(t._spec, sequence=0))
    args, kwargs = replaced(func, args, kwargs, {n: moved[id(t)] for n, t in split.items()})
    out, attention = func(*args, **kwargs)
    if "query" in split:
        out = redistribute(out, _indexed_like(split["query"]._spec, out.shape, out.dtype))
    return out, attention


def _features_split(t: object) -> bool:
    return isinstance(t, ShardTensor) and t.ndim - 1 in t._spec.sharding_by_dim


def _returned(grad: torch.Tensor, aligned: ShardTensor, given: torch.Tensor) -> torch.Tensor:
    """A gradient computed in the aligned layout, in the layout of the input it belongs to:
    the forward's, as a redistribution's backward returns it (not an op's gather: NOTE
    [Gathers an op was not asked to make])."""
    sharded = ShardTensor(grad, aligned._spec.with_dtype(grad.dtype))
    with asked_for():
        if isinstance(given, ShardTensor):
            return _moved(sharded, grad_spec(given._spec))
        return _moved(sharded, replicated_spec(grad, aligned._spec.mesh))._local


def _probe(func, qkv: tuple, mask: torch.Tensor | None, *args, **kwargs):
    """``func(q, k, v, *args, attn_mask=mask, **kwargs)`` on ``meta`` tensors of the same shapes
    and dtypes: the result's shapes, and torch's own error for bad arguments.

    Run once per value of the arguments (``probe_on_meta``): on ``meta`` tensors SDPA takes
    the math path through ``_safe_softmax``'s decomposition in prims, about 12 ms of host time
    a call (on this machine, a (1, 4, 16, 32) query) against 0.05 ms for the fused kernel on
    CPU.
    """
    return probe_on_meta(func, (*qkv, *args), {"attn_mask": mask, **kwargs})


def _check_dropout(dropout_p: float) -> None:
    if dropout_p:
        raise NotImplementedError(
            f"scaled_dot_product_attention on ShardTensors supports dropout_p=0 only, got "
            f"dropout_p={dropout_p}: each rank would draw its own dropout mask, so the result "
            f"would not match a single-device run; apply dropout outside the attention"
        )


@dataclass(frozen=True)
class _Aligned:
    """An attention call's operands in the layouts of the module docstring, and its plan."""

    mesh: DeviceMesh
    q: ShardTensor
    k: ShardTensor
    v: ShardTensor
    mask: torch.Tensor | None
    plan: AttentionPlan
    features: ShardTensorSpec | None

    @classmethod
    def build(cls, q, k, v, mask, scale, is_causal, enable_gqa) -> _Aligned:
        mesh = next(t for t in (q, k, v, mask) if isinstance(t, ShardTensor))._spec.mesh
        q, k, v = (_as_shard_tensor(t, mesh) for t in (q, k, v))
        mask = None if mask is None else _as_shard_tensor(mask, mesh)
        layouts = _layouts(
            q._spec, k._spec, v._spec, None if mask is None else mask._spec, enable_gqa
        )
        q, k, v = (redistribute(t, target) for t, target in zip((q, k, v), layouts.qkv))
        local_mask = None
        if mask is not None:
            target, grad_placements = layouts.mask
            local_mask = redistribute(mask, target).to_local(grad_placements=grad_placements)
        plan = layouts.plan(scale, is_causal)
        return cls(mesh, q, k, v, local_mask, plan, layouts.features)

    def output_spec(self, shape: torch.Size, dtype: torch.dtype) -> ShardTensorSpec:
        """The layout of an output (or log-sum-exp) indexed like the query's leading dims."""
        return _indexed_like(self.q._spec, shape, dtype)

    def returned(self, out: ShardTensor) -> ShardTensor:
        """The output in the query's layout, its split features back in place (NOTE [A split
        feature dim moves to the rows])."""
        if self.features is None:
            return out
        return redistribute(out, _indexed_like(self.features, out.shape, out.dtype))


@dataclass(frozen=True)
class _Layouts:
    """What an attention call's operand layouts decide (``_layouts``, cached by value).

    Attributes
    ----------
    qkv : tuple of ShardTensorSpec
        The aligned layouts of query, key and value.
    mask : (ShardTensorSpec, tuple of Placement) or None
        The mask's aligned layout and the placements its local gradient is read with.
    sequence : AttentionPlan
        The plan's part that layouts decide (scale, causal and ring are the call's).
    gathered_bytes : int
        The keys and values this rank would hold gathered (NOTE [Ring or all-gather]).
    features : ShardTensorSpec or None
        Where the query's feature dim is split: its layout before the split moved (NOTE [A
        split feature dim moves to the rows]), which the output returns to.
    """

    qkv: tuple[ShardTensorSpec, ShardTensorSpec, ShardTensorSpec]
    mask: tuple[ShardTensorSpec, tuple[Placement, ...]] | None
    sequence: AttentionPlan
    gathered_bytes: int
    features: ShardTensorSpec | None

    def plan(self, scale: float | None, causal: bool) -> AttentionPlan:
        """The call's plan; where the sequence is split, the ring-or-gather choice is asked
        on every call, for the gather policy sees every gather (NOTE [Gathers an op was not
        asked to make])."""
        q, k, v = self.qkv
        if scale is None:
            scale = 1.0 / math.sqrt(q.shape[-1])
        ring = self.sequence.group is not None and ring_chosen(
            self.gathered_bytes, [(k, k.ndim - 2), (v, v.ndim - 2)], "the keys and values"
        )
        return replace(self.sequence, scale=scale, causal=causal, ring=ring)


@cached("attention layouts", 1024)
def _layouts(
    q: ShardTensorSpec,
    k: ShardTensorSpec,
    v: ShardTensorSpec,
    mask: ShardTensorSpec | None,
    enable_gqa: bool,
) -> _Layouts:
    """The aligned layouts and the sequence's plan for operands laid out as given: planned
    once per value, not on every call of a training step (NOTE [Caches are keyed by value])."""
    repeats = q.shape[-3] // k.shape[-3] if q.ndim >= 3 and enable_gqa else 1
    given = _query_layout(q, repeats)
    features = given if q.ndim - 1 in given.sharding_by_dim else None
    heads = {q.ndim - 3} if repeats > 1 else set()
    q = given if features is None else _features_moved(given, q.ndim - 2, heads)
    k, v = _key_value_layouts(q, k, v)
    sequence = q.ndim - 2
    if unsplit(q, (sequence,)):  # every key on this rank: no ring, no gather
        plan = AttentionPlan(None, (0,), (k.shape[sequence],), 0, 1.0, False, repeats, False)
        gathered = 0
    else:
        keys = k.sharding_by_dim[sequence]
        starts = tuple(sum(keys.sizes[:i]) for i in range(len(keys.sizes)))
        group = axis_group(q.mesh, q.sharding_by_dim[sequence].axes)
        query_start = q.local_offsets()[sequence]
        plan = AttentionPlan(group, starts, keys.sizes, query_start, 1.0, False, repeats, False)
        rows = math.prod(k.local_shape()[:-2]) * k.shape[-2]
        gathered = rows * (k.shape[-1] + v.shape[-1]) * k.dtype.itemsize
    mask_layout = None if mask is None else _mask_layout(mask, q)
    return _Layouts((q, k, v), mask_layout, plan, gathered, features)


@cached("attention output layouts", 1024)
def _indexed_like(query: ShardTensorSpec, shape: torch.Size, dtype: torch.dtype) -> ShardTensorSpec:
    """``shape`` (an output, or a log-sum-exp without the last dim) laid out like the query's
    dims it indexes: a dim of another extent (the values' E_v) in ``torch.chunk``'s sizes;
    the query's strides kept for its own shape."""
    kept = [
        s
        if shape[s.dim] == query.shape[s.dim]
        else replace(
            s, sizes=nested_chunk_sizes(shape[s.dim], [query.mesh_shape[a] for a in s.axes])
        )
        for s in query.shardings
        if s.dim < len(shape)
    ]
    stride = query.stride if tuple(shape) == tuple(query.shape) else None
    return ShardTensorSpec.from_shardings(
        query.mesh, kept, shape, dtype, stride=stride, hints=query.hints
    )


def _as_shard_tensor(t: torch.Tensor, mesh: DeviceMesh) -> ShardTensor:
    if isinstance(t, ShardTensor):
        if t._spec.mesh != mesh:
            raise ValueError(f"attention operands live on different meshes: {t._spec.mesh}, {mesh}")
        return t
    return from_local_spec(t, replicated_spec(t, mesh))


def _rebuilt(
    spec: ShardTensorSpec,
    placements: Sequence[Placement],
    sizes: dict[int, tuple[int, ...]],
    order: dict[int, tuple[int, ...]],
) -> ShardTensorSpec:
    """``spec`` laid out exactly so."""
    return ShardTensorSpec.build(
        spec.mesh, placements, spec.shape, spec.dtype, sizes, stride=spec.stride, order=order,
        hints=spec.hints,
    )  # fmt: skip


def _moved(x: ShardTensor, spec: ShardTensorSpec) -> ShardTensor:
    return redistribute(x, spec.with_dtype(x.dtype))


def _query_layout(spec: ShardTensorSpec, repeats: int) -> ShardTensorSpec:
    """The query's layout with Partial axes reduced and, with grouped-query attention, its
    head dim whole."""
    whole = {spec.ndim - 3} if repeats > 1 else set()
    return _relaid(spec, [s for s in spec.shardings if s.dim not in whole])


def _features_moved(
    spec: ShardTensorSpec, sequence: int, fixed: Collection[int] = ()
) -> ShardTensorSpec:
    """``spec`` (a layout whose last, feature dim is split) with the feature axes splitting
    the largest other dim no axis splits (not ``sequence``, not one of ``fixed``) where it
    has a row for every rank of those axes, else ``sequence``, nested inside its own axes
    (NOTE [A split feature dim moves to the rows])."""
    feature = spec.ndim - 1
    moved = spec.sharding_by_dim[feature]
    ranks = math.prod(spec.mesh_shape[a] for a in moved.axes)
    free = [
        d
        for d in range(spec.ndim)
        if d not in (feature, sequence, *fixed)
        and d not in spec.sharding_by_dim
        and spec.shape[d] >= ranks
    ]
    parts = [spec.mesh_shape[a] for a in moved.axes]
    kept = [s for s in spec.shardings if s.dim not in (feature, sequence)]
    rows = spec.sharding_by_dim.get(sequence)
    if free:
        target = max(free, key=lambda d: spec.shape[d])
        kept.append(DimSharding(target, moved.axes, nested_chunk_sizes(spec.shape[target], parts)))
        if rows is not None:
            kept.append(rows)
    else:
        outer = rows.sizes if rows is not None else (spec.shape[sequence],)
        axes = (rows.axes if rows is not None else ()) + moved.axes
        sizes = tuple(size for piece in outer for size in nested_chunk_sizes(piece, parts))
        kept.append(DimSharding(sequence, axes, sizes))
    return _relaid(spec, kept)


def _relaid(spec: ShardTensorSpec, shardings: Sequence[DimSharding]) -> ShardTensorSpec:
    """``spec``'s tensor split as ``shardings`` say, every other axis replicated."""
    return ShardTensorSpec.from_shardings(
        spec.mesh, shardings, spec.shape, spec.dtype, stride=spec.stride, hints=spec.hints
    )


def _key_value_layouts(
    q: ShardTensorSpec, k: ShardTensorSpec, v: ShardTensorSpec
) -> tuple[ShardTensorSpec, ShardTensorSpec]:
    """Keys' and values' layouts sharded like the query (``q``, aligned), their key dim over
    the query's sequence axes."""
    sequence = q.ndim - 2
    placements = list(q.placements)
    sizes, order = {}, {}
    for s in q.shardings:
        order[s.dim] = s.axes
        if s.dim != sequence:
            sizes[s.dim] = s.sizes
            continue
        current = k.sharding_by_dim.get(sequence)
        if current is not None and current.axes == s.axes:
            sizes[s.dim] = current.sizes
        elif k.shape[sequence] == q.shape[sequence]:
            sizes[s.dim] = s.sizes
        else:
            mesh_shape = q.mesh_shape
            sizes[s.dim] = nested_chunk_sizes(k.shape[sequence], [mesh_shape[a] for a in s.axes])
    return _rebuilt(k, placements, sizes, order), _rebuilt(v, placements, sizes, order)


def _mask_layout(
    mask: ShardTensorSpec, q: ShardTensorSpec
) -> tuple[ShardTensorSpec, tuple[Placement, ...]]:
    """The mask's layout holding this rank's rows (every key), sharded like the query (``q``,
    aligned) where it does not broadcast, and the placements of its local gradient: a partial
    sum over the axes where it is replicated but the query is not."""
    offset = q.ndim - mask.ndim
    placements: list[Placement] = [Replicate()] * q.mesh.ndim
    grad_placements: list[Placement] = [Replicate()] * q.mesh.ndim
    sizes, order = {}, {}
    for s in q.shardings:
        dim = s.dim - offset
        for axis in s.axes:
            grad_placements[axis] = Partial()
        if dim < 0 or mask.shape[dim] == 1:
            continue
        sizes[dim], order[dim] = s.sizes, s.axes
        for axis in s.axes:
            placements[axis] = grad_placements[axis] = Shard(dim)
    return _rebuilt(mask, placements, sizes, order), tuple(grad_placements)
