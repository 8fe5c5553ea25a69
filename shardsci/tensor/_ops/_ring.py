"""Blocks of one sharded dim met by every rank of a group: passed around a ring, or gathered.

Attention over a sharded sequence (``_ring_attention``) and a product of two operands sharded
over the same mesh axes on different dims (``_ring_product``) both need every rank to meet
every rank's block of one operand. This module moves the blocks; the callers compute on them.

NOTE [Ring or all-gather]
- **ring**: the blocks travel around the group (flat index i sends to i + 1), one hop per step,
  the next hop in flight while the current block is computed on (:func:`circulate`). The
  backward passes the blocks around once more, each block's gradient accumulator one hop
  behind it, so that it arrives at the block's owner last, holding the sum of every rank's
  contribution (:func:`circulate_gradients`). Bytes received per rank: forward ``S - S_r``
  rows; backward ``S - S_r`` rows plus ``S - S_{r-1}`` gradient rows. Memory: one block
  (plus one in flight) at a time. Where no rank has any of the dim (``S = 0``), no hop is
  made (:meth:`Blocks.any_moves`), as the all-gather of nothing makes no collective.
- **all-gather**: every rank receives every block at once (``S - S_r`` rows, one exchange,
  :func:`all_gather_blocks`) and keeps them for the backward, which returns each block's
  gradient to its owner in one reduce-scatter (``(N - 1) S_r`` rows received,
  :func:`reduce_scatter_blocks`). Memory: the whole operand, per call, until the backward.
Both move the same bytes in the forward; over a training step the all-gather moves about 2/3
of the ring's bytes in 2 collectives instead of 3 (N - 1) hops (a message each way, or on
gloo one all-to-all: ``_Shift``), but holds the whole gathered operand on every rank. So
(:func:`ring_chosen`): gather while the operand this rank would hold gathered is at most
``gather_limit_bytes`` (default 16 MiB, ``shardsci.attention_exchange``), the ring above
that, where memory stays at one block per rank. The callers pass bytes computed from global
sizes and the shards of dims sharded over other mesh axes, which every rank of a group
shares, so the ranks of a group decide alike.
:func:`all_gather_blocks` is the only place either caller gathers an operand whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from shardsci.tensor._collectives import AxisGroup, exchange, start_send_recv
from shardsci.tensor._gather_guard import may_gather_blocks
from shardsci.tensor._options import attention_exchange_choice
from shardsci.tensor._spec import ShardTensorSpec

__all__ = [
    "Blocks",
    "all_gather_blocks",
    "circulate",
    "circulate_gradients",
    "reduce_scatter_blocks",
    "ring_chosen",
    "sum_around",
]


@dataclass(frozen=True)
class Blocks:
    """How one dim of a local tensor is split over the ranks of a group.

    Attributes
    ----------
    group : AxisGroup
        The ranks holding the blocks; flat index ``j`` holds block ``j``.
    sizes : tuple of int
        Extent of each flat index's block along ``dim`` (row-major over the group's axes,
        as a ``DimSharding``'s sizes).
    dim : int
        The dim of a block along which the blocks follow one another (negative from the end).
    """

    group: AxisGroup
    sizes: tuple[int, ...]
    dim: int

    @property
    def starts(self) -> tuple[int, ...]:
        """Where each block starts along the whole dim."""
        return tuple(sum(self.sizes[:j]) for j in range(len(self.sizes)))

    def shape(self, like: torch.Tensor, owner: int) -> tuple[int, ...]:
        """The shape of block ``owner`` of a tensor shaped like ``like`` elsewhere."""
        shape = list(like.shape)
        shape[self.dim] = self.sizes[owner]
        return tuple(shape)

    def any_moves(self, like: torch.Tensor) -> bool:
        """Whether any block of a tensor shaped like ``like`` holds an element. Where none
        does (a sequence no rank has), no hop moves anything on any rank and none is made;
        every rank of the group decides alike (``like``'s other dims are split by other mesh
        axes, the same across the group)."""
        return any(math.prod(self.shape(like, owner)) for owner in range(len(self.sizes)))


def ring_chosen(
    gathered_bytes: int, operands: Sequence[tuple[ShardTensorSpec, int]], what: str
) -> bool:
    """NOTE [Ring or all-gather]: the ring, unless forced otherwise or the operands this rank
    would hold gathered (``gathered_bytes``; each a spec and the dim it is sharded along) are
    within the gather limit and the gather policy allows the gather (NOTE [Gathers an op was
    not asked to make]: under ``"error"`` the ring runs instead)."""
    choice = attention_exchange_choice()
    if choice.mode != "auto":
        return choice.mode == "ring"
    return gathered_bytes > choice.gather_limit_bytes or not may_gather_blocks(
        operands, what, gathered_bytes
    )


class _Shift:
    """One hop around the ring: send a block to the next rank, receive the previous rank's.

    Empty blocks travel as no message: both sides know every block's shape. Every rank of the
    group makes every hop (its block empty or not), so a hop goes as one all-to-all where
    messages are slow (NOTE [An exchange of messages as one all-to-all where messages are
    slow]: gloo), as a halo exchange does; no rank makes a hop in which no block moves
    (``moves`` False: ``Blocks.any_moves``), as no rank makes a halo step nobody exchanges in."""

    def __init__(
        self, group: AxisGroup, block: torch.Tensor, incoming: tuple[int, ...], moves: bool
    ):
        me, n = group.index, group.size
        self.incoming = incoming
        self.like = block
        self.pending = None
        if not moves:
            return
        sends = [((me + 1) % n, block)] if block.numel() else []
        receives = [((me - 1) % n, incoming)] if math.prod(incoming) else []
        self.pending = start_send_recv(
            group,
            sends,
            receives,
            dtype=block.dtype,
            device=block.device,
            kind="p2p",
            everyone_joins=True,
        )

    def wait(self) -> torch.Tensor:
        received = self.pending.wait() if self.pending is not None else []
        if received:
            return received[0]
        return self.like.new_zeros(self.incoming)


def circulate(block: torch.Tensor, blocks: Blocks) -> Iterator[tuple[int, torch.Tensor]]:
    """Every block of the group, this rank's own first: ``(owner, block)`` pairs in ring order.

    The next hop is in flight while the caller computes on the block just yielded; the caller
    must consume every pair (every rank of the group takes part in every hop)."""
    group = blocks.group
    me, n = group.index, group.size
    moves = blocks.any_moves(block)
    for step in range(n):
        owner = (me - step) % n
        incoming = blocks.shape(block, (owner - 1) % n)
        hop = _Shift(group, block, incoming, moves) if step < n - 1 else None
        yield owner, block
        if hop is not None:
            block = hop.wait()


def circulate_gradients(
    block: torch.Tensor,
    blocks: Blocks,
    contribution: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The gradient of this rank's block: the sum over the group of every rank's
    ``contribution(owner, block)`` (a tensor shaped like the block) to it.

    The other ranks' blocks come first, in ring order, each block's gradient accumulator one
    hop behind it (:func:`sum_around`); this rank's own block last, when its accumulator has
    come home."""
    me = blocks.group.index
    met = circulate(block, blocks)
    next(met)  # this rank's own block: met last, below

    def at(owner: int) -> torch.Tensor:
        if owner == me:
            return contribution(me, block)
        _, current = next(met)
        return contribution(owner, current)

    return sum_around(block, blocks, at)


def sum_around(
    like: torch.Tensor, blocks: Blocks, contribution: Callable[[int], torch.Tensor]
) -> torch.Tensor:
    """This rank's block of a sum over the group: of every rank's ``contribution(owner)``
    (block ``owner`` of a tensor shaped like ``like`` along ``blocks.dim``) to it.

    Each block's accumulator passes around the ring and arrives at its owner last: a
    reduce-scatter that holds one block (plus one in flight) at a time, never the whole sum.
    ``contribution`` is called for the other ranks' blocks in ring order (``me - 1``,
    ``me - 2``, ...), this rank's own last; every rank of the group must call this."""
    group = blocks.group
    me, n = group.index, group.size
    if n == 1:
        return contribution(me)
    moves = blocks.any_moves(like)
    accumulated = None
    for step in range(1, n):
        owner = (me - step) % n
        grads = contribution(owner)
        if accumulated is not None:
            grads = grads + accumulated
        # To the next rank, which meets block ``owner`` next, or owns it after the last step;
        # from the previous rank, the accumulator of the block this rank meets next.
        accumulated = _Shift(group, grads, blocks.shape(grads, (owner - 1) % n), moves).wait()
    return contribution(me) + accumulated


def all_gather_blocks(block: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """Every rank's block, concatenated along ``blocks.dim``: the whole operand on every rank
    of the group (the all-gather of NOTE [Ring or all-gather], the one gather it makes)."""
    group = blocks.group
    received = exchange(
        group,
        [block] * group.size,
        lambda src, dst: blocks.shape(block, src),
        dtype=block.dtype,
        device=block.device,
        kind="all_gather",
    )
    return torch.cat(received, dim=blocks.dim)


def reduce_scatter_blocks(grads: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """This rank's block of the sum over the group of ``grads`` (each rank's gradient of the
    whole gathered operand): the adjoint of :func:`all_gather_blocks`."""
    group = blocks.group
    pieces = [grads.narrow(blocks.dim, s, n) for s, n in zip(blocks.starts, blocks.sizes)]
    received = exchange(
        group,
        pieces,
        lambda src, dst: blocks.shape(grads, dst),
        dtype=grads.dtype,
        device=grads.device,
        kind="reduce_scatter",
    )
    return sum(received[1:], received[0])
