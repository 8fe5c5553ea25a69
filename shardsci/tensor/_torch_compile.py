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
and, under ``-m slow``, the zoo: ``tests/test_torch_compile_through.py``) lets dynamo
and AOTAutograd trace through instead: ``__tensor_flatten__`` gives the local shard as the
one inner tensor and the spec as context; dynamo runs each op on fake shards to learn its
output's spec; AOTAutograd runs the same Python (``__torch_dispatch__`` and the autograd
Functions' backward included) on functional fake shards, so the backend receives plain
forward and backward graphs over local tensors. What makes that sound:
- ``ShardTensor.__metadata_guard__`` compares the spec by value: a graph runs again only on
  the layout it was traced for (every shard extent and hint); a new layout compiles once more.
  Shard sizes are constants of the graph, never SymInts.
- Collectives are effects in the graph while tracing (``in_graph``): ``_collectives`` issues
  all-to-all, all-reduce, all-gather and broadcast as ``_graph_collectives``' ops, which wrap
  the ``_c10d_functional`` ones and which no compiler removes or reorders (NOTE [A traced
  collective is an effect]), and halo messages as one all-to-all with a zero split for every
  rank that is not a neighbour (torch 2.11-2.13 have no functional point-to-point
  collective), joined by every member of the group whenever any member exchanges.
- Bytes are not recorded while tracing, so ``comm_counter`` counts eager collectives only.
How dynamo meets the function handlers (torch 2.13): for a torch function in torch's
overridable set (``F.conv2d``, ``torch.einsum``, ``F.group_norm``, ``Tensor.__getitem__``...)
dynamo inlines ``__torch_function__``, so it traces the handler's Python; for others, such as
``F.interpolate``, it puts the call into its graph whole and runs the handler on fake shards
(its fake run, then AOTAutograd's on functional fake shards). Two rules follow:
- ``to_local`` and ``from_local_spec`` call their autograd Functions through
  ``torch._dynamo.allow_in_graph`` wrappers (``_api._to_local``, ``_api._from_local``): dynamo
  puts the call into its graph and AOTAutograd traces the Function. Dynamo's own trace of the
  Function's forward, in a subgraph, re-creates the spec (a dataclass) from its fields, and
  the mesh of an input's spec is an input of the outer graph: "AssertionError: create_node
  using arg not from this SubgraphTracer" (2026-11-28: ``from_local_spec(x.to_local() * 2,
  x.spec)`` compiled with ``fullgraph=True`` on one rank failed so, and passes with them).
- A handler's plan computed with tensors (``F.interpolate``'s index tables and weights, read
  back as Python ints) is computed ``on_the_host()``, on real tensors, and its tables enter
  the ops on shards as constants of the trace (``graph_constant``). On fake shards the tables
  were fake and their values unbacked SymInts: "unhashable type: non-nested SymInt" at the
  plan cache (``tests/test_torch_compile_through.py``'s ``interpolate`` case failed so).
Why it is not the default (measured 2026-11-28, torch 2.13, 2 uneven ranks unless said): the
FNO, the ViT and the Transolver trace, equal to the single-process model in float64, forward
and every gradient, with one recompilation for a new layout and none for a seen one; so does
the UNet (``tests/zoo.py``) on 2 ranks (10/6 -> 8/8 rows) and a 2x2 mesh, whole, in one
graph with no graph break (``aot_eager``; on 2 ranks inductor too). Its gradients were
wrong until 2026-11-28 (off by 0.25, or 1e40 from memory never written): the all-to-all a
rank joined only to send one side of a pooling window's halo was dead code on that rank and
was removed (NOTE [A traced collective is an effect]). The FNO and the Transolver also
trace in 3-D (2 ranks) and the Transolver on 2x2; the FNO with inductor too. The
MeshGraphNet (2 ranks, METIS then RCB parts) compiles equal to eager since 2026-11-29: its
neighbour gathers plan messages from the edge index's values (``aten._local_scalar_dense``,
data-dependent graph breaks inside the blocks' loop), so dynamo runs its forward eagerly
and compiles the frames it calls (6 frames a partition). Not the default because of what
that took (below); with inductor the UNet, the FNO, the ViT and the Transolver pass on 2
ranks (the last two since 2026-11-29: 437 and 303 s). The CFD recipe compiles
(``train.compile``) equal to eager.
Code that breaks the graph: inside the ``with`` block ``shardsci.tensor`` is inlined where
traced code calls it and never compiled as a frame of its own (dynamo's
``BUILTIN_INLINE_WHEN_CALLED``, with the package on its skip list). After a break in a loop
dynamo runs the frame eagerly with its callback set and compiles every frame it calls: it
compiled ``ShardTensor.__new__``, resuming on a half-built tensor ("'ShardTensor' object has
no attribute '_spec'"), and ``promote_replicated`` and a scatter handler's tail, guarded on
a cache's size, recompiling at every call (the MeshGraphNet's second call raised under
``error_on_recompile``). Automatic dynamic shapes are off, so a plain tensor's sizes stay
constants as shard sizes do (a user's ``ShardTensor.from_local(torch.sin(
x.to_local()), x.device_mesh, x.placements, x.sharding_shapes())`` on a second layout put
SymInts into the spec: "unhashable type: non-nested SymInt"). That round trip still breaks
the graph at ``x.sharding_shapes()``, with dynamo's reason ("torch.* op returned non-Tensor
... op: call_method; target: sharding_shapes"): dynamo puts a subclass's own method into its
graph as a method call, whose dict result a graph cannot hold; a function handler registered
for the method did not change that (2026-11-29). ``torch._dynamo.explain`` shows one break
there (``tests/test_torch_compile_through.py``); the rest of the function compiles.
The FNO's compiled backward first met a gradient whose spec equals the traced one in layout
but is another object ("we guessed its metadata incorrectly"), which
``ShardTensor.__coerce_same_metadata_as_tangent__`` now re-labels. An output of a compiled
graph that no loss reaches gets plain zeros of the global shape as its gradient (torch 2.13's
autograd fills an undefined gradient of a Function's output from its size alone), where
AOTAutograd traced a ShardTensor: "Expected a ShardTensor tangent but got a plain Tensor". A
graph break inside a block that returns two fields makes such outputs: the MeshGraphNet's last
processor block returned edges its decoder never reads (it no longer updates them). Inside
the ``with`` block AOTAutograd's check of each incoming gradient
(``AOTDispatchAutograd.process_runtime_tangent``) first reads a plain one there as replicated,
as eager code does (``_api._as_shard_tensor``), and the coercion above moves it to the traced
layout (``tests/test_torch_compile_through.py``, an output no loss reaches). Correct, but
each such output costs every rank a tensor of the global shape per backward, allocated by
autograd before shardsci sees it, which the gather guard names ("a backward formula built a
gradient whole ... in the backward of CompiledFunctionBackward"): return from a compiled
frame nothing that no loss needs. ``tests/test_torch_compile_through.py`` steps the
compiled MeshGraphNet under ``gather_policy("error")``.
The other way round: AOTAutograd guesses that the gradient of an input a graph mutates in
place is plain (autograd's zeros, when nothing reads the input afterwards) and traced one of
the global shape; the MeshGraphNet's aggregation (``zeros_like(nodes).index_add_``, whose
handler breaks the graph before writing) mutates a ShardTensor input that the next block
reads, and its ShardTensor gradient was refused ("Expected: None (type <class
'torch.Tensor'>), got: ShardTensorSpec(..."). Inside the ``with`` block such a gradient is
traced as a ShardTensor (functorch's ``disable_guess_zero_tangent_for_mutated_input_subclass``),
and plain zeros, where they come, are read as replicated as above
(``tests/test_torch_compile_through.py``, a graph that mutates a ShardTensor input).
The ViT and the Transolver failed in dynamo's fake run of ``flatten`` until the view rule's
fallback for a view the local shard's memory layout cannot take (an einsum's permuted output;
the spec's stride is contiguous) also caught the ValueError a fake tensor's view raises (a
real one raises RuntimeError): ``tests/test_torch_compile_through.py``'s ``flatten`` case.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from shardsci.tensor import _torch_compat
from shardsci.tensor._graph_collectives import effects_in_program_order
from shardsci.tensor._torch_compat import (
    _get_dispatch_mode,
    _TorchDispatchModeKey,
    disable_current_modes,
    get_proxy_mode,
    is_fake,
)

__all__ = [
    "EagerUnderCompileWarning",
    "allow_in_graph",
    "forget_eager_under_compile_warning",
    "graph_constant",
    "in_graph",
    "keep_dynamo_out",
    "on_the_host",
    "tracing_through_shardtensors",
    "warn_eager_under_compile",
]

_state: dict[str, type | None] = {"kept_out": None}

JointPass = Callable[[torch.fx.GraphModule, Any], torch.fx.GraphModule]
"""functorch's ``joint_custom_pass``: (joint graph, its inputs) -> joint graph."""

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


@contextmanager
def on_the_host() -> Iterator[None]:
    """Real tensors inside, even while torch.compile runs a handler on fake or traced shards:
    for a handler's plan (index tables, weights), computed from constants and read back as
    Python values, which fake tensors do not have (NOTE [torch.compile and ShardTensor]).
    Other dispatch modes (a device watch, a traffic count) see the plan as before."""
    if _get_dispatch_mode(_TorchDispatchModeKey.FAKE) is None:
        yield
        return
    with disable_current_modes():
        yield


def graph_constant(plan: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A real tensor made ``on_the_host``, as an operand of ops on ``like``: itself in eager
    code, a constant built in the trace when ``like`` is fake or traced."""
    if is_fake(like) or get_proxy_mode() is not None:
        return torch.tensor(plan.tolist(), dtype=plan.dtype, device=like.device)
    return plan


def keep_dynamo_out(cls: type) -> None:
    """Called once by ``shardsci.tensor`` with the ShardTensor class: the default, set in
    dynamo's config when dynamo loads (NOTE [Dynamo is configured when it loads])."""
    global watching
    _state["kept_out"] = cls
    watching = not _warned
    if "torch._dynamo" in sys.modules:
        _configure_dynamo()


def allow_in_graph(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compiler.allow_in_graph``, applied when dynamo loads (NOTE [Dynamo is
    configured when it loads]); returns ``fn`` itself, as torch's does."""
    _allowed_in_graph.append(fn)
    if "torch._dynamo" in sys.modules:
        torch.compiler.allow_in_graph(fn)
    return fn


# NOTE [Dynamo is configured when it loads]
# Importing torch._dynamo (and the inductor modules it imports) cost about 1 s of CPU, a
# sixth of a rank's start-up (``import shardsci.train``: 6.3 s before, 5.3 s after, 2026-11-29,
# benchmarks/records/2026-11-29-startup), which every rank of every run paid although only a
# compiled run needs dynamo. So shardsci does not import it: what shardsci tells dynamo (ShardTensor
# and ``shardsci.tensor`` on its skip lists, the ``allow_in_graph`` wrappers) is told by an
# import hook when something imports torch._dynamo (torch.compile does, before it traces),
# or at once where it is already imported. tests/test_compile.py checks that importing
# shardsci's training command does not import dynamo, and that dynamo imported afterwards
# keeps ShardTensor out and lets the wrappers in.
_allowed_in_graph: list[Callable[..., Any]] = []


def _configure_dynamo() -> None:
    """Tell dynamo what shardsci registered so far (the hook runs it once dynamo loads)."""
    for fn in _allowed_in_graph:
        torch.compiler.allow_in_graph(fn)
    if _state["kept_out"] is not None:
        _torch_compat.dynamo_config.nontraceable_tensor_subclasses.add(_state["kept_out"])
        _torch_compat.trace_rules.add("shardsci.tensor")


class _ConfigureDynamoWhenItLoads(importlib.abc.MetaPathFinder):
    """Finds ``torch._dynamo`` as the other finders do, and has its loader call
    ``_configure_dynamo`` once the module has run; then leaves ``sys.meta_path``."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torch._dynamo":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def run_then_configure(module: Any) -> None:
            run_module(module)
            _configure_dynamo()

        spec.loader.exec_module = run_then_configure  # type: ignore[method-assign]
        return spec


if "torch._dynamo" not in sys.modules:
    sys.meta_path.insert(0, _ConfigureDynamoWhenItLoads())


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


def _empty_sums_left_to_aten(decompose: Callable[..., Any]) -> Callable[..., Any]:
    """Inductor's decomposition of ``aten.add`` that leaves an empty operand to aten: for
    complex operands it views them as real pairs, which an empty tensor's strides refuse
    (torch 2.13: ``torch.compile(lambda x, y: x + y)`` on two ``(4, 0)`` complex tensors
    raises "self.stride(0) must be divisible by 2 to view Double as ComplexDouble"), and a
    rank's FFT shard is empty where it holds no kept mode (the FNO on a 2x2 mesh)."""

    def add(x: Any, y: Any, *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(t, torch.Tensor) and t.numel() == 0 for t in (x, y)):
            return NotImplemented
        return decompose(x, y, *args, **kwargs)

    return add


@contextmanager
def _empty_complex_sums_compiled() -> Iterator[None]:
    """Inside the block inductor compiles sums of empty complex shards
    (``_empty_sums_left_to_aten``), in both of its decomposition tables."""
    module = _torch_compat.inductor_decomposition
    tables = [module.decompositions, module.fast_random_decomps()]
    op = torch.ops.aten.add.Tensor
    kept = [table[op] for table in tables]
    for table, decompose in zip(tables, kept):
        table[op] = _empty_sums_left_to_aten(decompose)
    try:
        yield
    finally:
        for table, decompose in zip(tables, kept):
            table[op] = decompose


def _plain_tangents_read_as_replicated(
    process: Callable[..., Any], cls: type
) -> Callable[..., Any]:
    """AOTAutograd's ``process_runtime_tangent`` (the check of each gradient entering a
    compiled backward) that first reads a plain gradient where a ``cls`` was traced as
    replicated, as eager ShardTensor code reads one (``_api._as_shard_tensor``); the check
    then moves it to the traced layout (``__coerce_same_metadata_as_tangent__``). See NOTE
    [torch.compile and ShardTensor]: autograd's zeros for an output the loss does not reach."""
    from shardsci.tensor._api import _as_shard_tensor  # _api imports this module

    def process_runtime_tangent(x: Any, meta: Any, *args: Any, **kwargs: Any) -> Any:
        expected = getattr(meta, "original_subclass_type", None)
        if type(x) is torch.Tensor and expected is not None and issubclass(expected, cls):
            x = _as_shard_tensor(x, meta.meta)
        return process(x, meta, *args, **kwargs)

    return process_runtime_tangent


def _ours_then(ours: JointPass, users: JointPass | None) -> JointPass:
    """AOTAutograd's ``joint_custom_pass``: shardsci's, then the one the user had set, if any.
    Theirs runs last so that it sees the joint graph the partitioner will receive, as it
    would without shardsci; ours looks only for shardsci's own gradient effects, which a
    user's pass has no reason to know about."""
    if users is None:
        return ours

    def joint_custom_pass(module: torch.fx.GraphModule, inputs: Any) -> torch.fx.GraphModule:
        return users(ours(module, inputs), inputs)

    return joint_custom_pass


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
    dynamo_config, trace_rules = _torch_compat.dynamo_config, _torch_compat.trace_rules
    functorch_config, inductor_config = (
        _torch_compat.functorch_config,
        _torch_compat.inductor_config,
    )
    dynamo_config.nontraceable_tensor_subclasses.discard(cls)
    watching = False
    # shardsci.tensor stays on dynamo's skip list for frames of its own and is inlined where
    # traced code calls it. After a graph break the eager rest of a compiled call (a frame
    # with a break in a loop runs all of it) runs with dynamo's frame callback set, which
    # compiled the frames it called one by one: ShardTensor.__new__ broke at its wrapper and
    # resumed on a half-built tensor (AttributeError: no attribute '_spec'), and
    # promote_replicated, guarded on a cache's size, recompiled at every call.
    package = os.path.dirname(__file__) + os.sep
    trace_rules.BUILTIN_INLINE_WHEN_CALLED.add(package)
    # Shapes stay constants of the graph, as shard sizes are: after a new layout, automatic
    # dynamic shapes made a plain local shard's sizes SymInts, and a spec built from them
    # ("unhashable type: non-nested SymInt") failed to compile.
    automatic_dynamic = dynamo_config.automatic_dynamic_shapes
    dynamo_config.automatic_dynamic_shapes = False
    # AOTAutograd guesses that the gradient of an input a graph mutates in place is plain
    # (autograd's zeros); a ShardTensor input that is read after the graph gets a ShardTensor
    # gradient, which the guess refused. Traced as a ShardTensor, plain zeros still fit
    # (``_plain_tangents_read_as_replicated``).
    plain_guess = functorch_config.disable_guess_zero_tangent_for_mutated_input_subclass
    functorch_config.disable_guess_zero_tangent_for_mutated_input_subclass = True
    # Inductor's layout optimisation replaces a convolution's weight, in every op of a graph,
    # by a channels-last copy, which no gradient sink owns: each use of the weight was then
    # summed in the graph and again by the reducer (NOTE [Where the gradient of a replicated
    # parameter is summed]).
    layout_optimization = inductor_config.layout_optimization
    inductor_config.layout_optimization = False
    # Read when a backward is compiled, so graphs compiled inside keep it after the block;
    # resolved here, not at import (torch's AOTAutograd modules import one another in order).
    aot_autograd = _torch_compat.AOTDispatchAutograd
    process_tangent = aot_autograd.__dict__["process_runtime_tangent"]
    aot_autograd.process_runtime_tangent = staticmethod(
        _plain_tangents_read_as_replicated(process_tangent.__func__, cls)
    )
    # One op sums a backward's gradients of replicated weights, not one per use (NOTE [Where
    # the gradient of a replicated parameter is summed]); imported here, as _promotion
    # imports this module.
    from shardsci.tensor._promotion import one_gradient_op_per_graph

    joint_pass = functorch_config.joint_custom_pass
    functorch_config.joint_custom_pass = _ours_then(one_gradient_op_per_graph, joint_pass)
    torch.compiler.reset()
    _state["kept_out"] = None
    try:
        with effects_in_program_order(), _empty_complex_sums_compiled():
            yield
    finally:
        torch.compiler.reset()
        aot_autograd.process_runtime_tangent = process_tangent
        dynamo_config.automatic_dynamic_shapes = automatic_dynamic
        functorch_config.disable_guess_zero_tangent_for_mutated_input_subclass = plain_guess
        inductor_config.layout_optimization = layout_optimization
        functorch_config.joint_custom_pass = joint_pass
        trace_rules.BUILTIN_INLINE_WHEN_CALLED.discard(package)
        dynamo_config.nontraceable_tensor_subclasses.add(cls)
        _state["kept_out"] = cls
        watching = not _warned
