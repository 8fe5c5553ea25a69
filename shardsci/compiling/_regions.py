"""Compiled local regions: ``torch.compile`` on the modules that compute on each shard alone.

# NOTE [Compiled local regions]
A module that, for the layout of its inputs, computes every output cell from the same cells
of its inputs (Linear layers and MLPs over unsharded features, activations, 1x1
convolutions, norms over unsharded dims) gives, run on a rank's shards, exactly that rank's
shard of its result. ``compile_regions`` runs such modules as compiled functions of the local
shards: the compiler sees plain tensors only, ShardTensor dispatch stays outside compiled code,
communication happens between regions, at op boundaries, in eager code, and the sharded dims
are dynamic, so other shard sizes (37/27 -> 32/32, another partition's node counts) reuse the
compiled code.

Which modules are local is found, not declared: the first call of a module on a layout runs
it eagerly under taps (NOTE [Taps on record_comm and redistribute_local]); it is local when
no collective moved a byte on any rank, no operand changed layout, and every output keeps the
inputs' placements and shard extents. The ranks agree with one all-reduce, so they all run
the same code and issue the same collectives. Parameters enter a region through
``replicated_local``: their gradients are the sum over the shards (and over the shares of
Partial inputs), reduced once per call as in eager mode. The regions of one module class
share one compiled function that takes the module as an argument, so instances with equal
structure share compiled code: dynamo guards on their structure, not their identity.

A region's sharded inputs reach the compiler as aliases of the local shards that are not
views (NOTE [Region inputs are not views]).

Under a TorchDispatchMode (a memory tracker, a traffic count, a profiler) regions run eagerly:
dynamo refuses to trace while one is active, and a mode is there to see every op, which
compiled code would hide from it.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Partial
from torch.func import functional_call

from shardsci.tensor import ShardTensor, ShardTensorSpec, _comm_stats, _redistribute
from shardsci.tensor._api import from_local_spec
from shardsci.tensor._caches import BoundedCache, cached, register_cache
from shardsci.tensor._ops._common import replicated_local
from shardsci.tensor._spec import DimSharding, merged_hints
from shardsci.tensor._taps import tapped
from shardsci.tensor._torch_compat import (
    any_torch_dispatch_mode_on_stack,
    maybe_mark_dynamic,
    tree_leaves,
    tree_map,
)

__all__ = ["compile_regions", "region_summary"]

_SMALLEST_DYNAMIC = 2
"""Compiled code treats a sharded dim as dynamic only from this extent on (dynamo
specialises extents 0 and 1); layouts with smaller shards run eagerly."""


def compile_regions(model: nn.Module, **options: Any) -> nn.Module:
    """Compile the local regions of ``model`` (NOTE [Compiled local regions]); in place.

    Every module's class is swapped for a subclass whose ``forward`` decides, per layout of
    its ShardTensor inputs, between its compiled local call and its own forward (as
    ``fully_shard`` swaps classes); parameters, buffers and ``state_dict`` are unchanged.

    Parameters
    ----------
    model : nn.Module
        Any model; on plain tensors every module still runs as before.
    **options
        For ``torch.compile`` (``backend``, ``mode``, ...); ``fullgraph`` defaults to True:
        a local region has no reason to break.

    Returns
    -------
    nn.Module
        ``model``, whose modules now run their local calls compiled.
    """
    compiled = _CompiledCalls({"fullgraph": True, **options})
    for name, module in model.named_modules():
        if not isinstance(module, _Region):
            module.__class__ = _region_class(type(module))
        module._shardsci_region = _RegionState(name, compiled)
    return model


def region_summary(model: nn.Module) -> dict[str, str]:
    """For a model of ``compile_regions``, each module that met ShardTensors: ``"region"``
    (it runs compiled), ``"eager"`` (it is not local on a layout it met) or ``"in region"``
    (an enclosing module runs compiled)."""
    summary: dict[str, str] = {}
    for name, module in model.named_modules():
        state = getattr(module, "_shardsci_region", None)
        if state is None or not state.local:
            continue
        if any(s == "region" and _inside(name, outer) for outer, s in summary.items()):
            summary[name] = "in region"
        else:
            summary[name] = "region" if all(state.local.values()) else "eager"
    return summary


def _inside(name: str, outer: str) -> bool:
    return outer == "" or name.startswith(outer + ".")


class _Region:
    """Mixed into a module's class by ``compile_regions``."""

    _shardsci_region: _RegionState

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        original = super().forward  # type: ignore[misc]
        if torch.compiler.is_compiling():
            if _is_channel_mix(self, args, kwargs):  # type: ignore[arg-type]
                return _channel_mix(self, args[0])  # type: ignore[arg-type]
            return original(*args, **kwargs)
        return self._shardsci_region.call(self, original, args, kwargs)  # type: ignore[arg-type]


def _is_channel_mix(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether ``module(*args, **kwargs)`` is a batched convolution with a kernel of one cell:
    a matrix product over channels, cell by cell (NOTE [Pointwise convolutions in regions])."""
    if not isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d) or kwargs or len(args) != 1:
        return False
    ones = all(n == 1 for n in (*module.kernel_size, *module.stride, *module.dilation))
    unpadded = isinstance(module.padding, str) or not any(module.padding)
    return ones and unpadded and module.groups == 1 and args[0].ndim == module.weight.ndim


def _channel_mix(conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``conv(x)`` for a convolution with a kernel of one cell, as an einsum:
    ``(B, C_{in}, *S) -> (B, C_{out}, *S)``.

    NOTE [Pointwise convolutions in regions]
    Inductor's CPU lowering of a convolution's backward fixes the strides of the input's
    gradient (``guard_int_seq`` in ``convolution_backward_lowering``, torch 2.13), so a sharded
    dim marked dynamic is specialised and every new shard size recompiles the region. A
    convolution whose kernel, stride and dilation are all one cell is a matrix product over
    channels at every cell: traced as that einsum (only inside compiled regions; eager code
    keeps the convolution), its backward is matrix products, whose lowering keeps the dims
    symbolic. The sums run in another order than the convolution's, equal to rounding.
    """
    weight = conv.weight.flatten(1)  # type: ignore[union-attr]
    y = torch.einsum("oi,bi...->bo...", weight, x)
    if conv.bias is None:
        return y
    return y + conv.bias.view(-1, *([1] * (x.ndim - 2)))  # type: ignore[union-attr]


@cached("region classes", 1024)
def _region_class(kind: type) -> type:
    return type(f"Region{kind.__name__}", (_Region, kind), {})


class _CompiledCalls:
    """One compiled ``functional_call`` per module class (see NOTE [Compiled local regions])."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options
        self.by_class: dict[type, Callable] = {}

    def __call__(self, module: nn.Module) -> Callable:
        kind = type(module)
        if kind not in self.by_class:
            # A fresh code object per class: dynamo keeps one cache per code object.
            code = _call_module.__code__.replace(co_name=f"local_{kind.__name__}")
            function = types.FunctionType(code, _call_module.__globals__, code.co_name)
            self.by_class[kind] = torch.compile(function, **self.options)
        return self.by_class[kind]


def _call_module(module: nn.Module, state: dict, args: tuple, kwargs: dict) -> Any:
    return functional_call(module, state, args, kwargs)


_LAYOUTS_PER_MODULE = 64
"""The verdicts a module keeps (NOTE [Caches are keyed by value]): the layouts it met last."""


@dataclass(eq=False)
class _RegionState:
    """Per module: whether it is local on each layout met (by ``_layout_key``)."""

    name: str
    compiled: _CompiledCalls
    local: BoundedCache[tuple, bool] = field(
        default_factory=lambda: BoundedCache(None, _LAYOUTS_PER_MODULE)
    )

    def __post_init__(self) -> None:
        _STATES.add(self)

    def call(self, module: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
        shards = [t for t in tree_leaves((args, kwargs)) if isinstance(t, ShardTensor)]
        if not shards:
            return forward(*args, **kwargs)
        key = tuple(_layout_key(t._spec) for t in shards)
        local = self.local.get(key)
        if local is None:
            out, local = _probe(forward, shards, args, kwargs)
            self.local.put(key, local)
            return out
        if not local or _has_small_shards(shards[0]._spec) or any_torch_dispatch_mode_on_stack():
            return forward(*args, **kwargs)
        return self._run_local(module, [t._spec for t in shards], args, kwargs)

    def _run_local(
        self, module: nn.Module, specs: list[ShardTensorSpec], args: tuple, kwargs: dict
    ) -> Any:
        spec = specs[0]
        # Outputs remember what the inputs remember, as every op's output does (NOTE
        # [Shard-size hints]): an upsampling after the region finds the sizes to return to.
        hints = merged_hints(*(s.hints + s.shardings for s in specs))
        # A weight's gradient is a partial sum over the axes that shard the inputs and over
        # those where they are Partial: a region on Partial inputs (a Linear without bias on
        # the Transolver's slice tokens) is linear in them, so each rank's input share
        # contributes its own share of the weight's gradient.
        partial_axes = {a for s in spec.shardings for a in s.axes} | {
            a for a, p in enumerate(spec.placements) if isinstance(p, Partial)
        }
        state = {
            name: replicated_local(p, spec.mesh, partial_axes)
            for name, p in module.named_parameters()
        }
        state.update(module.named_buffers())
        local_args, local_kwargs = tree_map(
            lambda value: _local(value, spec, partial_axes), (args, kwargs)
        )
        out = self.compiled(module)(module, state, local_args, local_kwargs)
        return tree_map(lambda value: _sharded(value, spec, hints), out)


# Every module's verdicts, registered as one cache; a module's go with it.
_STATES: weakref.WeakSet[_RegionState] = weakref.WeakSet()


def _clear_verdicts() -> None:
    for state in list(_STATES):
        state.local.clear()


register_cache(
    "local-region verdicts", lambda: sum(len(s.local) for s in list(_STATES)), _clear_verdicts
)


# ---------------------------------------------------------------------------- locality
def _probe(
    forward: Callable, shards: list[ShardTensor], args: tuple, kwargs: dict
) -> tuple[Any, bool]:
    """Run ``forward`` eagerly and find out whether it was local (all ranks agreeing)."""
    moved = [0]

    def on_comm(original: Callable, kind: str, sent: int, received: int, **how: bool) -> None:
        original(kind, sent, received, **how)
        moved[0] += sent + received

    def on_layout_change(original: Callable, local: torch.Tensor, src, dst) -> torch.Tensor:
        if not src.same_layout(dst):
            moved[0] += 1
        return original(local, src, dst)

    with (
        tapped(_comm_stats.record_comm, on_comm),
        tapped(_redistribute.redistribute_local, on_layout_change),
    ):
        out = forward(*args, **kwargs)
    spec = shards[0]._spec
    local = (
        moved[0] == 0
        and all(_same_cells(t._spec, spec) for t in shards)
        and all(_keeps_cells(t, spec) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
    )
    return out, _agreed(local, shards[0])


def _layout_key(spec: ShardTensorSpec) -> tuple:
    """A layout without its shard extents: locality does not depend on them."""
    return (
        spec.mesh,
        spec.placements,
        spec.ndim,
        spec.dtype,
        tuple((s.dim, s.axes) for s in spec.shardings),
    )


def _same_cells(spec: ShardTensorSpec, reference: ShardTensorSpec) -> bool:
    return (
        spec.mesh == reference.mesh
        and spec.placements == reference.placements
        and spec.ndim == reference.ndim
        and spec.shardings == reference.shardings
    )


def _keeps_cells(out: torch.Tensor, reference: ShardTensorSpec) -> bool:
    """Whether ``out`` is sharded like the inputs: same placements, dims and extents."""
    return isinstance(out, ShardTensor) and _same_cells(out._spec, reference)


def _agreed(local: bool, like: ShardTensor) -> bool:
    """``local`` on every rank, or False everywhere (one all-reduce)."""
    if not dist.is_initialized():
        return local
    flag = torch.tensor([int(local)], device=like._local.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _has_small_shards(spec: ShardTensorSpec) -> bool:
    return any(min(s.sizes) < _SMALLEST_DYNAMIC for s in spec.shardings)


# ---------------------------------------------------------------------------- shards
def _local(value: Any, spec: ShardTensorSpec, partial_axes: set[int]) -> Any:
    if isinstance(value, ShardTensor):
        local = _NotAView.apply(value.to_local())
        for sharding in spec.shardings:
            # "maybe": a backend that must specialise a sharded dim (inductor's CPU conv
            # lowering) compiles per size, reported as recompilations, instead of raising.
            maybe_mark_dynamic(local, sharding.dim)
        return local
    if isinstance(value, torch.Tensor):
        return replicated_local(value, spec.mesh, partial_axes)
    return value


def _sharded(value: Any, spec: ShardTensorSpec, hints: tuple[DimSharding, ...]) -> Any:
    """A region's local output as its ShardTensor: the inputs' placements and extents."""
    if not isinstance(value, torch.Tensor):
        return value
    shape = list(value.shape)
    for sharding in spec.shardings:
        shape[sharding.dim] = spec.shape[sharding.dim]
    out_spec = ShardTensorSpec.build(
        spec.mesh,
        spec.placements,
        shape,
        value.dtype,
        {s.dim: s.sizes for s in spec.shardings},
        order={s.dim: s.axes for s in spec.shardings},
        hints=hints,
    )
    return from_local_spec(value, out_spec)


class _NotAView(torch.autograd.Function):
    """``x`` as an alias that is not a view, with an identity backward.

    NOTE [Region inputs are not views]
    ``to_local`` returns a view (of the ShardTensor's local tensor, itself perhaps a view of a
    padded or permuted buffer). Dynamo turns a view input's base into a symbolic tensor too,
    with dynamic dims of its own: the shard dims marked on the view are static in the base,
    and once automatic dynamic shapes make another of the base's dims symbolic (the class's
    next instance has other channels), the guards tie the base's strides to the current shard
    extents (``x._base.stride()[0] == 120*x._base.size()[1]``): every new shard size then
    recompiles. Marking the same dims on the base is no cure where the base's dims do not line
    up with the view's (a ``movedim`` to channels-last). A detached alias shares the storage
    and the version counter and has no base, so the compiler sees the shard alone.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad
