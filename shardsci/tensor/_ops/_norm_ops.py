"""Group, batch, instance, layer and RMS normalisation on sharded tensors.

Each layer normalises ``x`` by a mean and a (biased) variance taken over some of its dims, the
*reduced* dims, separately for every index of the others (a *row*), then applies a per-channel
(LayerNorm, RMSNorm: elementwise) weight and bias:

==================  ===========================  ==================  ====================
layer               reduced dims of (N, C, *S)   rows                weight, bias over
==================  ===========================  ==================  ====================
GroupNorm(G)        C/G channels of a group, S   (N, G)              C
BatchNorm           N, S                         C                   C
InstanceNorm        S                            (N, C)              C
LayerNorm(shape)    the trailing ``len(shape)``  the leading dims    the trailing dims
RMSNorm(shape)      as LayerNorm, no mean        the leading dims    the trailing dims
==================  ===========================  ==================  ====================

The statistics are those of the whole tensor (NOTE [Normalisation statistics across shards]);
the normalisation itself and the affine map are local, and the output has the input's layout.
Inputs whose reduced dims are not sharded (e.g. GroupNorm on a batch-sharded tensor) take the
same path with no statistics collective: the default path rejects uneven batch shards for
group_norm and averages InstanceNorm's running statistics over each rank's samples only.

A sharded channel dim stays sharded. Channels are rows of BatchNorm and InstanceNorm: each rank
normalises its channels with its slice of the weights, and the running statistics, plain
tensors every rank holds whole, receive every rank's channels by one all-gather over the axes
sharding channels (C numbers each). GroupNorm needs each group on one rank: channel shards that
cut a group are moved to the nearest group boundaries first and the output moved back
(``_groups_whole``; only the straddling channels move, nothing when the shards split between
groups). aten's layer and batch norms called directly (``torch.native_layer_norm``,
``torch.native_batch_norm``, ``torch._native_batch_norm_legit``, and
``aten._batch_norm_with_update``, which ``F.batch_norm`` becomes in graphs torch.export and
AOTAutograd trace) share these paths and return their statistics too. Declined
(``NotImplemented``, default path): inputs with a Partial axis; running
statistics that are ShardTensors; weights that are sharded ShardTensors.

# NOTE [Normalisation statistics across shards]
Every rank reduces its shard, row by row; its element count ``n_k`` per row is known to every
rank from the spec (true shard sizes; 0 for an empty shard). The ranks of the group along the
mesh axes that shard reduced dims (``P`` of them) combine their parts in one of two ways,
chosen by ``normalization_statistics`` (``tensor/_options.py``):

- **all-gather** (Chan et al.): every rank reduces its shard to a mean ``m_k`` and a biased
  variance ``v_k`` (one local pass, ``torch.var_mean``; zeros for an empty shard); one
  all-gather gives every rank all the ``(m_k, v_k)``, and each combines them with the
  weights ``w_k = n_k / n``

      n = Σ n_k,   mean = Σ w_k m_k,   var = Σ w_k (v_k + (m_k − mean)²).

  One collective of ``P - 1`` ring steps, ``2 (P - 1)`` numbers per row received.
- **all-reduce**: one all-reduce of the row sums gives the mean ``Σ x / n``; a second, of
  every rank's ``Σ (x − mean)²`` about that global mean, gives ``M2``. Two collectives of
  ``2 log2 P`` tree hops (or ring steps) each, one number per row in each.

Both are stable: squares are of deviations from a mean (no ``Σx² − n·mean²`` cancellation;
the all-reduce's deviations are from the global mean itself, the all-gather's from the local
one, corrected by non-negative terms), both equal the single-device statistics to rounding
(``tests/test_norm_statistics.py``: within 1e-10 in float64 on 2, 4 and 8 ranks), and both are
bitwise identical on every rank (every rank combines the same gathered numbers in the same
order; an all-reduce hands every rank the same sums), so are the running statistics. A single
all-reduce of ``(Σx, Σx²)`` would halve the latency again but cancels catastrophically where
the mean is large against the spread; no shift every rank knows without a collective exists.

The rule (``statistics_all_reduced``): the all-gather over groups of fewer than
``all_reduce_from_ranks`` ranks, the all-reduces from there on; the default, 104, is the
crossover of the latency-bandwidth model of ``planning._machine.Machine()`` (H100 nodes of 8,
NCCL's latencies: the ring all-gather's ``P - 1`` steps against two trees' ``2 log2 P`` hops,
for 8 rows of float32 statistics); ``benchmarks.cost_model.statistics_crossover(machine)``
gives it for another machine (gloo on this one: 21). Statistics of many rows (LayerNorm over
a sharded dim of a long sequence) reach the crossover earlier, 46 ranks at 1,024 rows on
H100s, which this rank-only rule does not see: set ``all_reduce_from_ranks`` lower there. Every
rank of a group sees the same group size, so the ranks of a group decide alike.

Backward of x̂ = (x − mean) / sqrt(var + eps), with g = dL/dx̂:

    dx = (g − Σg / n − x̂ · Σ(g x̂) / n) / sqrt(var + eps),

whose two row sums cross shards in one all-reduce. Weights and biases are sliced to the part
this rank's shard meets; their gradients are summed over the axes that shard other dims and
gathered over the axes that shard the dims they span (LayerNorm over sharded dims).

Collectives per call. The forward all-gather and the backward input-gradient all-reduce run
over the mesh axes that shard reduced dims, and not at all when none does.
- forward: 1 all-gather of the batch statistics, or 2 all-reduces above the crossover (none
  in eval mode with running statistics; RMSNorm: 1 all-reduce of the sums of squares), plus,
  for InstanceNorm's running statistics on a batch-sharded input, 1 all-reduce over the axes
  sharding N, and for running statistics on sharded channels 1 all-gather over the axes
  sharding them (GroupNorm on channel shards that cut groups: a redistribution there and back);
- backward: 1 all-reduce for the input gradient, plus, for each affine parameter that needs a
  gradient, 1 all-reduce per mesh axis sharding dims it does not span and 1 all-gather over the
  axes sharding dims it spans (LayerNorm; sharded channels). E.g. GroupNorm or BatchNorm with affine parameters on
  a 2x2 block: 1 all-gather forward, 1 + 2 + 2 all-reduces backward.
The input gradient is differentiable once (no double backward).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

from shardsci.tensor._api import ShardTensor, from_local_spec, redistribute
from shardsci.tensor._binding import bind
from shardsci.tensor._caches import cached
from shardsci.tensor._collectives import (
    AxisGroup,
    all_gather,
    all_reduce,
    axis_group,
    exchange,
)
from shardsci.tensor._first_order import first_order_only
from shardsci.tensor._ops._common import (
    accepts,
    no_empty_shard,
    replicated_local,
    sharding_axes,
    unsplit,
)
from shardsci.tensor._options import statistics_all_reduced
from shardsci.tensor._promotion import promote_replicated
from shardsci.tensor._registry import register_function_handler
from shardsci.tensor._spec import ShardTensorSpec, coordinate_over_axes
from shardsci.tensor._torch_compat import _native_batch_norm_legit

aten = torch.ops.aten


# ---------------------------------------------------------------------------- statistics
@dataclass(frozen=True)
class _Statistics:
    """Where the rows of a normalisation live and how many elements each rank holds per row.

    Attributes
    ----------
    group : AxisGroup or None
        The ranks along the mesh axes that shard reduced dims; None when none does.
    counts : tuple of int
        Elements per row held by each member of ``group`` (by flat index), or the whole
        count when ``group`` is None.
    """

    group: AxisGroup | None
    counts: tuple[int, ...]

    @staticmethod
    @cached("normalisation statistics", 4096)
    def over(spec: ShardTensorSpec, reduced: tuple[int, ...], scale: int = 1) -> _Statistics:
        """Rows of ``spec`` reduced over tensor dims ``reduced`` (and ``scale`` more elements
        per row from a split unsharded dim, GroupNorm's channels of a group); cached per
        layout."""
        shardings = [s for s in spec.shardings if s.dim in reduced]
        whole = scale * math.prod(spec.shape[d] for d in reduced if d not in spec.sharding_by_dim)
        axes = tuple(sorted(a for s in shardings for a in s.axes))
        group = axis_group(spec.mesh, axes) if axes else None
        if group is None or group.size == 1:
            return _Statistics(None, (whole * math.prod(spec.shape[s.dim] for s in shardings),))
        counts = []
        for flat in range(group.size):
            coordinate = coordinate_over_axes(flat, axes, spec.mesh_shape)
            count = whole
            for s in shardings:
                count *= s.sizes[s.flat_index(spec.mesh_shape, coordinate)]
            counts.append(count)
        return _Statistics(group, tuple(counts))

    @property
    def total(self) -> int:
        return sum(self.counts)

    @property
    def local_count(self) -> int:
        return self.counts[self.group.index] if self.group is not None else self.counts[0]

    def moments(self, x: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """Mean and biased variance of every row of the global tensor (keepdim)."""
        if self.group is not None and statistics_all_reduced(self.group.size):
            mean = self.summed(x.sum(dims, keepdim=True)) / self.total
            m2 = self.summed((x - mean).square_().sum(dims, keepdim=True))
            return mean, m2 / self.total
        mean, var = self._local_moments(x, dims)
        if self.group is None:
            return mean, var
        gathered = all_gather(torch.stack([mean, var]), self.group)
        weights = torch.tensor(self.counts, dtype=x.dtype, device=x.device) / self.total
        weights = weights.reshape(-1, *[1] * mean.ndim)
        means, variances = gathered.unbind(1)
        mean = (weights * means).sum(0)
        var = (weights * (variances + (means - mean).square_())).sum(0)
        return mean, var

    def _local_moments(
        self, x: torch.Tensor, dims: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's row means and biased variances (keepdim) in one pass over ``x``
        (``var_mean``); zeros for an empty shard, whose weight in the combination is 0."""
        if self.local_count == 0:
            zeros = x.new_zeros([1 if d in dims else n for d, n in enumerate(x.shape)])
            return zeros, zeros
        var, mean = torch.var_mean(x, dims, correction=0, keepdim=True)
        return mean, var

    def row_sums(self, terms: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
        """Sums over the reduced dims of the global tensor, for stacked ``terms`` (dim 0)."""
        local = terms.sum(tuple(d + 1 for d in dims), keepdim=True)
        return self.summed(local)

    def summed(self, local: torch.Tensor) -> torch.Tensor:
        """The sum over the group of every rank's ``local``."""
        return local if self.group is None else all_reduce(local, self.group, "sum")


# NOTE [A norm saves what it returns]
# The normalisations compute in float32 or wider (a bfloat16 row's statistics would lose
# most of their digits) and return x̂ in the input's dtype. Their backward reads x̂ from the
# tensor they return, widened again, not from a float32 copy of it: the affine product after
# them saves that same tensor, so a norm adds no activation of its own to what the step keeps
# for the backward, as torch's own layer norm keeps its input alone. Saving the float32 x̂
# kept 1.5x a bfloat16 input's bytes per norm (a one-rank ViT forward under bf16 autocast
# saved 1.28x plain torch's bytes, 2026-11-29; ``tests/test_autocast.py``). The backward's
# x̂ is then rounded to the input's dtype, as torch's is computed from the rounded input.
class _Normalize(torch.autograd.Function):
    """x̂ = (x − mean) / sqrt(var + eps) with statistics over every shard (NOTE above).
    Also returns the mean and the biased variance (keepdim, not differentiable)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, dims: tuple[int, ...], stats: _Statistics, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        mean, var = stats.moments(wide, dims)
        inverse_std = torch.rsqrt(var + eps)
        normalized = ((wide - mean) * inverse_std).to(x.dtype)
        ctx.save_for_backward(normalized, inverse_std)  # NOTE [A norm saves what it returns]
        ctx.dims, ctx.stats = dims, stats
        ctx.mark_non_differentiable(mean, var)
        return normalized, mean, var

    @staticmethod
    @first_order_only("a normalisation over split dims")
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        returned, inverse_std = ctx.saved_tensors
        normalized = returned.to(inverse_std.dtype)
        grad = grad.to(inverse_std.dtype)
        sums = ctx.stats.row_sums(torch.stack([grad, grad * normalized]), ctx.dims)
        n = ctx.stats.total
        grad_x = inverse_std * (grad - sums[0] / n - normalized * (sums[1] / n))
        return grad_x.to(returned.dtype), None, None, None


class _RootMeanSquare(torch.autograd.Function):
    """x̂ = x / sqrt(Σx² / n + eps) with the sums over every shard: one all-reduce forward
    (a sum of squares cancels nothing), one backward, ``dx = (g − x̂ Σ(g x̂) / n) / rms``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, dims: tuple[int, ...], stats: _Statistics, eps: float
    ) -> torch.Tensor:
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        squares = stats.summed(wide.square().sum(dims, keepdim=True))
        inverse_rms = torch.rsqrt(squares / stats.total + eps)
        normalized = (wide * inverse_rms).to(x.dtype)
        ctx.save_for_backward(normalized, inverse_rms)  # NOTE [A norm saves what it returns]
        ctx.dims, ctx.stats = dims, stats
        return normalized

    @staticmethod
    @first_order_only("an RMS norm")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        returned, inverse_rms = ctx.saved_tensors
        normalized = returned.to(inverse_rms.dtype)
        grad = grad.to(inverse_rms.dtype)
        sums = ctx.stats.row_sums((grad * normalized)[None], ctx.dims)[0]
        grad_x = inverse_rms * (grad - normalized * (sums / ctx.stats.total))
        return grad_x.to(returned.dtype), None, None, None


class _ChannelNorm(torch.autograd.Function):
    """``(x − mean) / sqrt(var + eps) · w + b`` with per-channel ``w``, ``b``, on ``x`` viewed
    as ``(N, G, C/G, S)`` (channel groups, flattened spatial dims), statistics over ``reduced``
    of every shard. Also returns the mean and the biased variance (keepdim, not
    differentiable).

    Fused (NOTE [Normalisation statistics across shards]): forward reads ``x`` twice (the
    moments in one ``var_mean``, two passes from the all-reduce crossover on; then ``x · scale
    + shift`` with per-row, per-channel coefficients), backward three times (the per-channel
    sums ``Σ g`` and ``Σ g x``, then ``g α + x β + γ``), instead of a pass per elementwise op;
    the parameters' gradients are the local parts of those sums.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        reduced: tuple[int, ...],
        stats: _Statistics,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        mean, var = stats.moments(wide, reduced)
        inverse_std = torch.rsqrt(var + eps)
        scale = inverse_std if weight is None else inverse_std * weight[:, :, None]
        shift = -mean * scale
        if bias is not None:
            shift = shift + bias[:, :, None]
        out_dtype = x.dtype
        for p in (weight, bias):
            out_dtype = out_dtype if p is None else torch.promote_types(out_dtype, p.dtype)
        ctx.save_for_backward(x, mean, inverse_std, weight)
        ctx.reduced, ctx.stats, ctx.has_bias = reduced, stats, bias is not None
        ctx.mark_non_differentiable(mean, var)
        return torch.addcmul(shift, wide, scale).to(out_dtype), mean, var

    @staticmethod
    @first_order_only("a batch or group norm over split dims")
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, mean, inverse_std, weight = ctx.saved_tensors
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        grad = grad.to(wide.dtype)
        sum_g = grad.sum(3)
        sum_gx = torch.linalg.vecdot(grad, wide, dim=3)
        mean3, inverse_std3 = mean[..., 0], inverse_std[..., 0]
        sum_g_normalized = inverse_std3 * (sum_gx - mean3 * sum_g)
        w = weight.to(wide.dtype) if weight is not None else None
        weighted = torch.stack(
            [sum_g, sum_g_normalized] if w is None else [w * sum_g, w * sum_g_normalized]
        )
        dims = tuple(d + 1 for d in ctx.reduced if d != 3)
        sums = ctx.stats.summed(weighted.sum(dims, keepdim=True))[..., None]
        n = ctx.stats.total
        alpha = inverse_std if w is None else inverse_std * w[:, :, None]
        beta = -inverse_std.square() * sums[1] / n
        gamma = inverse_std * (mean * inverse_std * sums[1] - sums[0]) / n
        grad_x = torch.addcmul(gamma, grad, alpha).addcmul_(wide, beta)
        grad_w = sum_g_normalized.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_b = sum_g.sum(0).to(grad.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x.to(x.dtype), grad_w, grad_b, None, None, None


def _channel_normalized(
    x: ShardTensor,
    groups: int,
    reduce_batch: bool,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[ShardTensor, torch.Tensor, torch.Tensor, _Statistics]:
    """GroupNorm (``groups`` of channels), InstanceNorm (``groups`` = C) or BatchNorm
    (``groups`` = C, ``reduce_batch``) of ``x`` with per-channel affine parameters; also the
    row means and biased variances (``(N or 1, G_local, 1, 1)``, this rank's groups) and the
    statistics. A sharded channel dim must split between groups (``_groups_whole``)."""
    spec = x._spec
    per_group = x.shape[1] // groups
    spatial = _spatial(x)
    reduced_dims = ((0,) if reduce_batch else ()) + spatial
    stats = _Statistics.over(spec, reduced_dims, scale=per_group)
    local = x.to_local()
    local_groups = local.shape[1] // per_group
    view = local.reshape(local.shape[0], local_groups, per_group, math.prod(local.shape[2:]))
    w = _local_parameter(weight, spec, (1,))
    b = _local_parameter(bias, spec, (1,))
    shaped = [None if p is None else p.reshape(local_groups, per_group) for p in (w, b)]
    reduced = ((0,) if reduce_batch else ()) + (2, 3)
    out, mean, var = _ChannelNorm.apply(view, *shaped, reduced, stats, eps)
    result = from_local_spec(out.reshape(local.shape), spec.with_dtype(out.dtype))
    return result, mean, var, stats


def _normalized(
    x: ShardTensor, reduced: tuple[int, ...], eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, _Statistics]:
    """This rank's shard of ``x`` normalised over tensor dims ``reduced``, with the row means
    and biased variances (keepdim) and the statistics."""
    stats = _Statistics.over(x._spec, reduced)
    normalized, mean, var = _Normalize.apply(x.to_local(), reduced, stats, eps)
    return normalized, mean, var, stats


def _with_running_stats(
    x: ShardTensor, running_mean: torch.Tensor, running_var: torch.Tensor, eps: float
) -> torch.Tensor:
    """This rank's shard of ``x`` normalised by per-channel running statistics (local)."""
    shape = (-1, *[1] * (x.ndim - 2))
    mean, var = (_local_parameter(r, x._spec, (1,)) for r in (running_mean, running_var))
    inverse_std = torch.rsqrt(var.reshape(shape) + eps)
    return (x.to_local() - mean.reshape(shape)) * inverse_std


def _channels_whole(x: ShardTensor, values: torch.Tensor) -> torch.Tensor:
    """Per-channel ``values`` (``(k, C_local)``, this rank's channels of ``x``) for all
    ``C`` channels: one all-gather over the axes sharding channels, if any (a running
    statistic is a plain tensor every rank holds whole)."""
    channels = x._spec.sharding_by_dim.get(1)
    if channels is None:
        return values
    group = axis_group(x._spec.mesh, channels.axes)
    pieces = exchange(
        group,
        [values.contiguous()] * group.size,
        lambda src, dst: (values.shape[0], channels.sizes[src]),
        dtype=values.dtype,
        device=values.device,
        kind="all_gather",
    )
    return torch.cat(pieces, dim=1)


def _groups_whole(x: ShardTensor, per_group: int) -> ShardTensor:
    """``x`` with its channel shards moved to the nearest group boundaries (``per_group``
    channels a group), so that every group lies on one rank: the channels of a group that
    straddled two shards move to one of them (differentiable; nothing moves when the
    shards already split between groups)."""
    spec = x._spec
    channels = spec.sharding_by_dim.get(1)
    if channels is None or all(n % per_group == 0 for n in channels.sizes):
        return x
    ends = [round(e / per_group) * per_group for e in itertools.accumulate(channels.sizes)]
    sizes = {s.dim: s.sizes for s in spec.shardings}
    sizes[1] = tuple(b - a for a, b in zip([0, *ends], ends))
    order = {s.dim: s.axes for s in spec.shardings}
    aligned = ShardTensorSpec.build(
        spec.mesh, spec.placements, spec.shape, spec.dtype, sizes, order=order
    )
    return redistribute(x, aligned)


def _update_running(
    running: torch.Tensor | None, batch_value: torch.Tensor, momentum: float
) -> None:
    """``running ← (1 − momentum) running + momentum batch_value``, in place, as torch does."""
    if running is None:
        return
    with torch.no_grad():
        running.mul_(1 - momentum).add_(
            batch_value.reshape(running.shape).to(running.dtype) * momentum
        )


# ---------------------------------------------------------------------------- affine
def _local_parameter(
    p: torch.Tensor | None, spec: ShardTensorSpec, dims: tuple[int, ...]
) -> torch.Tensor | None:
    """The part of parameter ``p`` (its dim i along tensor dim ``dims[i]`` of ``spec``) that
    this rank's shard meets, as a local tensor whose gradient reaches ``p`` as the
    single-device one: summed over the mesh axes that shard other dims, gathered over those
    that shard ``dims`` (NOTE [Autograd interaction between torch.Tensor and ShardTensor])."""
    if p is None:
        return None
    if not any(s.dim in dims for s in spec.shardings):
        return replicated_local(p, spec.mesh, sharding_axes(spec))
    placements: list[Any] = [Replicate()] * spec.mesh.ndim
    partial = sharding_axes(spec)
    grad_placements: list[Any] = [
        Partial() if a in partial else Replicate() for a in range(spec.mesh.ndim)
    ]
    sizes, order = {}, {}
    for s in spec.shardings:
        if s.dim in dims:
            sizes[dims.index(s.dim)], order[dims.index(s.dim)] = s.sizes, s.axes
            for a in s.axes:
                placements[a] = grad_placements[a] = Shard(dims.index(s.dim))
    sliced = ShardTensorSpec.build(spec.mesh, placements, p.shape, p.dtype, sizes, order=order)
    if isinstance(p, ShardTensor):
        whole = p
    elif p.requires_grad and torch.is_grad_enabled():
        whole = promote_replicated(p, spec.mesh)
    else:
        return sliced.narrow(p)
    return redistribute(whole, sliced).to_local(grad_placements=grad_placements)


def _affine(
    normalized: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    x: ShardTensor,
    dims: tuple[int, ...],
) -> ShardTensor:
    """``normalized * weight + bias`` on this rank's shard, wrapped in the layout of ``x``;
    the parameters span tensor dims ``dims`` (contiguous)."""
    trailing = (1,) * (x.ndim - 1 - dims[-1])
    out = normalized
    w = _local_parameter(weight, x._spec, dims)
    if w is not None:
        out = out * w.reshape(*w.shape, *trailing)
    b = _local_parameter(bias, x._spec, dims)
    if b is not None:
        out = out + b.reshape(*b.shape, *trailing)
    return from_local_spec(out, x._spec.with_dtype(out.dtype))


# ---------------------------------------------------------------------------- arguments
def _check_parameters(what: str, expected: Sequence[int], **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and tuple(t.shape) != tuple(expected):
            raise RuntimeError(
                f"{what}: {name} has shape {tuple(t.shape)}, expected {tuple(expected)}"
            )


def _check_eps(what: str, eps: float, training: bool) -> None:
    if training and eps <= 0.0:
        raise ValueError(f"{what} eps must be positive during training, but got {eps}")
    if eps < 0.0:
        raise ValueError(f"{what} eps must be non-negative, but got {eps}")


def _spatial(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(2, x.ndim))


# ---------------------------------------------------------------------------- group norm
# Each layer has two spellings, ``F.x`` and ``torch.x``, whose arguments come in another order.
@register_function_handler(F.group_norm, torch.group_norm)
def _group_norm(func, args, kwargs):
    a = bind(func, args, kwargs)
    x, groups, weight, bias = a.input, a.num_groups, a.weight, a.bias
    if not accepts(x, replicated=[weight, bias]):
        return NotImplemented
    channels = x.shape[1]
    if groups <= 0 or channels % groups:
        raise RuntimeError(
            f"group_norm: the {channels} channels of an input of shape {tuple(x.shape)} do "
            f"not split into num_groups={groups} groups"
        )
    if x.shape[0] * math.prod(x.shape[2:]) * channels // groups == 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size "
            f"{[x.shape[0] * channels // groups, groups, *x.shape[2:]]}"
        )
    _check_parameters("group_norm", (channels,), weight=weight, bias=bias)
    aligned = _groups_whole(x, channels // groups)
    if _local_kernel_suffices(aligned, _spatial(x), weight, bias):
        out = _local_group_norm(aligned, channels // groups, weight, bias, a.eps)
    else:
        out = _channel_normalized(aligned, groups, False, weight, bias, a.eps)[0]
    return out if aligned is x else redistribute(out, x._spec.with_dtype(out.dtype))


def _local_kernel_suffices(
    x: ShardTensor,
    reduced: tuple[int, ...],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> bool:
    """Whether every row's statistics lie on one rank (no dim of ``reduced`` split between
    ranks, every shard non-empty: NOTE [A windowed op on unsplit dims is the local op] in
    ``_conv_ops``) and torch's kernel gives the sharded path's dtype (parameters of the
    input's), so torch's norm on the shard is the sharded norm."""
    return (
        unsplit(x._spec, reduced)
        and no_empty_shard(x._spec)
        and all(p is None or p.dtype == x.dtype for p in (weight, bias))
    )


def _local_group_norm(
    x: ShardTensor,
    per_group: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> ShardTensor:
    """Group norm of ``x`` whose groups each lie whole on this rank: torch's kernel on the
    shard, ``per_group`` channels a group, this rank's channels of the parameters."""
    spec = x._spec
    local = x.to_local()
    w = _local_parameter(weight, spec, (1,))
    b = _local_parameter(bias, spec, (1,))
    out = torch.group_norm(local, local.shape[1] // per_group, w, b, eps)
    return from_local_spec(out, spec.with_dtype(out.dtype))


@register_function_handler(torch.native_group_norm)
def _native_group_norm(func, args, kwargs):
    """aten's group norm called directly (``F.group_norm`` has the handler above), on any
    layout: the channel shards moved to group boundaries (``_groups_whole``: the channels of a
    straddling group move, nothing else), then the group statistics by sharded reductions, so
    the normalised input keeps the input's layout and the mean and rstd ``(N, G)`` are
    sharded like the batch and the groups, replicated over the axes that shard the reduced
    dims (kept by the rank along an axis that holds them whole: NOTE [A sum over a dim one
    rank holds stays with that rank]). Composed of ShardTensor ops, its gradients through all three outputs are autograd's
    (DTensor's rule replicated a sharded spatial dim, and with one group over two channel
    shards gave wrong gradients through the mean and rstd)."""
    a = bind(func, args, kwargs)
    x, weight, bias, groups = a.input, a.weight, a.bias, a.group
    if not accepts(x, replicated=[weight, bias]) or x.ndim < 2:
        return NotImplemented
    channels = x.shape[1]
    if groups <= 0 or channels % groups:
        raise RuntimeError(
            f"native_group_norm: the {channels} channels of an input of shape "
            f"{tuple(x.shape)} do not split into group={groups} groups"
        )
    _check_parameters("native_group_norm", (channels,), weight=weight, bias=bias)
    aligned = _groups_whole(x, channels // groups)
    grouped = aligned.unflatten(1, (groups, channels // groups))
    variance, mean = torch.var_mean(grouped, tuple(range(2, grouped.ndim)), correction=0,
                                    keepdim=True)  # fmt: skip
    inverse_std = torch.rsqrt(variance + a.eps)
    out = ((grouped - mean) * inverse_std).flatten(1, 2)
    affine = (channels,) + (1,) * (x.ndim - 2)
    if weight is not None:
        out = out * weight.reshape(affine)
    if bias is not None:
        out = out + bias.reshape(affine)
    if aligned is not x:
        out = redistribute(out, x._spec.with_dtype(out.dtype))
    return out, mean.flatten(1), inverse_std.flatten(1)


# ---------------------------------------------------------------------------- batch norm
@register_function_handler(F.batch_norm, torch.batch_norm)
def _batch_norm(func, args, kwargs):
    a = bind(func, args, kwargs)
    x, weight, bias = a.input, a.weight, a.bias
    running_mean, running_var = a.running_mean, a.running_var
    if not accepts(x, replicated=[weight, bias], plain=[running_mean, running_var]):
        return NotImplemented
    return _batch_normalized(x, weight, bias, running_mean, running_var, a.training,
                             a.momentum, a.eps)[0]  # fmt: skip


def _with_running(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """The parameters of ``torch.native_batch_norm`` and ``torch._native_batch_norm_legit``."""


def _without_running(input, weight, bias, training, momentum, eps):
    """The parameters of ``torch._native_batch_norm_legit``'s overload with no running
    statistics."""


@register_function_handler(torch.native_batch_norm, _native_batch_norm_legit)
def _native_batch_norm(func, args, kwargs):
    """aten's batch norm called directly: the output as ``F.batch_norm`` lays it out, and the
    batch mean and inverse standard deviation (``(C,)``, not differentiable; empty when not
    training) sharded like the channels, replicated over the other axes."""
    given = len(args) + len(kwargs or {})
    a = bind(func, args, kwargs, signature=_without_running if given == 6 else _with_running)
    x, weight, bias = a.input, a.weight, a.bias
    running_mean, running_var = (None, None) if given == 6 else (a.running_mean, a.running_var)
    if not accepts(x, replicated=[weight, bias], plain=[running_mean, running_var]):
        return NotImplemented
    return _with_statistics(
        x, weight, bias, running_mean, running_var, a.training, a.momentum, a.eps
    )


def _updating(input, weight, bias, running_mean, running_var, momentum, eps):
    """The parameters of ``aten._batch_norm_with_update`` (training, running statistics
    updated in place)."""


@register_function_handler(aten._batch_norm_with_update, aten._batch_norm_with_update.default)
def _batch_norm_with_update(func, args, kwargs):
    """The training batch norm that ``F.batch_norm`` becomes in traced graphs (torch.export,
    AOTAutograd; such a graph run on ShardTensors calls it): as ``torch.native_batch_norm``,
    plus the backend's reserve, an empty byte tensor on each rank (as the native kernel's:
    this path keeps no cuDNN workspace)."""
    a = bind(func, args, kwargs, signature=_updating)
    x, weight, bias = a.input, a.weight, a.bias
    if not accepts(x, replicated=[weight, bias], plain=[a.running_mean, a.running_var]):
        return NotImplemented
    out, mean, inverse_std = _with_statistics(
        x, weight, bias, a.running_mean, a.running_var, True, a.momentum, a.eps
    )
    reserve = out.to_local().new_empty(0, dtype=torch.uint8)
    return out, mean, inverse_std, from_local_spec(reserve, _per_channel(x, 0, torch.uint8))


def _with_statistics(
    x: ShardTensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool,
    momentum: float | None,
    eps: float,
) -> tuple[ShardTensor, ShardTensor, ShardTensor]:
    """Batch norm of ``x`` and its batch mean and inverse standard deviation (``(C,)``, laid
    out by ``_per_channel``; empty when not training), as aten's batch norms return them."""
    out, mean, var = _batch_normalized(
        x, weight, bias, running_mean, running_var, training, momentum, eps
    )
    if mean is None:
        empty = out.to_local().new_empty(0)
        mean = inverse_std = from_local_spec(empty, _per_channel(x, 0, empty.dtype))
        return out, mean, inverse_std
    spec = _per_channel(x, x.shape[1], mean.dtype)
    inverse_std = torch.rsqrt(var + eps).flatten()
    return out, from_local_spec(mean.flatten(), spec), from_local_spec(inverse_std, spec)


def _per_channel(x: ShardTensor, length: int, dtype: torch.dtype) -> ShardTensorSpec:
    """The spec of a ``(length,)`` vector over ``x``'s channels: sharded like them (when
    ``length`` is the channel count), replicated over every other axis."""
    spec = x._spec
    channels = spec.sharding_by_dim.get(1) if length == x.shape[1] else None
    axes = channels.axes if channels is not None else ()
    placements = [Shard(0) if axis in axes else Replicate() for axis in range(spec.mesh.ndim)]
    if channels is None:
        return ShardTensorSpec.build(spec.mesh, placements, (length,), dtype)
    return ShardTensorSpec.build(
        spec.mesh, placements, (length,), dtype, {0: channels.sizes}, order={0: axes}
    )


def _batch_normalized(
    x: ShardTensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool,
    momentum: float | None,
    eps: float,
) -> tuple[ShardTensor, torch.Tensor | None, torch.Tensor | None]:
    """Batch norm of ``x`` (torch's checks, on every rank), its running statistics updated
    in place when training; also this rank's channels' batch means and biased variances
    (``(1, C_local, 1, ...)``; None when not training)."""
    _check_eps("batch_norm", eps, training)
    _check_parameters(
        "batch_norm", (x.shape[1],), weight=weight, bias=bias,
        running_mean=running_mean, running_var=running_var,
    )  # fmt: skip
    if not training:
        if running_mean is None or running_var is None:
            raise RuntimeError("running_mean must be defined in evaluation mode")
        normalized = _with_running_stats(x, running_mean, running_var, eps)
        return _affine(normalized, weight, bias, x, (1,)), None, None
    if x.numel() // x.shape[1] == 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size {list(x.shape)}"
        )
    out, mean, var, stats = _channel_normalized(x, x.shape[1], True, weight, bias, eps)
    if running_mean is not None or running_var is not None:
        n = stats.total
        batch = _channels_whole(x, torch.stack([mean, var * (n / (n - 1))]).flatten(1))
        _update_running(running_mean, batch[0], momentum)
        _update_running(running_var, batch[1], momentum)
    return out, mean, var


# ---------------------------------------------------------------------------- instance norm
@register_function_handler(F.instance_norm, torch.instance_norm)
def _instance_norm(func, args, kwargs):
    a = bind(func, args, kwargs)
    x, weight, bias = a.input, a.weight, a.bias
    running_mean, running_var = a.running_mean, a.running_var
    if not accepts(x, replicated=[weight, bias], plain=[running_mean, running_var]):
        return NotImplemented
    eps = a.eps
    _check_parameters(
        "instance_norm", (x.shape[1],), weight=weight, bias=bias,
        running_mean=running_mean, running_var=running_var,
    )  # fmt: skip
    if not a.use_input_stats:
        if running_mean is None or running_var is None:
            raise RuntimeError(
                "Expected running_mean and running_var to be defined when use_input_stats is false"
            )
        normalized = _with_running_stats(x, running_mean, running_var, eps)
        return _affine(normalized, weight, bias, x, (1,))
    if math.prod(x.shape[2:]) == 1:
        raise ValueError(
            f"Expected more than 1 spatial element when training, got input size {list(x.shape)}"
        )
    out, mean, var, stats = _channel_normalized(x, x.shape[1], False, weight, bias, eps)
    if running_mean is not None or running_var is not None:
        n = stats.total
        batch = _batch_mean(x, torch.stack([mean, var * (n / (n - 1))]).flatten(2))
        batch = _channels_whole(x, batch)
        _update_running(running_mean, batch[0], a.momentum)
        _update_running(running_var, batch[1], a.momentum)
    return out


def _batch_mean(x: ShardTensor, per_instance: torch.Tensor) -> torch.Tensor:
    """Mean over the whole batch of stacked per-instance values ``(k, N_local, C, 1, ...)``:
    one all-reduce over the axes sharding N, when it is sharded."""
    total = per_instance.sum(1)
    batch = x._spec.sharding_by_dim.get(0)
    if batch is not None:
        total = all_reduce(total, axis_group(x._spec.mesh, batch.axes), "sum")
    return total / x.shape[0]


# ---------------------------------------------------------------------------- layer norm
@register_function_handler(F.layer_norm, torch.layer_norm)
def _layer_norm(func, args, kwargs):
    a = bind(func, args, kwargs)
    x, weight, bias = a.input, a.weight, a.bias
    if not accepts(x, replicated=[weight, bias]):
        return NotImplemented
    dims = _layer_norm_dims(x, a.normalized_shape, weight, bias)
    if _local_kernel_suffices(x, dims, weight, bias):
        w, b = (_local_parameter(p, x._spec, dims) for p in (weight, bias))
        out = torch.layer_norm(x.to_local(), x.shape[dims[0] :], w, b, a.eps)
        return from_local_spec(out, x._spec.with_dtype(out.dtype))
    normalized, *_ = _normalized(x, dims, a.eps)
    return _affine(normalized, weight, bias, x, dims)


@register_function_handler(torch.native_layer_norm)
def _native_layer_norm(func, args, kwargs):
    """aten's layer norm called directly: the output as ``F.layer_norm`` lays it out, and the
    row means and reciprocal standard deviations (``(*rows, 1, ..., 1)``, not
    differentiable) sharded like the rows, replicated over the axes that shard normalised
    dims (every rank of those holds the same statistics)."""
    a = bind(func, args, kwargs)
    x, weight, bias = a.input, a.weight, a.bias
    if not accepts(x, replicated=[weight, bias]):
        return NotImplemented
    dims = _layer_norm_dims(x, a.normalized_shape, weight, bias)
    normalized, mean, var, _ = _normalized(x, dims, a.eps)
    out = _affine(normalized, weight, bias, x, dims)
    spec = x._spec
    placements = [
        Replicate() if isinstance(p, Shard) and p.dim in dims else p for p in spec.placements
    ]
    rows = [s for s in spec.shardings if s.dim not in dims]
    shape = [1 if d in dims else n for d, n in enumerate(spec.shape)]
    row_spec = ShardTensorSpec.build(
        spec.mesh, placements, shape, mean.dtype, {s.dim: s.sizes for s in rows},
        order={s.dim: s.axes for s in rows},
    )  # fmt: skip
    rstd = torch.rsqrt(var + a.eps)
    return out, from_local_spec(mean, row_spec), from_local_spec(rstd, row_spec)


# ---------------------------------------------------------------------------- rms norm
@register_function_handler(F.rms_norm, torch.rms_norm)
def _rms_norm(func, args, kwargs):
    """Like LayerNorm over the trailing dims, sharded or not, without centring: the output
    in the input's layout."""
    a = bind(func, args, kwargs)
    x, weight = a.input, a.weight
    if not accepts(x, replicated=[weight]):
        return NotImplemented
    dims = _layer_norm_dims(x, a.normalized_shape, weight, None)
    eps = torch.finfo(x.dtype).eps if a.eps is None else a.eps
    stats = _Statistics.over(x._spec, dims)
    normalized = _RootMeanSquare.apply(x.to_local(), dims, stats, eps)
    return _affine(normalized, weight, None, x, dims)


def _layer_norm_dims(
    x: ShardTensor, normalized_shape: int | Sequence[int], weight, bias
) -> tuple[int, ...]:
    """The dims a layer norm over ``normalized_shape`` reduces; torch's checks, on every rank."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not 0 < len(shape) <= x.ndim or tuple(x.shape[x.ndim - len(shape) :]) != shape:
        raise RuntimeError(
            f"layer_norm: normalized_shape={list(shape)} does not match the trailing dims of "
            f"an input of shape {tuple(x.shape)}"
        )
    _check_parameters("layer_norm", shape, weight=weight, bias=bias)
    return tuple(range(x.ndim - len(shape), x.ndim))
