"""Gradient reduction of replicated parameters: bucketed, overlapped with backward.

Every rank of a domain decomposition computes a part of each parameter's gradient (the
contribution of its shard); every data-parallel replica computes a gradient for its samples.
The gradient of the single-device model is the sum over the domain ranks, averaged over the
replicas. A reducer collects both kinds of contribution for each parameter in one flat buffer
per bucket and reduces the bucket once over the combined group (dp x domain) as soon as all
its parameters are done, while backward goes on (as DDP's reducer does).

# NOTE [A reducer's gradients are final or absent]
Contributions reach a parameter by two roads, and both end in the reducer's buckets, never
in ``.grad``:
- uses with ShardTensors: the promotion hands the reducer a partial sum over the domain mesh
  (NOTE [Where the gradient of a replicated parameter is summed] in
  ``shardsci/tensor/_promotion.py``) and returns no gradient to autograd;
- plain uses (e.g. a regulariser ``w.square().sum()`` computed whole on every rank): autograd
  brings their gradient to the parameter's ``AccumulateGrad`` node, whose pre-hook moves it
  into the bucket and hands ``AccumulateGrad`` nothing. A plain use gives the same gradient on
  every domain rank of a replica (the model runs SPMD), so only the rank at domain coordinate
  0 adds it: the sum over the domain then counts it once.
The ``AccumulateGrad`` pre-hook runs once per backward for every parameter the backward
reaches, after every contribution to it (the node's inputs come from all its uses): that is
when the parameter is ready. A bucket is launched when all its parameters are ready, buckets
in order, so every rank issues the same collectives in the same order. At the end of backward
(an autograd engine callback) the remaining buckets are launched, all are waited for, and each
parameter that received anything gets ``.grad = reduced`` (or ``.grad += reduced`` when it
already had a gradient, as autograd accumulates). So between and after backward passes
``.grad`` holds either a finished gradient or what it held before: never a partial sum.
Gradient clipping and optimisers need no care.

Inside ``no_sync()`` the end of backward reduces nothing: contributions accumulate in the
buckets and ``.grad`` is left alone until a backward outside ``no_sync()`` reduces them all
at once. Meanwhile an ``optimizer.step()`` over the reducer's parameters would step on
gradients that miss those contributions: a global optimiser pre-hook raises instead.

Assumption (as for DDP): every rank runs the same graph, so the same parameters are reached
and the buckets are launched in the same order everywhere.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.optimizer import register_optimizer_step_pre_hook

from shardsci.tensor._comm_stats import record_comm
from shardsci.tensor._promotion import register_sink, unregister_sink
from shardsci.tensor._torch_compat import _current_graph_task_id, _execution_engine

__all__ = ["ContributionsToGrad", "GradientReducer", "ReductionGroup"]

GRAD_KIND = "grad_all_reduce"


@dataclass(frozen=True)
class ReductionGroup:
    """Over which ranks gradient contributions are summed.

    Attributes
    ----------
    group : ProcessGroup or None
        The combined data-parallel x domain group; None when it is this rank alone.
    size : int
        Its number of ranks.
    domain_mesh : DeviceMesh or None
        The mesh ShardTensors live on (the domain axes); None without a domain decomposition.
    keeps_plain : bool
        Whether this rank adds gradients of plain uses (domain coordinate 0).
    average : int
        Data-parallel replicas: the sum is divided by this.
    """

    group: dist.ProcessGroup | None
    size: int
    domain_mesh: DeviceMesh | None
    keeps_plain: bool
    average: int


def accumulator_of(parameter: torch.Tensor) -> Any:
    """The ``AccumulateGrad`` node autograd uses for the leaf ``parameter``."""
    with torch.enable_grad():
        return parameter.view_as(parameter).grad_fn.next_functions[0][0]


class _Claims:
    """The parameters a sink owns and the meshes it accepts (see ``GradientSink``)."""

    def __init__(self, reduction: ReductionGroup) -> None:
        self.reduction = reduction
        self.parameters: list[torch.Tensor] = []
        self.accumulators: list[Any] = []
        self._index: dict[int, int] = {}
        self._meshes: dict[int, tuple[DeviceMesh, bool]] = {}
        register_sink(self)

    def add(self, parameter: torch.Tensor) -> int:
        self._index[id(parameter)] = len(self.parameters)
        self.parameters.append(parameter)
        self.accumulators.append(accumulator_of(parameter))
        return len(self.parameters) - 1

    def index_of(self, tensor: torch.Tensor) -> int | None:
        index = self._index.get(id(tensor))
        return index if index is not None and self.parameters[index] is tensor else None

    def claim(self, tensor: torch.Tensor, mesh: DeviceMesh) -> int | None:
        index = self.index_of(tensor)
        return index if index is not None and self._is_domain_mesh(mesh) else None

    def accumulator(self, index: int) -> Any:
        return self.accumulators[index]

    def _is_domain_mesh(self, mesh: DeviceMesh) -> bool:
        known = self._meshes.get(id(mesh))
        if known is None or known[0] is not mesh:
            known = (mesh, mesh == self.reduction.domain_mesh)
            self._meshes[id(mesh)] = known
        return known[1]


# ---------------------------------------------------------------------------- DDP-like
@dataclass
class _Bucket:
    buffer: torch.Tensor
    members: list[int]
    waiting: int = 0
    work: Any = None
    launched: bool = False


class GradientReducer(_Claims):
    """Sums the gradients of ``parameters`` over ``reduction``, in buckets (NOTE above).

    Parameters
    ----------
    parameters : sequence of Parameter
        In the order their gradients are expected last to first (``model.parameters()``);
        buckets are filled in reverse.
    reduction : ReductionGroup
    bucket_bytes, first_bucket_bytes : int
        Bucket capacity; the first bucket (the last layers' gradients, ready first) is smaller
        so that communication starts early, as in DDP.
    """

    def __init__(
        self,
        parameters: Sequence[nn.Parameter],
        reduction: ReductionGroup,
        *,
        bucket_bytes: int,
        first_bucket_bytes: int,
    ) -> None:
        super().__init__(reduction)
        for p in parameters:
            self.add(p)
        self.buckets = _buckets(self.parameters, bucket_bytes, first_bucket_bytes)
        self._bucket_of = [0] * len(self.parameters)
        self._slots: list[torch.Tensor] = [torch.empty(0)] * len(self.parameters)
        for b, bucket in enumerate(self.buckets):
            offset = 0
            for index in bucket.members:
                p = self.parameters[index]
                self._bucket_of[index] = b
                self._slots[index] = bucket.buffer[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
        self._touched = [False] * len(self.parameters)
        self._ready = [False] * len(self.parameters)
        self._next_launch = 0
        self._task = -1
        self.synchronizing = True
        self._hooks = [
            acc.register_prehook(self._prehook(index))
            for index, acc in enumerate(self.accumulators)
        ]
        _REDUCERS.add(self)
        _install_optimizer_guard()

    # ------------------------------------------------------------------ contributions
    def accept(self, index: int, contribution: torch.Tensor) -> None:
        """A partial sum over the domain mesh for parameter ``index`` (from a promotion)."""
        self._begin_backward()
        bucket = self.buckets[self._bucket_of[index]]
        if bucket.launched:
            raise RuntimeError(
                f"shardsci internal error: a gradient contribution to parameter {index} "
                f"arrived after its bucket was reduced"
            )
        self._slots[index].add_(contribution)
        self._touched[index] = True

    def _prehook(self, index: int):
        def on_accumulate(grads: tuple[torch.Tensor | None, ...]) -> tuple[None]:
            self._begin_backward()
            grad = grads[0]
            if grad is not None:
                self._touched[index] = True
                if self.reduction.keeps_plain:
                    self._slots[index].add_(grad)
            self._mark_ready(index)
            return (None,)

        return on_accumulate

    def _mark_ready(self, index: int) -> None:
        if self._ready[index]:
            return
        self._ready[index] = True
        bucket = self.buckets[self._bucket_of[index]]
        bucket.waiting -= 1
        if self.synchronizing:
            while self._next_launch < len(self.buckets):
                candidate = self.buckets[self._next_launch]
                if candidate.waiting > 0:
                    break
                self._launch(candidate)
                self._next_launch += 1

    # ------------------------------------------------------------------ collectives
    def _launch(self, bucket: _Bucket) -> None:
        bucket.launched = True
        group = self.reduction
        if group.group is None:
            return
        bucket.work = dist.all_reduce(bucket.buffer, group=group.group, async_op=True)
        nbytes = bucket.buffer.numel() * bucket.buffer.element_size()
        ring = 2 * (group.size - 1) * nbytes // group.size
        record_comm(GRAD_KIND, ring, ring)

    def _begin_backward(self) -> None:
        """On the first event of a backward pass: queue its end (an engine callback)."""
        task = _current_graph_task_id()
        if task == self._task:
            return
        if self._task != -1:
            self._abandon()
        self._task = task
        _execution_engine.queue_callback(self._end_backward)

    def _abandon(self) -> None:
        """A backward pass stopped (raised) before its end: drop what it left behind."""
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.buffer.zero_()
        self._touched = [False] * len(self.parameters)
        self._reset_backward()

    def _end_backward(self) -> None:
        if self.synchronizing:
            for bucket in self.buckets[self._next_launch :]:
                self._launch(bucket)
            for bucket in self.buckets:
                if bucket.work is not None:
                    bucket.work.wait()
            self._write_gradients()
        self._reset_backward()

    def _reset_backward(self) -> None:
        for bucket in self.buckets:
            bucket.waiting, bucket.work, bucket.launched = len(bucket.members), None, False
        self._ready = [False] * len(self.parameters)
        self._next_launch = 0
        self._task = -1

    def _write_gradients(self) -> None:
        average = self.reduction.average
        for index, p in enumerate(self.parameters):
            if not self._touched[index]:
                continue
            slot = self._slots[index]
            reduced = slot / average if average > 1 else slot.clone()
            if p.grad is None:
                p.grad = reduced
            else:
                p.grad.add_(reduced)
        for bucket in self.buckets:
            bucket.buffer.zero_()
        self._touched = [False] * len(self.parameters)

    @property
    def holds_unreduced(self) -> bool:
        """Whether contributions wait in the buckets (after a backward inside ``no_sync``)."""
        return self._task == -1 and any(self._touched)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate contributions without reducing them."""
        previous = self.synchronizing
        self.synchronizing = False
        try:
            yield
        finally:
            self.synchronizing = previous

    def owns_any(self, parameters: Iterator[torch.Tensor]) -> bool:
        return any(self.index_of(p) is not None for p in parameters)

    def remove(self) -> None:
        """Detach the hooks (the parameters keep their gradients)."""
        for hook in self._hooks:
            hook.remove()
        _REDUCERS.discard(self)
        unregister_sink(self)


def _buckets(
    parameters: list[torch.Tensor], bucket_bytes: int, first_bucket_bytes: int
) -> list[_Bucket]:
    """Parameters in reverse order, cut into buckets of one dtype and device each."""
    buckets: list[_Bucket] = []
    members: list[int] = []
    size = 0

    def close() -> None:
        if members:
            first = parameters[members[0]]
            buffer = torch.zeros(size, dtype=first.dtype, device=first.device)
            buckets.append(_Bucket(buffer, list(members), waiting=len(members)))

    for index in reversed(range(len(parameters))):
        p = parameters[index]
        capacity = first_bucket_bytes if not buckets else bucket_bytes
        if members:
            head = parameters[members[0]]
            full = (size + p.numel()) * p.element_size() > capacity
            if full or p.dtype != head.dtype or p.device != head.device:
                close()
                members, size = [], 0
        members.append(index)
        size += p.numel()
    close()
    return buckets


# ---------------------------------------------------------------------------- FSDP2
class ContributionsToGrad(_Claims):
    """Partial sums over the domain mesh, handed to autograd for FSDP2 to reduce.

    With FSDP2 on the data-parallel axis the unsharded parameters' ``.grad`` belong to FSDP2:
    it reduce-scatters them over dp after each module's backward, and a hook
    (``FSDPModule.set_all_reduce_hook``) sums the reduced shard over the domain ranks. So the
    ``AccumulateGrad`` pre-hook hands autograd the parameter's partial sum over the domain
    (the promotions' contributions plus, on domain coordinate 0, the plain uses' gradient)
    instead of keeping it. These ``.grad`` are FSDP2's internal buffers: the gradients users
    see are those of the sharded parameters, written after both reductions.
    """

    def __init__(self, reduction: ReductionGroup) -> None:
        super().__init__(reduction)
        self._pending: dict[int, torch.Tensor] = {}

    def register(self, parameters: Sequence[torch.Tensor]) -> None:
        """Own ``parameters`` (FSDP2's unsharded parameters, known after their first
        all-gather); idempotent."""
        for p in parameters:
            if self.index_of(p) is None:
                index = self.add(p)
                self.accumulators[index].register_prehook(self._prehook(index))

    def accept(self, index: int, contribution: torch.Tensor) -> None:
        pending = self._pending.get(index)
        if pending is None:
            self._pending[index] = contribution.clone()
        else:
            pending.add_(contribution)

    def _prehook(self, index: int):
        def on_accumulate(grads: tuple[torch.Tensor | None, ...]) -> tuple[None]:
            total = self._pending.pop(index, None)
            grad = grads[0]
            if grad is not None and self.reduction.keeps_plain:
                total = grad if total is None else total.add_(grad)
            elif grad is not None and total is None:
                total = torch.zeros_like(grad)
            if total is not None:
                parameter = self.parameters[index]
                if parameter.grad is None:
                    parameter.grad = total
                else:
                    parameter.grad.add_(total)
            return (None,)

        return on_accumulate


# ---------------------------------------------------------------------------- optimiser guard
_REDUCERS: weakref.WeakSet[GradientReducer] = weakref.WeakSet()
_GUARD: list[Any] = []


def _install_optimizer_guard() -> None:
    if not _GUARD:
        _GUARD.append(register_optimizer_step_pre_hook(_refuse_partial_step))


def _refuse_partial_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for reducer in list(_REDUCERS):
        if reducer.holds_unreduced and reducer.owns_any(
            p for group in optimizer.param_groups for p in group["params"]
        ):
            waiting = sum(reducer._touched)
            raise RuntimeError(
                f"optimizer.step() while the gradient contributions of {waiting} parameters "
                f"from backward passes inside no_sync() are not yet reduced: their .grad "
                f"misses them. Run the last backward of the accumulation outside no_sync()."
            )
