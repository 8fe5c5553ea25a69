"""Exact attention of a local query block over key/value blocks spread along one axis group.

NOTE [Ring attention]
Each rank of the group holds a query block (rows ``[l0, l0 + L_r)`` of the sequence) and a
key/value block (keys ``[s0_j, s0_j + S_j)`` on flat index j). The output is the softmax over
ALL keys, computed block by block with the log-sum-exp of each block's scores: for block j,
``out_j = softmax(s_j) v_j`` and ``lse_j = logsumexp(s_j)``, combined as
``lse = logaddexp(lse, lse_j)``, ``out = out e^{lse_old - lse} + out_j e^{lse_j - lse}``: the
online softmax, exact up to rounding. Rows whose every key is masked get output 0, zero
gradients and ``lse = -inf`` (as torch's math backend). The key/value blocks travel
(concatenated, one block per rank) by the ring or the all-gather of ``_ring``, chosen in
``_attention_ops`` (NOTE [Ring or all-gather]): in the ring's backward, each block's gradient
accumulator is the sum of every query block's contribution to its keys and values. (Called as
the fused kernel's two aten ops, from inside ``nn.MultiheadAttention``, the all-gather's
backward cannot keep the blocks and gathers them again.)
A block is computed by the CPU's fused kernel where it can (NOTE [A block's attention by the
fused kernel]), else with plain matmuls, so that empty blocks (a rank with no queries or no
keys) are ordinary zero-size products; in a lower precision, with float32 inside (NOTE [Ring
attention in a lower precision]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from shardsci.tensor._collectives import AxisGroup
from shardsci.tensor._first_order import first_order_only
from shardsci.tensor._ops._autocast import cast_for_autocast
from shardsci.tensor._ops._common import cut_to, padded_to
from shardsci.tensor._ops._ring import (
    Blocks,
    all_gather_blocks,
    circulate,
    circulate_gradients,
    reduce_scatter_blocks,
)

__all__ = ["AttentionPlan", "attend", "attention_backward", "attention_forward"]


@dataclass(frozen=True)
class AttentionPlan:
    """Everything about one attention call that is the same on every rank of the group.

    Attributes
    ----------
    group : AxisGroup or None
        The ranks whose key/value blocks this rank's queries must see; None when this rank
        holds every key.
    key_starts, key_sizes : tuple of int
        Global first key and number of keys of each flat index's block.
    query_start : int
        Global index of this rank's first query (for ``causal``).
    scale : float
        Factor applied to ``q k^T``.
    causal : bool
        Query ``i`` sees keys ``j <= i`` (global indices, top-left aligned like torch).
    kv_repeats : int
        Query heads per key/value head (grouped-query attention), 1 without.
    ring : bool
        Ring exchange; else all-gather (NOTE [Ring or all-gather]).
    """

    group: AxisGroup | None
    key_starts: tuple[int, ...]
    key_sizes: tuple[int, ...]
    query_start: int
    scale: float
    causal: bool
    kv_repeats: int
    ring: bool

    @property
    def blocks(self) -> Blocks:
        """The key/value blocks ``(*B, H_{kv}, S_j, E + E_v)`` of the group (a plan with one)."""
        return Blocks(self.group, self.key_sizes, -2)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    plan: AttentionPlan,
) -> torch.Tensor:
    """Differentiable attention of local ``q`` ``(*B, H_q, L_r, E)`` over the keys of the
    whole group; ``k``, ``v`` ``(*B, H_{kv}, S_r, E / E_v)`` are this rank's blocks and
    ``mask`` (bool: True takes part; float: added to the scores) broadcasts to
    ``(*B, H_q, L_r, S)`` over ALL keys. Returns ``(*B, H_q, L_r, E_v)``."""
    if _all_keys_here(q, k, mask, plan):
        shape = (*q.shape[:-1], v.shape[-1])
        q, k, v = (padded_to(t, {d: 1 for d in range(t.ndim) if not t.shape[d]}) for t in (q, k, v))
        out = F.scaled_dot_product_attention(
            q, k, v, scale=plan.scale, is_causal=plan.causal, enable_gqa=plan.kv_repeats > 1
        )
        return cut_to(out, dict(enumerate(shape)))
    with cast_for_autocast(q, k, v, mask) as (q, k, v, mask):
        return _Attention.apply(q, k, v, mask, plan)


# NOTE [Attention over keys all held here is torch's]
# Where this rank holds every key (no group: a one-rank mesh, or a sequence no rank splits),
# no block is exchanged and nothing needs a log-sum-exp: torch's own
# ``F.scaled_dot_product_attention`` of the local blocks is the answer, forward and backward,
# with whichever kernel torch picks on the device. On CUDA that is the flash or
# memory-efficient kernel, which never holds the L x S scores; the Function below computes
# them with matmuls off the CPU (NOTE [A block's attention by the fused kernel]), and a
# one-rank ViT step at 64² on an H200 held 85 MB against plain torch's 2.6 MB
# (``scripts/gpu_check.sh``, 2026-11-29). Taken without a mask (a row every key of which is
# masked is 0 here, NaN in some fused kernels) and for causal attention only where the
# queries start at row 0 (torch's diagonal). An empty block (a rank with an empty batch or
# head shard; fused kernels refuse them) runs torch's attention on its blocks padded with
# zeros to one cell per empty dim, keeping none of the output (NOTE [A rank with an empty
# shard computes nothing] in ``_common``): that rank then builds the same graph as its peers,
# so a second derivative neither raises on it alone (the Function below is first order only)
# nor, through a kernel torch cannot differentiate twice, raises on the others alone while it
# waits in a collective.
def _all_keys_here(q: torch.Tensor, k: torch.Tensor, mask, plan: AttentionPlan) -> bool:
    return (
        (plan.group is None or plan.group.size == 1)
        and mask is None
        and (not plan.causal or plan.query_start == 0)
    )


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, plan):  # type: ignore[override]
        out, lse, gathered = attention_forward(q, k, v, mask, plan)
        ctx.save_for_backward(q, k, v, mask, out, lse, gathered)
        ctx.plan = plan
        return out

    @staticmethod
    @first_order_only("attention over a split sequence")
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, mask, out, lse, gathered = ctx.saved_tensors
        wants_mask = mask is not None and mask.is_floating_point() and ctx.needs_input_grad[3]
        grads = attention_backward(
            grad_out, q, k, v, mask, ctx.plan, out, lse, gathered, wants_mask
        )
        return (*grads, None)


def attention_forward(q, k, v, mask, plan):
    """Output ``(*B, H_q, L_r, E_v)`` in ``q``'s dtype, log-sum-exp ``(*B, H_q, L_r)`` (float32
    for bfloat16 or float16 operands: NOTE [Ring attention in a lower precision]) and, for
    the all-gather, the gathered keys and values (else None)."""
    kv = None
    if plan.group is None or plan.group.size == 1:
        out, lse = _block_forward(q, k, v, mask, plan, 0)
    elif plan.ring:
        out, lse = _ring_forward(q, k, v, mask, plan)
    else:
        kv = all_gather_blocks(torch.cat([k, v], dim=-1), plan.blocks)
        width = k.shape[-1]
        out, lse = _block_forward(q, kv[..., :width], kv[..., width:], mask, plan, 0)
    return out.to(q.dtype), lse, kv


def attention_backward(grad_out, q, k, v, mask, plan, out, lse, gathered, mask_grad):
    """Gradients ``(q, k, v, mask)`` of this rank's blocks (the mask's None unless
    ``mask_grad``); ``gathered`` as returned by :func:`attention_forward` (None: gather
    again)."""
    wide = _accumulator(q.dtype)
    delta = (grad_out.to(wide) * out.to(wide)).sum(-1)
    state = _BackwardState(grad_out, q, mask, plan, out, lse, delta, mask_grad)
    width = k.shape[-1]
    if plan.group is None or plan.group.size == 1:
        grads = state.block(k, v, mask, 0)
        grad_k, grad_v, grad_mask = grads.k, grads.v, grads.mask
    elif plan.ring:
        grad_k, grad_v = _ring_backward(state, k, v)
        grad_mask = state.grad_mask
    else:
        if gathered is None:
            gathered = all_gather_blocks(torch.cat([k, v], dim=-1), plan.blocks)
        grads = state.block(gathered[..., :width], gathered[..., width:], mask, 0)
        mine = reduce_scatter_blocks(_sent(torch.cat([grads.k, grads.v], dim=-1), k), plan.blocks)
        grad_k, grad_v, grad_mask = mine[..., :width], mine[..., width:], grads.mask
    return (
        state.grad_q.to(q.dtype),
        grad_k.to(k.dtype),
        grad_v.to(v.dtype),
        None if grad_mask is None else grad_mask.to(mask.dtype),
    )


# ---------------------------------------------------------------------------- block math
def _expanded(kv: torch.Tensor, repeats: int) -> torch.Tensor:
    return kv if repeats == 1 else kv.repeat_interleave(repeats, dim=-3)


def _grouped(grad: torch.Tensor, repeats: int) -> torch.Tensor:
    """Sum the gradients of the query heads that shared one key/value head."""
    if repeats == 1:
        return grad
    shape = grad.shape
    return grad.reshape(*shape[:-3], shape[-3] // repeats, repeats, *shape[-2:]).sum(-3)


def _mask_block(mask: torch.Tensor | None, start: int, size: int) -> torch.Tensor | None:
    if mask is None or mask.shape[-1] == 1:
        return mask
    return mask.narrow(-1, start, size)


def _scores(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor | None,
    plan: AttentionPlan,
    key_start: int,
) -> torch.Tensor:
    """Masked scaled scores ``(*B, H_q, L_r, S_j)`` of the queries against one key block."""
    scores = torch.matmul(q, _expanded(k, plan.kv_repeats).transpose(-2, -1)) * plan.scale
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask
    if plan.causal:
        rows = torch.arange(q.shape[-2], device=q.device) + plan.query_start
        cols = torch.arange(k.shape[-2], device=q.device) + key_start
        scores = scores.masked_fill(cols[None, :] > rows[:, None], -math.inf)
    return scores


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with the rows that saw no key at 0, so ``exp(score - lse)`` is 0 there."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


# NOTE [A block's attention by the fused kernel]
# Where the CPU's fused attention kernel can compute a block (no mask, not causal, one head
# size for keys and values, 4-D, no empty dim: the kernel fails on those), it does, returning
# the block's log-sum-exp beside its output, so that the ring merges blocks as before; the
# block's scores are never held whole (the unfused path holds L_r x S_j of them per head).
# Its backward takes the whole output and log-sum-exp, which restrict exactly to any block
# of keys (probabilities exp(score - lse), delta = rowsum(grad_out * out)), so each block's
# gradients are the fused backward's on that block. Elsewhere (a mask, causal blocks whose
# diagonal is offset, CUDA) the scores are computed here.
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_FLASH_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# NOTE [Ring attention in a lower precision]
# Torch's fused attention kernels take bfloat16 (or float16) operands but keep float32 inside:
# the scores, their softmax and log-sum-exp, the output's accumulator; in backward, delta and
# dS. The ring does the same, so that a split sequence is as accurate as one process's kernel
# (``tests/test_autocast.py``: rounding scores, probabilities and the running output in
# bfloat16 made the gradients' errors up to 5.4x one process's; now at most 1.4x). The fused
# kernel takes a bfloat16 block as it is (its output rounded once per block, its log-sum-exp
# float32); elsewhere the block's operands are widened to float32 for its matmuls. Those
# copies are of one block, not of the sequence: the query, key and value blocks, the output's
# gradient, and the L_r x S_j scores per head in float32. Measured on one block of 8 heads x
# 512 queries x 512 keys, E = 64 (``LiveMemory``): peak 13 -> 27 MiB forward and 23 -> 46 MiB
# backward by matmuls, about 7 and 11 bytes more per score; where the fused kernel takes the
# block, 0.5 and 2.5 MiB (its own workspace not counted). Across blocks, the output and the
# query's and mask's gradients accumulate in float32, cast to the operands' dtype once at the
# end. A key or value block's gradient crosses ranks in the operands' dtype, so the backward
# moves the bytes it moved before: each rank's share is rounded once before the ranks add
# them, as in a sharded linear layer's weight gradient (float32 there would move 1.5x the
# backward's bytes, for key gradients 1.12x one process's error instead of 1.37x). float32
# and float64 operands are computed exactly as before (nothing is widened).
_NARROW = (torch.float16, torch.bfloat16)


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """The dtype a block's softmax and the sums across blocks are kept in."""
    return torch.float32 if dtype in _NARROW else dtype


def _widened(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.dtype not in _NARROW else t.float()


def _sent(grads: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A key/value block's gradient as it crosses ranks: in ``like``'s dtype (NOTE above)."""
    return grads.to(like.dtype)


def _fused(q, k, v, mask, plan) -> bool:
    return (
        q.device.type == "cpu"
        and mask is None
        and not plan.causal
        and q.ndim == 4
        and q.numel() > 0
        and k.numel() > 0
        and k.shape[-1] == v.shape[-1]
        and q.dtype in _FLASH_DTYPES
    )


def _block_forward(q, k, v, mask, plan, key_start):
    """One block's (output, log-sum-exp)."""
    if _fused(q, k, v, mask, plan):
        repeats = plan.kv_repeats
        return _FLASH(q, _expanded(k, repeats), _expanded(v, repeats), scale=plan.scale)
    q, k, v, mask = (_widened(t) for t in (q, k, v, mask))
    scores = _scores(q, k, mask, plan, key_start)
    lse = torch.logsumexp(scores, dim=-1)
    probabilities = torch.exp(scores - _finite(lse)[..., None])
    return torch.matmul(probabilities, _expanded(v, plan.kv_repeats)), lse


def _combine(out, lse, block_out, block_lse):
    """Merge a block's partial softmax into the running one (NOTE [Ring attention])."""
    if out is None:
        return block_out.to(_accumulator(block_out.dtype)), block_lse
    total = torch.logaddexp(lse, block_lse)
    finite = _finite(total)
    out = (
        out * torch.exp(lse - finite)[..., None]
        + block_out * torch.exp(block_lse - finite)[..., None]
    )
    return out, total


@dataclass
class _Grads:
    """Gradients of one key/value block and of its mask columns."""

    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None


def _block_backward(q, k, v, mask, plan, key_start, grad_out, out, lse, delta, grad_q, mask_grad):
    """Add one block's contribution to ``grad_q`` (in place) and return the block's grads.

    ``out`` and ``lse`` are over all keys, ``delta = rowsum(grad_out * out)``; ``mask_grad``:
    whether the mask needs a gradient.
    """
    repeats = plan.kv_repeats
    if _fused(q, k, v, mask, plan):
        block_grad_q, grad_k, grad_v = _FLASH_BACKWARD(
            grad_out, q, _expanded(k, repeats), _expanded(v, repeats), out, lse, 0.0, False,
            scale=plan.scale,
        )  # fmt: skip
        grad_q += block_grad_q
        return _Grads(_grouped(grad_k, repeats), _grouped(grad_v, repeats), None)
    q, k, v, mask, grad_out = (_widened(t) for t in (q, k, v, mask, grad_out))
    scores = _scores(q, k, mask, plan, key_start)
    probabilities = torch.exp(scores - _finite(lse)[..., None])
    grad_v = torch.matmul(probabilities.transpose(-2, -1), grad_out)
    grad_p = torch.matmul(grad_out, _expanded(v, plan.kv_repeats).transpose(-2, -1))
    grad_scores = probabilities * (grad_p - delta[..., None])
    grad_q += torch.matmul(grad_scores, _expanded(k, plan.kv_repeats)) * plan.scale
    grad_k = torch.matmul(grad_scores.transpose(-2, -1), q) * plan.scale
    block_mask_grad = _reduced_to(grad_scores, mask.shape) if mask_grad else None
    return _Grads(
        _grouped(grad_k, plan.kv_repeats), _grouped(grad_v, plan.kv_repeats), block_mask_grad
    )


def _reduced_to(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Sum ``grad`` over the dims a tensor of ``shape`` was broadcast along."""
    extra = grad.ndim - len(shape)
    grad = grad.sum(tuple(range(extra))) if extra else grad
    dims = tuple(d for d, n in enumerate(shape) if n == 1 and grad.shape[d] != 1)
    return grad.sum(dims, keepdim=True) if dims else grad


@dataclass
class _BackwardState:
    """What every block's backward reads, and the query's (and mask's) gradient it adds to."""

    grad_out: torch.Tensor
    q: torch.Tensor
    mask: torch.Tensor | None
    plan: AttentionPlan
    out: torch.Tensor
    lse: torch.Tensor
    delta: torch.Tensor
    mask_grad: bool
    grad_q: torch.Tensor = field(init=False)
    grad_mask: torch.Tensor | None = field(init=False)

    def __post_init__(self) -> None:
        self.grad_q = torch.zeros_like(self.q, dtype=_accumulator(self.q.dtype))
        self.grad_mask = None
        if self.mask_grad:
            self.grad_mask = torch.zeros_like(self.mask, dtype=_accumulator(self.mask.dtype))

    def block(self, k, v, mask, key_start) -> _Grads:
        return _block_backward(
            self.q, k, v, mask, self.plan, key_start,
            self.grad_out, self.out, self.lse, self.delta, self.grad_q, self.mask_grad,
        )  # fmt: skip

    def ring_block(self, owner: int, kv: torch.Tensor, width: int) -> torch.Tensor:
        """One block of the ring; its key and value gradients concatenated like ``kv``."""
        start, size = self.plan.key_starts[owner], self.plan.key_sizes[owner]
        grads = self.block(
            kv[..., :width], kv[..., width:], _mask_block(self.mask, start, size), start
        )
        if self.grad_mask is not None:
            if self.grad_mask.shape[-1] == 1:
                self.grad_mask += grads.mask
            else:
                self.grad_mask.narrow(-1, start, size).copy_(grads.mask)
        return _sent(torch.cat([grads.k, grads.v], dim=-1), kv)


# ---------------------------------------------------------------------------- ring
def _ring_forward(q, k, v, mask, plan):
    width = k.shape[-1]
    out = lse = None
    for owner, kv in circulate(torch.cat([k, v], dim=-1), plan.blocks):
        start, size = plan.key_starts[owner], plan.key_sizes[owner]
        block_mask = _mask_block(mask, start, size)
        block = _block_forward(q, kv[..., :width], kv[..., width:], block_mask, plan, start)
        out, lse = _combine(out, lse, *block)
    return out, lse


def _ring_backward(state: _BackwardState, k, v):
    width = k.shape[-1]
    grads = circulate_gradients(
        torch.cat([k, v], dim=-1),
        state.plan.blocks,
        lambda owner, kv: state.ring_block(owner, kv, width),
    )
    return grads[..., :width], grads[..., width:]
