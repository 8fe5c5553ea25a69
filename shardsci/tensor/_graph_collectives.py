"""The collectives of a graph torch.compile traces through ShardTensors, as ops no compiler
may drop (NOTE [torch.compile and ShardTensor] in ``_torch_compile``).

# NOTE [A traced collective is an effect]
Every rank of a group must call each collective, in the same order, or the ranks pair one
collective's bytes with another's (garbage values, or gloo's "Received data size doesn't match
expected size"). In eager code that holds by construction. In a compiled graph, torch's
functional collectives (``_c10d_functional.all_to_all_single`` and its ``wait_tensor``) are
pure ops: a collective whose result this rank does not use is dead code, and dead code
elimination (the fx graph's, AOTAutograd's partitioner, inductor's scheduler) removes it on
this rank alone. That is the normal case of a one-sided halo: the rank that only sends (the
upper one in a forward, its neighbour in the backward, a ring shift's empty block) receives
nothing, and the all-to-all it joins to send is unused. Its peer then pairs its receive with
the next collective (2 ranks, 5/3 rows: ``F.avg_pool2d(x, 2)`` under ``aot_eager`` aborted
gloo; pooling then upsampling gave input gradients off by 0.8, or 1e259 from memory never
written).

Tying the received buffer into the op's output does not hold under every backend (an empty
slice or a zero-sized copy is simplified away: the send survived the default partitioner but
not ``aot_eager``'s). So while tracing, each collective is one of the custom ops below, whose
implementation calls the functional collective and waits for it, registered as an ORDERED
effect (``torch.library``'s effects system, torch's documented way to keep an op alive):
functionalization threads an effect token through every such op (``with_effects``), the
final token is an output of the forward or backward graph, so no pass may remove the op or
move it past another of them. Two consequences: the collectives of a graph run in program
order on every rank, whatever its shard sizes make of the rest of its graph; and inductor
runs them as fallback kernels (one synchronous collective each, no overlap or bucketing of
shardsci's collectives by the compiler). Their results are contiguous, and so are their fake
results: inductor lays out an op's input as it likes, so a fake result shaped like its input
(``empty_like``) promised a UNet's weight gradient channels-last strides the real all-reduce
did not have ("expected ... stride 9==1", inductor, 2 ranks).

Inductor (torch 2.11-2.13) drops the token once it lowers the graph: its ``with_effects``
lowering records an ordering edge to the previous effect under the new op's buffer name
(``bufN``) where the scheduler looks edges up by operation name (``opN``), so the edge is
never read (pytorch/pytorch#189209, open). The schedule then orders effects by data alone,
and the peak-memory reordering (``reorder_for_peak_memory``, on by default) chooses an order
from buffer sizes, which are a rank's own: the FNO on 2 ranks of 10/6 rows ran its backward's
all-to-alls in another order on rank 0 than on rank 1 (gloo: "1536 vs 1280 ... Received data
size doesn't match expected size"; the graphs AOTAutograd traced agreed on both ranks).
``lowered_in_program_order`` re-keys each edge from one of shardsci's ops by operation name
(installed when inductor loads; other effects are left as torch lowers them), so every pass
of the scheduler keeps it; where torch already keys them so, it changes nothing. Every graph
holding shardsci's effects is compiled with it, so inductor's caches need no key of their own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shardsci.tensor import _torch_compat
from shardsci.tensor._torch_compat import EffectType, register_effectful_op

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all_single",
    "broadcast",
    "lowered_in_program_order",
]

_c10d = torch.ops._c10d_functional


@torch.library.custom_op("shardsci::all_to_all_single", mutates_args=())
def _all_to_all_single(
    send: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group: str
) -> torch.Tensor:
    received = _c10d.all_to_all_single(send, output_split_sizes, input_split_sizes, group)
    return _c10d.wait_tensor(received)


@_all_to_all_single.register_fake
def _(send, output_split_sizes, input_split_sizes, group):
    return send.new_empty(sum(output_split_sizes))


@torch.library.custom_op("shardsci::all_reduce", mutates_args=())
def _all_reduce(tensor: torch.Tensor, reduce_op: str, group: str) -> torch.Tensor:
    return _c10d.wait_tensor(_c10d.all_reduce(tensor, reduce_op, group)).contiguous()


@_all_reduce.register_fake
def _(tensor, reduce_op, group):
    return tensor.new_empty(tensor.shape)  # contiguous, as the real one: see the NOTE


@torch.library.custom_op("shardsci::all_gather", mutates_args=())
def _all_gather(tensor: torch.Tensor, size: int, group: str) -> torch.Tensor:
    return _c10d.wait_tensor(_c10d.all_gather_into_tensor(tensor, size, group))


@_all_gather.register_fake
def _(tensor, size, group):
    return tensor.new_empty((size * tensor.shape[0], *tensor.shape[1:]))


@torch.library.custom_op("shardsci::broadcast", mutates_args=())
def _broadcast(tensor: torch.Tensor, src: int, group: str) -> torch.Tensor:
    return _c10d.wait_tensor(_c10d.broadcast(tensor, src, group)).contiguous()


@_broadcast.register_fake
def _(tensor, src, group):
    return tensor.new_empty(tensor.shape)


for _name in ("all_to_all_single", "all_reduce", "all_gather", "broadcast"):
    register_effectful_op(getattr(torch.ops.shardsci, _name).default, EffectType.ORDERED)


def all_to_all_single(
    send: torch.Tensor,
    output_split_sizes: list[int],
    input_split_sizes: list[int],
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """``funcol.all_to_all_single`` that no compiler drops: the bytes received, 1-D."""
    return _all_to_all_single(send, output_split_sizes, input_split_sizes, group.group_name)


def all_reduce(tensor: torch.Tensor, reduce_op: str, group: dist.ProcessGroup) -> torch.Tensor:
    """``funcol.all_reduce`` (``reduce_op``: sum, max, min, product) that no compiler drops."""
    return _all_reduce(tensor, reduce_op, group.group_name)


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every member's ``tensor`` concatenated along dim 0 in group-rank order, kept alive."""
    return _all_gather(tensor, group.size(), group.group_name)


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Group rank ``src``'s ``tensor`` on every member, kept alive."""
    return _broadcast(tensor, src, group.group_name)


def lowered_in_program_order(lower: Callable[..., Any]) -> Callable[..., Any]:
    """Inductor's lowering of ``with_effects`` (installed when inductor loads), whose ordering
    edges from one of shardsci's ops to the previous effect are then keyed by operation name,
    as the scheduler reads them (NOTE [A traced collective is an effect]); other effects are
    lowered as torch lowers them."""

    @functools.wraps(lower)
    def with_effects(token: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(op, "namespace", None) != "shardsci":
            return lower(token, op, *args, **kwargs)
        graph = _torch_compat.inductor_virtualized.graph
        first = len(graph.operations)
        result = lower(token, op, *args, **kwargs)
        edges = graph.additional_star_deps
        for operation in graph.operations[first:]:
            by_buffer = edges.pop(operation.get_name(), None)
            if by_buffer:
                edges[operation.get_operation_name()] |= by_buffer
        return result

    return with_effects
