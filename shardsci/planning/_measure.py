"""One training step, watched: its collectives, layers, redistributions and memory.

``measure_step`` watches any step function; the dry run watches ``training_step``, the
``Trainer``'s own step (NOTE [One training step]) on a simulated rank, and
``tests/test_dry_run.py`` watches ``Trainer._optimiser_step`` on real ranks and compares the two.
The model stepped is parallelised as the trainer's (``parallelize``): its gradient reducer issues
the step's ``grad_all_reduce`` buckets. The trainer's all-reduce of a few scalars that agrees on
the mean loss and on stop signals is torch's collective, not in ``comm_counter``, and moves no
field data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardsci.parallel._reducer import GradientReducer
from shardsci.planning._memory import Category, LiveMemory
from shardsci.planning._observe import StepObserver
from shardsci.planning._work import WorkCounter
from shardsci.tensor import CommStats, ShardTensor, ShardTensorSpec, comm_counter
from shardsci.tensor._torch_compat import tree_leaves
from shardsci.testing import Traffic, count_traffic
from shardsci.training import Task

__all__ = ["StepFailed", "StepMeasurement", "measure_step", "steady_state"]


def steady_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter a gradient and the optimiser its state, as after one step, without
    running one: a step's peak includes the previous step's gradients (they live until
    ``zero_grad``, after the forward pass) and the optimiser state."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()


class StepFailed(RuntimeError):
    """The watched step raised; the message names the layer and pass it failed in."""


@dataclass
class StepMeasurement:
    """What one watched step did on this rank.

    Attributes
    ----------
    comm : CommStats
        Every collective shardsci issued (``comm_counter``).
    traffic : Traffic
        Every collective and message issued, counted at the dispatcher (``count_traffic``),
        by the ranks each connected (NOTE [The span of a collective]): what prices them.
    observer : StepObserver
        Layers, collective events and redistributions, by layer and phase.
    memory : LiveMemory
        Live tensor memory and its peak (NOTE [What the memory figures count]).
    parameters, gradients, optimizer : int
        Bytes of parameters, of their gradients after the step, of the optimiser state.
    grad_buckets : int
        Bytes of the gradient reducer's buckets (``domain_parallel``), 0 without one.
    batch_specs : list of ShardTensorSpec
        Layouts of the batch's ShardTensors.
    flops, aten_ops, communication_ops, fft_flops, strided_runs, complex_matmul_flops : int
        FLOPs, aten ops, those of them a communication module dispatched, FFT FLOPs, the runs
        its copies' strided tensors are made of (NOTE [Strided copies]), and its complex
        matmuls' FLOPs (NOTE [Complex matmuls are counted apart]), of this rank's step
        (``WorkCounter``).
    memory_bytes, flop_free_bytes : int
        The bytes its non-view ops read and write, and those of the ops without FLOPs (NOTE
        [Kernels without FLOPs]).
    flop_free_bytes_by_family : dict
        ``flop_free_bytes`` by family (NOTE [Kernels without FLOPs by family]).
    dispatch_calls : dict
        Its ShardTensor calls by dispatch path (``WorkCounter.dispatch_calls``, NOTE [Host
        time by dispatch path]).
    """

    comm: CommStats
    traffic: Traffic
    observer: StepObserver
    memory: LiveMemory
    parameters: int
    gradients: int
    optimizer: int
    grad_buckets: int
    batch_specs: list[ShardTensorSpec]
    flops: int
    aten_ops: int
    communication_ops: int
    fft_flops: int
    strided_runs: int
    complex_matmul_flops: int
    memory_bytes: int
    flop_free_bytes: int
    flop_free_bytes_by_family: dict[str, int]
    dispatch_calls: dict[str, int]


def measure_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    task: Task,
    run: Callable[[], Any],
    device_type: str,
) -> StepMeasurement:
    """Run ``run()`` (one step of ``model`` with ``optimizer`` on ``task``'s batches) watched.

    Parameters, gradients and optimiser state that exist already count from the start; the
    tensors of ``task.batch`` count as the batch; memory is that of ``device_type``.
    """
    observer = StepObserver(model)
    memory = LiveMemory(device_type, where=observer.location)
    parameters = [p for p in model.parameters()]
    memory.add(parameters, Category.parameters)
    memory.add((p.grad for p in parameters), Category.gradients)
    memory.add(_optimizer_tensors(optimizer), Category.optimizer)
    buckets = _bucket_buffers(model)
    memory.add(buckets, Category.grad_buckets)
    hooks = [
        p.register_post_accumulate_grad_hook(lambda p: memory.add([p.grad], Category.gradients))
        for p in parameters
        if p.requires_grad
    ]
    hooks += [
        optimizer.register_step_pre_hook(lambda *_: _set_category(memory, Category.optimizer)),
        optimizer.register_step_post_hook(lambda *_: _set_category(memory, Category.activations)),
    ]
    original_batch = task.batch
    batch_specs: list[ShardTensorSpec] = []

    def labelled_batch(step: int) -> Any:
        batch = original_batch(step)
        tensors = [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
        memory.add(tensors, Category.batch)
        batch_specs.extend(t._spec for t in tensors if isinstance(t, ShardTensor))
        return batch

    task.batch = labelled_batch  # type: ignore[method-assign]
    work = WorkCounter()
    reducer = gradient_reducer(model)
    if reducer is not None:
        # The reducer writes the step's gradients at the end of backward.
        write_gradients = reducer._write_gradients

        def labelled_gradients() -> None:
            previous, memory.category = memory.category, Category.gradients
            try:
                write_gradients()
            finally:
                memory.category = previous

        reducer._write_gradients = labelled_gradients  # type: ignore[method-assign]
    try:
        with count_traffic() as traffic, observer.watching(), comm_counter() as comm, memory, work:
            try:
                run()
            except Exception as error:
                layer, phase = observer.location()
                summary = str(error).strip().splitlines()[0] if str(error).strip() else ""
                raise StepFailed(
                    f"the step fails in the {phase} pass of layer {layer or '(the model)'}: "
                    f"{type(error).__name__}: {summary}"
                ) from error
    finally:
        del task.batch
        if reducer is not None:
            del reducer._write_gradients
        for hook in hooks:
            hook.remove()
    memory.add(_optimizer_tensors(optimizer), Category.optimizer)
    return StepMeasurement(
        comm=comm,
        traffic=traffic,
        observer=observer,
        memory=memory,
        parameters=_nbytes(parameters),
        gradients=_nbytes(p.grad for p in parameters),
        optimizer=_nbytes(_optimizer_tensors(optimizer)),
        grad_buckets=_nbytes(buckets),
        batch_specs=batch_specs,
        flops=work.flops,
        aten_ops=work.ops,
        communication_ops=work.communication_ops,
        fft_flops=work.fft_flops,
        strided_runs=work.strided_runs,
        complex_matmul_flops=work.complex_matmul_flops,
        memory_bytes=work.memory_bytes,
        flop_free_bytes=work.flop_free_bytes,
        flop_free_bytes_by_family=dict(work.flop_free_bytes_by_family),
        dispatch_calls=work.dispatch_calls,
    )


def gradient_reducer(model: nn.Module) -> GradientReducer | None:
    """The bucketed gradient reducer of a model of ``domain_parallel``, if it has one."""
    sink = getattr(model, "_shardsci_sink", None)
    return sink if isinstance(sink, GradientReducer) else None


def _bucket_buffers(model: nn.Module) -> list[torch.Tensor]:
    reducer = gradient_reducer(model)
    return [bucket.buffer for bucket in reducer.buckets] if reducer is not None else []


def _set_category(memory: LiveMemory, category: Category) -> None:
    memory.category = category


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]


def _nbytes(tensors: Any) -> int:
    storages = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            storages[id(storage)] = storage.nbytes()
    return sum(storages.values())
