"""How ``torch.compile`` meets ShardTensors: eagerly (default), or traced through (opt-in).

# NOTE [torch.compile and ShardTensor]
By default dynamo does not trace ShardTensor code (``keep_dynamo_out``: ShardTensor on its
non-traceable subclass list, ``shardsci.tensor`` on its skip list), so ``torch.compile(model)``
on ShardTensor inputs gives eager results with every ShardTensor op run eagerly, silently
(``torch._dynamo.explain`` reports one graph, no break). Compiled speed comes from
``shardsci.compiling.compile_regions`` (NOTE [Compiled local regions]), which compiles what each
rank computes alone, on plain local tensors. A one-time warning when torch.compile meets a
ShardTensor is not done: a hook at the top of ``_function_dispatch.dispatch`` testing
``torch.compiler.is_compiling()`` never fired under ``torch.compile`` (a probe that replaced
``ShardTensor.__torch_function__`` by a wrapper defined outside ``shardsci.tensor`` did see
``is_compiling()`` true on every op; why the skipped package's handler is not reached the
same way is not yet known); the next place to try is a guard or flatten hook, or a ``torch.compile`` wrapper).

``tracing_through_shardtensors()`` (experimental, a context manager, tested on small modules
only: ``tests/test_torch_compile_through.py``) lets dynamo and AOTAutograd trace through
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
Why it is not the default (measured 2026-11-27, torch 2.13, the zoo of ``tests/zoo.py`` on 2
uneven ranks): dynamo inlines ``__torch_function__`` for Python-level functions
(``F.interpolate``, ``F.pad``, which it also rewrites to ``torch._C._nn.pad``), so it traces
the function handlers themselves; a handler's ``to_local`` is a ``_ToLocal`` autograd Function
whose backward builds a ShardTensor, and dynamo fails on it with an internal error
("AssertionError: create_node using arg not from this SubgraphTracer", UNet through
``_interpolate_ops.resample``) instead of breaking the graph; the same handler's
``bool(weight.eq(1).all())`` breaks the graph (``Tensor.item()``). The FNO traces (its
compiled backward first met a gradient whose spec equals the traced one in layout but is
another object, "we guessed its metadata incorrectly", which
``ShardTensor.__coerce_same_metadata_as_tangent__`` now re-labels). The ViT and the Transolver fail in dynamo's fake run of a view:
``cells.flatten(-2)`` (``models/transolver.py``) on a ShardTensor whose fake local shard has
permuted strides ("Cannot view a tensor with shape [2, 6, 12, 2, 4] and strides (576, 48, 4,
288, 1) as a tensor with shape (2, 6, 12, 8)"; the ViT's the same error at shape (2, 18, 8)),
a view eager ShardTensor dispatch takes without error. Next
steps: keep dynamo out of the function handlers (let it put the torch function into the graph
and run ``__torch_function__`` only under AOTAutograd, as for builtins such as ``F.conv2d``), or
make ``_ToLocal``/``_FromLocal`` traceable as DTensor's ``to_local``/``from_local`` are.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from shardsci.tensor._torch_compat import dynamo_config, get_proxy_mode, trace_rules

__all__ = ["in_graph", "keep_dynamo_out", "tracing_through_shardtensors"]

_state: dict[str, type | None] = {"kept_out": None}


def in_graph() -> bool:
    """True while torch.compile traces: dynamo, or AOTAutograd's tracer. Collectives are then
    functional and record no bytes (NOTE [torch.compile and ShardTensor])."""
    return torch.compiler.is_compiling() or get_proxy_mode() is not None


def keep_dynamo_out(cls: type) -> None:
    """Called once by ``shardsci.tensor`` with the ShardTensor class: the default."""
    dynamo_config.nontraceable_tensor_subclasses.add(cls)
    trace_rules.add("shardsci.tensor")
    _state["kept_out"] = cls


@contextmanager
def tracing_through_shardtensors() -> Iterator[None]:
    """Experimental: inside the ``with`` block ``torch.compile`` traces through ShardTensors
    (NOTE [torch.compile and ShardTensor] says what works); compile and run inside it. On
    entry and exit dynamo's compiled code is dropped (``torch.compiler.reset()``)."""
    cls = _state["kept_out"]
    if cls is None:  # already inside
        yield
        return
    dynamo_config.nontraceable_tensor_subclasses.discard(cls)
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
