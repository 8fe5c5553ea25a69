"""What one training step does, layer by layer: output layouts, collectives, redistributions.

# NOTE [How a dry run observes the library]
Nothing in ``shardsci.tensor`` knows about the dry run. A ``StepObserver`` watches a step
from outside, while it runs:
- global module forward hooks keep the stack of the model's modules being run (the *layer*
  of anything that happens) and record each module's output layout;
- every collective and every layout change is tapped (NOTE [Taps on record_comm and
  redistribute_local]), and so is every gather an op makes without being asked (the gather
  guard's ``_record``, NOTE [Gathers an op was not asked to make]), recorded whatever the
  policy in force;
- in the backward pass the layer is that of the autograd node running
  (``torch._C._current_autograd_node``): each module's forward hook labels, innermost module
  first, the nodes that its call added to the graph.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from shardsci.tensor import ShardTensor, ShardTensorSpec, _comm_stats, _gather_guard, _redistribute
from shardsci.tensor._gather_guard import Gather
from shardsci.tensor._taps import tapped
from shardsci.tensor._torch_compat import _current_autograd_node, tree_leaves

__all__ = [
    "CommEvent",
    "GatherEvent",
    "LayerRecord",
    "Redistribution",
    "StepObserver",
    "describe_placements",
    "describe_sizes",
]

OUTSIDE = "(outside the model)"
"""The layer of work done by the step itself: the loss, the optimiser."""


@dataclass(frozen=True)
class CommEvent:
    """One collective issued by this rank."""

    kind: str
    sent: int
    received: int
    layer: str
    phase: str


@dataclass(frozen=True)
class GatherEvent:
    """One gather an op made without being asked, and where."""

    layer: str
    phase: str
    gather: Gather


@dataclass
class Redistribution:
    """One change of a tensor's layout and the bytes it moved on this rank."""

    layer: str
    phase: str
    source: str
    target: str
    shape: tuple[int, ...]
    sent: int = 0
    received: int = 0
    collectives: int = 0


@dataclass
class LayerRecord:
    """One module of the model, seen on its (last) forward call.

    Attributes
    ----------
    name : str
        Qualified name in the model (``""`` is the model itself).
    kind : str
        Module class name.
    shape : tuple of int or None
        Global shape of the first tensor output (None: not a tensor).
    placements : str
        Placements of that output on its mesh (``"plain"`` for a plain tensor).
    sizes : dict
        Tensor dim -> shard extents along it (over the ranks of the axes sharding it).
    local_shape : tuple of int or None
        This rank's shard of the output.
    specs : list of ShardTensorSpec
        Layouts of every ShardTensor output (for rank classes and checks).
    """

    name: str
    kind: str
    shape: tuple[int, ...] | None = None
    placements: str = "plain"
    sizes: dict[int, tuple[int, ...]] = field(default_factory=dict)
    local_shape: tuple[int, ...] | None = None
    specs: list[ShardTensorSpec] = field(default_factory=list, repr=False)


class StepObserver:
    """Watches ``model`` while a step runs (see NOTE [How a dry run observes the library]).

    Run the step inside ``watching()``; afterwards ``layers`` (with ``order``, the order in
    which the forward pass entered them), ``events``, ``redistributions`` and ``gathers``
    describe it.
    """

    def __init__(self, model: nn.Module) -> None:
        self.names = {id(m): name for name, m in model.named_modules()}
        self.layers: dict[str, LayerRecord] = {}
        self.order: dict[str, int] = {}
        self.events: list[CommEvent] = []
        self.redistributions: list[Redistribution] = []
        self.gathers: list[GatherEvent] = []
        self._stack: list[str] = []
        self._node_layers: dict[int, str] = {}
        self._open: list[Redistribution] = []
        self._in_optimizer = False

    # ------------------------------------------------------------------ where are we
    def location(self) -> tuple[str, str]:
        """(layer, phase) of what runs now; phase is forward, backward or optimizer."""
        if self._in_optimizer:
            return OUTSIDE, "optimizer"
        node = _current_autograd_node()
        if node is not None:
            return self._node_layers.get(id(node), OUTSIDE), "backward"
        return (self._stack[-1] if self._stack else OUTSIDE), "forward"

    # ------------------------------------------------------------------ context
    @contextmanager
    def watching(self) -> Iterator[StepObserver]:
        handles = [
            nn.modules.module.register_module_forward_pre_hook(self._enter),
            nn.modules.module.register_module_forward_hook(self._leave),
            register_optimizer_step_pre_hook(self._optimizer_starts),
            register_optimizer_step_post_hook(self._optimizer_ends),
        ]
        try:
            with (
                tapped(_comm_stats.record_comm, self._record_comm),
                tapped(_redistribute.redistribute_local, self._redistribute),
                tapped(_gather_guard._record, self._record_gather),
                _gather_guard.record_gathers(),  # so that the guard records under "allow" too
            ):
                yield self
        finally:
            for handle in handles:
                handle.remove()
            self._node_layers.clear()

    # ------------------------------------------------------------------ hooks
    def _enter(self, module: nn.Module, args: Any) -> None:
        name = self.names.get(id(module))
        if name is not None:
            self._stack.append(name)
            self.order.setdefault(name, len(self.order))

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        name = self.names.get(id(module))
        if name is None:
            return
        self._stack.pop()
        self.layers[name] = _layer_record(name, module, output)
        self._label_nodes(name, args, output)

    def _label_nodes(self, name: str, args: Any, output: Any) -> None:
        """Label the autograd nodes this module call added (inner modules labelled theirs)."""
        boundary = {
            id(t.grad_fn) for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.grad_fn
        }
        pending = [t.grad_fn for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
        visited: set[int] = set()
        while pending:
            node = pending.pop()
            if node is None or id(node) in visited or id(node) in boundary:
                continue
            visited.add(id(node))
            self._node_layers.setdefault(id(node), name)
            pending.extend(next_node for next_node, _ in node.next_functions)

    def _optimizer_starts(self, *args: Any) -> None:
        self._in_optimizer = True

    def _optimizer_ends(self, *args: Any) -> None:
        self._in_optimizer = False

    def _record_comm(
        self, original: Callable, kind: str, sent: int, received: int, **how: bool
    ) -> None:
        original(kind, sent, received, **how)
        layer, phase = self.location()
        self.events.append(CommEvent(kind, sent, received, layer, phase))
        for move in self._open:
            move.sent += sent
            move.received += received
            move.collectives += 1

    def _record_gather(self, original: Callable, gather: Gather) -> None:
        original(gather)
        self.gathers.append(GatherEvent(*self.location(), gather))

    def _redistribute(
        self, original: Callable, local: torch.Tensor, src: ShardTensorSpec, dst: ShardTensorSpec
    ) -> torch.Tensor:
        if src.same_layout(dst):
            return original(local, src, dst)
        layer, phase = self.location()
        move = Redistribution(layer, phase, _layout_text(src), _layout_text(dst), tuple(src.shape))
        self.redistributions.append(move)
        self._open.append(move)
        try:
            return original(local, src, dst)
        finally:
            self._open.pop()


# ---------------------------------------------------------------------------- layouts
def _layer_record(name: str, module: nn.Module, output: Any) -> LayerRecord:
    record = LayerRecord(name, type(module).__name__)
    tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
    record.specs = [t._spec for t in tensors if isinstance(t, ShardTensor)]
    if not tensors:
        return record
    first = tensors[0]
    record.shape = tuple(first.shape)
    if isinstance(first, ShardTensor):
        spec = first._spec
        record.placements = describe_placements(spec)
        record.sizes = {s.dim: s.sizes for s in spec.shardings}
        record.local_shape = tuple(first._local.shape)
    else:
        record.local_shape = tuple(first.shape)
    return record


def describe_placements(spec: ShardTensorSpec) -> str:
    """``"[dp: R, domain: S(2)]"``: each mesh axis and its placement."""
    names = spec.mesh.mesh_dim_names or tuple(str(a) for a in range(spec.mesh.ndim))
    return (
        "[" + ", ".join(f"{n}: {_placement_text(p)}" for n, p in zip(names, spec.placements)) + "]"
    )


def _placement_text(placement: Any) -> str:
    if isinstance(placement, Shard):
        return f"S({placement.dim})"
    if isinstance(placement, Replicate):
        return "R"
    if isinstance(placement, Partial):
        return f"P({placement.reduce_op})"
    return str(placement)


def describe_sizes(sizes: tuple[int, ...]) -> str:
    """Shard extents, repeats counted: ``(512,)*8 -> "512(x8)"``, ``(37, 27) -> "37,27"``."""
    runs: list[list[int]] = []
    for size in sizes:
        if runs and runs[-1][0] == size:
            runs[-1][1] += 1
        else:
            runs.append([size, 1])
    return ",".join(f"{s}(x{n})" if n > 1 else str(s) for s, n in runs)


def _layout_text(spec: ShardTensorSpec) -> str:
    sizes = "".join(
        f" d{s.dim}={describe_sizes(s.sizes)}" for s in spec.shardings if not s.is_even()
    )
    return describe_placements(spec) + sizes
