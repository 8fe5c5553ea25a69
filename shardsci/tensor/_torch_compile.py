"""How ``torch.compile`` meets ShardTensors: eagerly (default), or traced through (opt-in).

# NOTE [torch.compile and ShardTensor]
By default dynamo does not trace ShardTensor code (``keep_dynamo_out``: ShardTensor on its
non-traceable subclass list, ``shardsci.tensor`` on its skip list), so ``torch.compile(model)``
on ShardTensor inputs gives eager results with every ShardTensor op run eagerly: dynamo breaks
the graph at the first ShardTensor op ("Attempted to inline function marked as skipped",
``dispatch``; ``TORCH_LOGS=graph_breaks`` shows it) and, finding nothing to compile, runs the
frame as it is (``torch._dynamo.explain`` reports one graph, no break). The user is told once
per process: ``__torch_function__`` (``_function_dispatch.dispatch``) checks, while
``watching``, whether dynamo's frame callback is set, as it is for the whole call of a
``torch.compile``'d function, its eager parts included, and not in code torch.compile
disabled; the first ShardTensor op run there gives an ``EagerUnderCompileWarning`` naming
what to do (``tests/test_compile.py``: one warning under ``torch.compile(UNet)``, none under
``compile_regions``). ``torch.compiler.is_compiling()`` cannot tell this: it is true only while
dynamo traces Python, and dynamo never traces the skipped package. Compiled speed comes from
``shardsci.compiling.compile_regions`` (NOTE [Compiled local regions]), which compiles what
each rank computes alone, on plain local tensors, outside ShardTensor dispatch.

``tracing_through_shardtensors()`` (experimental, a context manager, tested on small modules
and, under ``-m slow``, three zoo models: ``tests/test_torch_compile_through.py``) lets dynamo and AOTAutograd trace through
instead: ``__tensor_flatten__`` gives the local shard as the one inner tensor and the spec as
context; dynamo runs each op on fake shards to learn its output's
spec; AOTAutograd runs the same Python (``__torch_dispatch__`` and the autograd Functions'
backward included) on functional fake shards, so the backend receives plain forward and
backward graphs over local tensors. What makes that sound:
- ``ShardTensor.__metadata_guard__`` compares the spec by value: a graph runs again only on
  the layout it was traced for (every shard extent and hint); a new layout compiles once more.
  Shard sizes are constants of the graph, never SymInts.
- Collectives are functional while tracing (``in_graph``): ``_collectives`` issues
  ``_c10d_functional`` all-to-all, all-reduce, all-gather and broadcast (each with its
  ``wait_tensor``), and halo messages as one all-to-all with a zero split for every rank that
  is not a neighbour (torch 2.11-2.13 have no functional point-to-point collective).
- Bytes are not recorded while tracing, so ``comm_counter`` counts eager collectives only.
Why it is not the default (measured 2026-11-28, torch 2.13, the zoo of ``tests/zoo.py`` on 2
uneven ranks, ``-m slow``): the FNO, the ViT and the Transolver trace, equal to the
single-process model in float64, forward and every gradient, with one recompilation for a new
layout and none for a seen one; the UNet does not. Dynamo inlines ``__torch_function__`` for
Python-level functions (``F.interpolate``, ``F.pad``, which it also rewrites to
``torch._C._nn.pad``), so it traces the function handlers themselves, and with them the
``_ToLocal`` and ``_FromLocal`` autograd Functions of ``to_local`` and ``from_local_spec``,
which build ShardTensors in their forward or backward: dynamo fails on them with an internal
error ("AssertionError: create_node using arg not from this SubgraphTracer", the UNet through
``_interpolate_ops.resample``) instead of breaking the graph; the same handler's
``bool(weight.eq(1).all())`` breaks the graph (``Tensor.item()``). Tried (2026-11-28, one
rank, ``F.interpolate`` alone): ``to_local`` through a ``torch._dynamo.allow_in_graph``
function gets past ``_ToLocal``, then ``_FromLocal`` fails the same way (not kept: it fixes
nothing alone); ``torch._dynamo.nonstrict_trace`` was not tried, as its documentation
refuses a constant argument made inside the compiled region, as every handler's output spec
is (DTensor's ``from_local`` is special-cased in dynamo instead). The MeshGraphNet is not
tried.
Next steps: keep dynamo out of the function handlers (let it put the torch function into the
graph and run ``__torch_function__`` only under AOTAutograd, as for builtins such as
``F.conv2d``), or give ``from_local_spec`` dynamo's treatment of DTensor's ``from_local``. A
first try of the former (2026-11-28, not kept): ``dispatch``, when
``torch.compiler.is_dynamo_compiling()``, returning a call of a ``torch._dynamo.allow_in_graph``
wrapper of ``func`` made on first use; dynamo refuses ``allow_in_graph`` called inside a
compiled region (the wrappers must be made when a handler is registered) and broke the graph
first at a data-dependent ``Tensor.item()``.
The FNO's compiled backward first met a gradient whose spec equals the traced one in layout
but is another object ("we guessed its metadata incorrectly"), which
``ShardTensor.__coerce_same_metadata_as_tangent__`` now re-labels. The ViT and the Transolver
failed in dynamo's fake run of ``flatten`` until the view rule's fallback for a view the
local shard's memory layout cannot take (an einsum's permuted output; the spec's stride is
contiguous) also caught the ValueError a fake tensor's view raises (a real one raises
RuntimeError): ``tests/test_torch_compile_through.py``'s ``flatten`` case.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from shardsci.tensor._torch_compat import (
    dynamo_config,
    get_proxy_mode,
    trace_rules,
)

__all__ = [
    "EagerUnderCompileWarning",
    "forget_eager_under_compile_warning",
    "in_graph",
    "keep_dynamo_out",
    "tracing_through_shardtensors",
    "warn_eager_under_compile",
]

_state: dict[str, type | None] = {"kept_out": None}

#: True while an eager ShardTensor op under ``torch.compile`` would still be news: dynamo is
#: kept out and the warning not yet given. Read on every ShardTensor function call.
watching = False
_warned = False


class EagerUnderCompileWarning(UserWarning):
    """``torch.compile`` met ShardTensors and runs their ops eagerly; said once per process."""


EAGER_UNDER_COMPILE = (
    "torch.compile runs ShardTensor ops eagerly: dynamo does not trace ShardTensor code, so "
    "no compiled graph holds them and this model is not compiled where it meets "
    "ShardTensors. To compile the modules each rank computes alone, call "
    "shardsci.compiling.compile_regions(model) (without torch.compile); to trace through "
    "ShardTensors, compile and run inside "
    "shardsci.tensor._torch_compile.tracing_through_shardtensors() (experimental). "
    "Said once per process; NOTE [torch.compile and ShardTensor]."
)


def in_graph() -> bool:
    """True while torch.compile traces: dynamo, or AOTAutograd's tracer. Collectives are then
    functional and record no bytes (NOTE [torch.compile and ShardTensor])."""
    return torch.compiler.is_compiling() or get_proxy_mode() is not None


def keep_dynamo_out(cls: type) -> None:
    """Called once by ``shardsci.tensor`` with the ShardTensor class: the default."""
    global watching
    dynamo_config.nontraceable_tensor_subclasses.add(cls)
    trace_rules.add("shardsci.tensor")
    _state["kept_out"] = cls
    watching = not _warned


def warn_eager_under_compile() -> None:
    """Called by ``__torch_function__`` while ``watching``, for an op that runs inside a call
    of a ``torch.compile``'d function (dynamo's frame callback is set): eagerly, where the
    user asked for compiled code. Warns once per process."""
    global watching, _warned
    watching, _warned = False, True
    warnings.warn(EAGER_UNDER_COMPILE, EagerUnderCompileWarning, stacklevel=3)


def forget_eager_under_compile_warning() -> None:
    """Warn again, at the next eager ShardTensor op under ``torch.compile``: for tests."""
    global watching, _warned
    _warned = False
    watching = _state["kept_out"] is not None


@contextmanager
def tracing_through_shardtensors() -> Iterator[None]:
    """Experimental: inside the ``with`` block ``torch.compile`` traces through ShardTensors
    (NOTE [torch.compile and ShardTensor] says what works); compile and run inside it. On
    entry and exit dynamo's compiled code is dropped (``torch.compiler.reset()``)."""
    cls = _state["kept_out"]
    if cls is None:  # already inside
        yield
        return
    global watching
    dynamo_config.nontraceable_tensor_subclasses.discard(cls)
    watching = False
    skipped = list(trace_rules.SKIP_DIRS)
    package = os.path.dirname(__file__)
    trace_rules.SKIP_DIRS[:] = [d for d in skipped if not d.startswith(package)]
    trace_rules._recompile_re()
    torch.compiler.reset()
    _state["kept_out"] = None
    try:
        yield
    finally:
        torch.compiler.reset()
        trace_rules.SKIP_DIRS[:] = skipped
        trace_rules._recompile_re()
        dynamo_config.nontraceable_tensor_subclasses.add(cls)
        _state["kept_out"] = cls
        watching = not _warned
