"""A two-operand einsum whose operands shard different dims over the same group of ranks.

NOTE [Ring product]
Over the mesh axes of one group, the *staying* operand is sharded along a letter its rank
keeps (the query rows of ``q @ k^T`` or of ``attn @ v``) and the *moving* operand along
another letter ``c`` (the keys). Each rank computes its own rows against every block ``j`` of
the moving operand, met by the ring or the all-gather of ``_ring`` (NOTE [Ring or
all-gather])::

    out_j = einsum(equation, staying_j, moving_j)

where ``staying_j`` is the staying operand narrowed to block ``j``'s range of ``c`` when it
has ``c`` (the key columns of ``attn``), else the whole local operand. When the output has
``c``, block ``j`` gives its range of ``c`` (the columns of the scores); else the blocks' terms
are summed (``attn @ v``: a sum over keys). The output holds ``c`` whole.

The backward is the adjoint, exact, and itself a ring: for each block ``j``,
``grad staying_j = einsum(grad_j, conj(moving_j))`` (placed or summed like ``out_j``), and the
gradient of block ``j`` of the moving operand is the sum over the group of every rank's
``einsum(grad_j, conj(staying_j))``, carried to its owner behind the block
(:func:`circulate_gradients`) or returned by one reduce-scatter after the all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardsci.tensor._first_order import first_order_only
from shardsci.tensor._ops._autocast import cast_for_autocast
from shardsci.tensor._ops._ring import (
    Blocks,
    all_gather_blocks,
    circulate,
    circulate_gradients,
    reduce_scatter_blocks,
)

__all__ = ["ProductPlan", "ring_product"]


@dataclass(frozen=True)
class ProductPlan:
    """Everything about one ring product that is the same on every rank of the group.

    Attributes
    ----------
    staying, moving : str
        The einsum subscripts of the staying and the moving operand (each letter once).
    output : str
        The output's subscript.
    moving_first : bool
        Whether the moving operand is the einsum's first operand.
    letter : str
        The letter the moving operand is sharded along over the group.
    blocks : Blocks
        The moving operand's blocks: the group, each block's extent along ``letter``, and its
        position in ``moving``.
    ring : bool
        Ring exchange; else all-gather (NOTE [Ring or all-gather]).
    """

    staying: str
    moving: str
    output: str
    moving_first: bool
    letter: str
    blocks: Blocks
    ring: bool

    def product(self, staying: torch.Tensor, moving: torch.Tensor) -> torch.Tensor:
        """The einsum of local operands, in the caller's operand order."""
        if self.moving_first:
            return torch.einsum(f"{self.moving},{self.staying}->{self.output}", moving, staying)
        return torch.einsum(f"{self.staying},{self.moving}->{self.output}", staying, moving)

    def part(self, t: torch.Tensor, subscript: str, owner: int) -> torch.Tensor:
        """``t`` (indexed by ``subscript``) narrowed to block ``owner``'s range of the
        letter, or ``t`` itself when it lacks the letter."""
        if self.letter not in subscript:
            return t
        dim = subscript.index(self.letter)
        return t.narrow(dim, self.blocks.starts[owner], self.blocks.sizes[owner])

    def adjoint(
        self, grad: torch.Tensor, other: torch.Tensor, other_sub: str, target_sub: str, shape
    ) -> torch.Tensor:
        """The gradient, of ``shape``, of the operand indexed by ``target_sub`` given the
        output's gradient and the other operand. Letters only the target has (summed in the
        forward) get the same gradient at every index; a dim of size 1 that broadcast gets
        the sum over the dim it met."""
        kept = "".join(c for c in target_sub if c in self.output or c in other_sub)
        result = torch.einsum(f"{self.output},{other_sub}->{kept}", grad, other.conj())
        for dim, c in enumerate(target_sub):
            if c not in kept:
                result = result.unsqueeze(dim)
        broadcast = [d for d, n in enumerate(shape) if n == 1 and result.shape[d] != 1]
        if broadcast:  # a dim of size 1 that met a larger one
            result = result.sum(broadcast, keepdim=True)
        return result.expand(shape)


def ring_product(staying: torch.Tensor, moving: torch.Tensor, plan: ProductPlan) -> torch.Tensor:
    """Differentiable ``einsum`` of local ``staying`` and ``moving`` over the moving operand's
    blocks in the whole group (NOTE [Ring product]); the output holds the letter whole."""
    with cast_for_autocast(staying, moving) as (staying, moving):
        return _RingProduct.apply(staying, moving, plan)


class _RingProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, staying, moving, plan):  # type: ignore[override]
        gathered = None
        if plan.ring:
            out = _ring_forward(staying, moving, plan)
        else:
            gathered = all_gather_blocks(moving, plan.blocks)
            out = plan.product(staying, gathered)
        ctx.save_for_backward(staying, moving, gathered)
        ctx.plan = plan
        return out

    @staticmethod
    @first_order_only("a ring product")
    def backward(ctx, grad):  # type: ignore[override]
        staying, moving, gathered = ctx.saved_tensors
        plan, (wants_staying, wants_moving) = ctx.plan, ctx.needs_input_grad[:2]
        if gathered is not None:
            grad_staying = grad_moving = None
            if wants_staying:
                grad_staying = plan.adjoint(
                    grad, gathered, plan.moving, plan.staying, staying.shape
                )
            if wants_moving:
                whole = plan.adjoint(grad, staying, plan.staying, plan.moving, gathered.shape)
                grad_moving = reduce_scatter_blocks(whole, plan.blocks)
            return grad_staying, grad_moving, None
        return (*_ring_backward(grad, staying, moving, plan, wants_staying, wants_moving), None)


def _ring_forward(staying, moving, plan: ProductPlan) -> torch.Tensor:
    out = None
    for owner, block in circulate(moving, plan.blocks):
        term = plan.product(plan.part(staying, plan.staying, owner), block)
        if plan.letter not in plan.output:
            out = term if out is None else out + term
            continue
        if out is None:
            shape = list(term.shape)
            shape[plan.output.index(plan.letter)] = sum(plan.blocks.sizes)
            out = term.new_zeros(shape)
        plan.part(out, plan.output, owner).copy_(term)
    return out


def _ring_backward(grad, staying, moving, plan: ProductPlan, wants_staying, wants_moving):
    """Gradients of both local operands (None where not wanted), the blocks met by the ring."""
    grad_staying = torch.zeros_like(staying) if wants_staying else None

    def contribution(owner: int, block: torch.Tensor) -> torch.Tensor | None:
        grad_part = plan.part(grad, plan.output, owner)
        staying_part = plan.part(staying, plan.staying, owner)
        if grad_staying is not None:
            term = plan.adjoint(grad_part, block, plan.moving, plan.staying, staying_part.shape)
            plan.part(grad_staying, plan.staying, owner).add_(term)
        if not wants_moving:
            return None
        return plan.adjoint(grad_part, staying_part, plan.staying, plan.moving, block.shape)

    if not wants_moving:
        for owner, block in circulate(moving, plan.blocks):
            contribution(owner, block)
        return grad_staying, None
    return grad_staying, circulate_gradients(moving, plan.blocks, contribution)
