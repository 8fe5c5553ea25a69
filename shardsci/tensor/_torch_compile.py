"""How ``torch.compile`` traces through ShardTensors: what shardsci tells dynamo, AOTAutograd
and inductor, each scoped to ShardTensors and shardsci's own code and ops.

# NOTE [torch.compile and ShardTensor]
``torch.compile(model)`` on ShardTensor inputs traces through them, with no switch: dynamo
and AOTAutograd see the subclass (``__tensor_flatten__`` gives the local shard as the one
inner tensor and the spec as context); dynamo runs each op on fake shards to learn its
output's spec; AOTAutograd runs the same Python (``__torch_dispatch__`` and the autograd
Functions' backward included) on functional fake shards, so the backend receives plain
forward and backward graphs over local tensors. A plain-tensor model compiled in the same
process is compiled as torch compiles it: shardsci changes no torch config that governs it
(``tests/test_torch_compile_through.py``: automatic dynamic shapes still make a plain
input's changing dim dynamic, and the configs keep torch's values after a ShardTensor
graph). What makes tracing through sound, each scoped to ShardTensors or shardsci's code:
- ``ShardTensor.__metadata_guard__`` compares the spec by value: a graph runs again only on
  the layout it was traced for (every shard extent and hint); a new layout compiles once more.
- Shard sizes are constants of the graph, never SymInts: ``__tensor_flatten__`` marks the
  ShardTensor and its local shard static (``static_for_dynamo``, ``mark_static``'s mark), so
  automatic dynamic shapes, left on for everyone, do not make a new layout's shard sizes
  SymInts. Inside the opt-in this replaced (before 2026-11-30), automatic dynamic shapes were
  off for everyone, after a user's ``ShardTensor.from_local(torch.sin(x.to_local()),
  x.device_mesh, x.placements, x.sharding_shapes())`` on a second layout put SymInts into the
  spec ("unhashable type: non-nested SymInt"). With torch's default and without the marks,
  that round trip, the halo convolutions, the global mean and a new global shape
  (``tests/test_torch_compile_cache.py``) all passed on 2026-11-30: no test is known to fail
  without the marks; they are kept as the one place that says shard sizes are static. A
  plain tensor the user passes into a compiled function and turns into a ShardTensor there is
  the user's: if its size changes, dynamo makes it dynamic as torch does. The mark is an
  attribute that stays on the tensor: a user's tensor given to ``from_local`` as the shard,
  compiled later as a plain input, is static too.
- Collectives are effects in the graph while tracing (``in_graph``): ``_collectives`` issues
  all-to-all, all-reduce, all-gather and broadcast as ``_graph_collectives``' ops, which wrap
  the ``_c10d_functional`` ones and which no compiler removes or reorders (NOTE [A traced
  collective is an effect]; inductor's lowering of shardsci's effects keeps their order),
  and halo messages as one all-to-all with a zero split for every rank that is not a
  neighbour (torch 2.11-2.13 have no functional point-to-point collective), joined by every
  member of the group whenever any member exchanges.
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
What compiles (measured 2026-11-28/29, torch 2.13, 2 uneven ranks unless said): the FNO, the
ViT and the Transolver trace, equal to the single-process model in float64, forward and every
gradient, with one recompilation for a new layout and none for a seen one; so does the UNet
(``tests/zoo.py``) on 2 ranks (10/6 -> 8/8 rows) and a 2x2 mesh, whole, in one graph with no
graph break (``aot_eager``; on 2 ranks inductor too). Its gradients were wrong until
2026-11-28 (off by 0.25, or 1e40 from memory never written): the all-to-all a rank joined
only to send one side of a pooling window's halo was dead code on that rank and was removed
(NOTE [A traced collective is an effect]). The FNO and the Transolver also trace in 3-D (2
ranks) and the Transolver on 2x2; the FNO with inductor too. The MeshGraphNet (2 ranks,
METIS then RCB parts) compiles equal to eager: its neighbour gathers plan messages from the
edge index's values (``aten._local_scalar_dense``, data-dependent graph breaks inside the
blocks' loop), so dynamo runs its forward eagerly and compiles the frames it calls (6 frames
a partition). With inductor the UNet, the FNO, the ViT and the Transolver pass on 2 ranks
(the last two in 437 and 303 s). The CFD recipe compiles (``train.compile``) equal to eager.
Until 2026-11-30 all of this was an opt-in context manager that changed torch's global
config for the user's plain-tensor code too; each change is now scoped, as follows.
Code that breaks the graph: ``shardsci.tensor`` is on dynamo's skip list for frames of its
own and inlined where traced code calls it (dynamo's ``BUILTIN_INLINE_WHEN_CALLED``, for
shardsci's files only). After a break in a loop dynamo runs the frame eagerly with its
callback set and compiles every frame it calls: it compiled ``ShardTensor.__new__``,
resuming on a half-built tensor ("'ShardTensor' object has no attribute '_spec'"), and
``promote_replicated`` and a scatter handler's tail, guarded on a cache's size, recompiling
at every call (the MeshGraphNet's second call raised under ``error_on_recompile``). The
round trip above still breaks the graph at ``x.sharding_shapes()``, with dynamo's reason
("torch.* op returned non-Tensor ... op: call_method; target: sharding_shapes"): dynamo puts
a subclass's own method into its graph as a method call, whose dict result a graph cannot
hold; a function handler registered for the method did not change that (2026-11-29).
``torch._dynamo.explain`` shows one break there (``tests/test_torch_compile_through.py``);
the rest of the function compiles.
The FNO's compiled backward first met a gradient whose spec equals the traced one in layout
but is another object ("we guessed its metadata incorrectly"), which
``ShardTensor.__coerce_same_metadata_as_tangent__`` now re-labels. An output of a compiled
graph that no loss reaches gets plain zeros of the global shape as its gradient (torch 2.13's
autograd fills an undefined gradient of a Function's output from its size alone), where
AOTAutograd traced a ShardTensor: "Expected a ShardTensor tangent but got a plain Tensor". A
graph break inside a block that returns two fields makes such outputs: the MeshGraphNet's last
processor block returned edges its decoder never reads (it no longer updates them).
AOTAutograd's check of each incoming gradient (``AOTDispatchAutograd.process_runtime_tangent``)
first reads a plain one where a ShardTensor was traced as replicated, as eager code does
(``_api._as_shard_tensor``; a plain gradient where a plain tensor was traced is untouched),
and the coercion above moves it to the traced layout (``tests/test_torch_compile_through.py``,
an output no loss reaches). Correct, but each such output costs every rank a tensor of the
global shape per backward, allocated by autograd before shardsci sees it, which the gather
guard names ("a backward formula built a gradient whole ... in the backward of
CompiledFunctionBackward"): return from a compiled frame nothing that no loss needs.
``tests/test_torch_compile_through.py`` steps the compiled MeshGraphNet under
``gather_policy("error")``.
The other way round: AOTAutograd guesses that the gradient of an input a graph mutates in
place is plain (autograd's zeros, when nothing reads the input afterwards) and traced one of
the global shape; the MeshGraphNet's aggregation (``zeros_like(nodes).index_add_``, whose
handler breaks the graph before writing) mutates a ShardTensor input that the next block
reads, and its ShardTensor gradient was refused ("Expected: None (type <class
'torch.Tensor'>), got: ShardTensorSpec(..."). For a graph with a ShardTensor input, such a
gradient is traced as a subclass (functorch's
``disable_guess_zero_tangent_for_mutated_input_subclass``, on only while AOTAutograd collects
that graph's metadata: torch 2.13 has no per-subclass hook, only NestedTensor's own rule), and
plain zeros, where they come, are read as replicated as above
(``tests/test_torch_compile_through.py``, a graph that mutates a ShardTensor input).
Inductor's layout optimisation is declined for a graph that holds shardsci's ops
(``GraphLowering.decide_layout_opt``; ``tests/test_torch_compile_through.py``'s inductor
``conv-norm`` step, NOTE [Where the gradient of a replicated parameter is summed]), and
for the forward of a joint graph that holds them (``aot_stage2_autograd`` runs with inductor's
``layout_optimization`` off): the forward of a ShardTensor convolution that exchanges no halo
(a layout split along the batch, a one-rank mesh) holds none of shardsci's ops, and inductor,
deciding per graph from the graph alone, gave it a channels-last weight whose uses the
backward summed in the graph, 3 all-reduces where eager issues 1 (the ``conv-norm-batch``
step). A setting rather than a decision, since inductor's graph cache keys it: that forward
has the ops of a plain graph. A graph with no shardsci op in its joint is optimised as torch
decides. shardsci's joint pass (one op sums a backward's
gradients of a replicated weight) runs after AOTAutograd's own joint passes, before a user's
``joint_custom_pass``, which shardsci leaves as the user set it.
The ViT and the Transolver failed in dynamo's fake run of ``flatten`` until the view rule's
fallback for a view the local shard's memory layout cannot take (an einsum's permuted output;
the spec's stride is contiguous) also caught the ValueError a fake tensor's view raises (a
real one raises RuntimeError): ``tests/test_torch_compile_through.py``'s ``flatten`` case.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from shardsci.tensor import _torch_compat
from shardsci.tensor._torch_compat import (
    _get_dispatch_mode,
    _TorchDispatchModeKey,
    disable_current_modes,
    get_proxy_mode,
    is_fake,
)

__all__ = [
    "allow_in_graph",
    "compile_through",
    "graph_constant",
    "in_graph",
    "on_the_host",
    "static_for_dynamo",
]

_state: dict[str, type | None] = {"subclass": None}


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


def compile_through(cls: type) -> None:
    """Called once by ``shardsci.tensor`` with the ShardTensor class: what torch.compile must
    know to trace through it, told to each compiler stage when it loads (NOTE [Dynamo is
    configured when it loads])."""
    _state["subclass"] = cls
    for name, configure in _WHEN_LOADED.items():
        if name in sys.modules:
            configure(cls)


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
# compiled run needs dynamo. So shardsci does not import it, nor AOTAutograd or inductor: what
# shardsci tells each of them (NOTE [torch.compile and ShardTensor]) is told by an import hook
# once that stage's module has run (torch.compile imports them before it traces), or at once
# where it is already imported. tests/test_dynamo_on_demand.py checks that importing
# shardsci's training command imports none of them, and that each imported afterwards is told.
_allowed_in_graph: list[Callable[..., Any]] = []


def _configure_dynamo(cls: type) -> None:
    """Dynamo traces ShardTensor (it is not on the non-traceable list) and inlines
    ``shardsci.tensor`` where traced code calls it, never compiling a frame of its own."""
    for fn in _allowed_in_graph:
        torch.compiler.allow_in_graph(fn)
    trace_rules = _torch_compat.trace_rules
    trace_rules.add("shardsci.tensor")
    trace_rules.BUILTIN_INLINE_WHEN_CALLED.add(os.path.dirname(__file__) + os.sep)


def _configure_aot_autograd(cls: type) -> None:
    """AOTAutograd: plain gradients where a ``cls`` was traced read as replicated, mutated
    ``cls`` inputs' gradients traced as ``cls``, shardsci's joint pass after torch's."""
    from shardsci.tensor._promotion import one_gradient_op_per_graph  # it imports this module

    aot_autograd = _torch_compat.AOTDispatchAutograd
    process = aot_autograd.__dict__["process_runtime_tangent"].__func__
    aot_autograd.process_runtime_tangent = staticmethod(
        _plain_tangents_read_as_replicated(process, cls)
    )
    module = _torch_compat.aot_autograd_module
    module.run_functionalized_fw_and_collect_metadata = _mutated_inputs_tangents_as(
        module.run_functionalized_fw_and_collect_metadata, cls
    )
    graph_compile = _torch_compat.aot_graph_compile
    graph_compile.run_joint_graph_passes_on_hops = _then(
        graph_compile.run_joint_graph_passes_on_hops, one_gradient_op_per_graph
    )
    graph_compile.aot_stage2_autograd = _forward_laid_out_as_traced(
        graph_compile.aot_stage2_autograd
    )


def _configure_inductor_lowering(cls: type) -> None:
    """Inductor keeps shardsci's effects in program order."""
    from shardsci.tensor._graph_collectives import lowered_in_program_order

    lowerings = _torch_compat.inductor_lowerings
    hop = torch.ops.higher_order.with_effects
    lowerings[hop] = lowered_in_program_order(lowerings[hop])


def _configure_inductor_graph(cls: type) -> None:
    """Inductor declines layout optimisation for a graph holding shardsci's ops."""
    lowering = _torch_compat.GraphLowering
    lowering.decide_layout_opt = staticmethod(
        _no_layout_optimization_with_shardsci(lowering.__dict__["decide_layout_opt"].__func__)
    )


def _configure_inductor_decomposition(cls: type) -> None:
    """Inductor leaves sums of empty complex shards to aten, in both of its tables (the
    second is built from the first at its first call, and cached)."""
    module = _torch_compat.inductor_decomposition
    op = torch.ops.aten.add.Tensor
    module.decompositions[op] = _empty_complex_sums_left_to_aten(module.decompositions[op])
    if module.fast_random_decomps.cache_info().currsize:
        table = module.fast_random_decomps()
        table[op] = _empty_complex_sums_left_to_aten(table[op])


_WHEN_LOADED: dict[str, Callable[[type], None]] = {
    "torch._dynamo": _configure_dynamo,
    "torch._functorch.aot_autograd": _configure_aot_autograd,
    "torch._inductor.lowering": _configure_inductor_lowering,
    "torch._inductor.graph": _configure_inductor_graph,
    "torch._inductor.decomposition": _configure_inductor_decomposition,
}
"""Module -> what shardsci tells it (or the modules it imports), once it has run."""


class _ConfigureWhenLoaded(importlib.abc.MetaPathFinder):
    """Finds each module of ``_WHEN_LOADED`` as the other finders do, and has its loader
    configure it once the module has run."""

    finding: set[str] = set()

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _WHEN_LOADED or name in self.finding:
            return None
        self.finding.add(name)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.finding.discard(name)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def run_then_configure(module: Any) -> None:
            run_module(module)
            if _state["subclass"] is not None:
                _WHEN_LOADED[name](_state["subclass"])

        spec.loader.exec_module = run_then_configure  # type: ignore[method-assign]
        return spec


if not all(name in sys.modules for name in _WHEN_LOADED):
    sys.meta_path.insert(0, _ConfigureWhenLoaded())


def static_for_dynamo(tensor: torch.Tensor) -> None:
    """Every dim of ``tensor`` static for dynamo (``torch._dynamo.mark_static``'s mark),
    whatever automatic dynamic shapes would make of it: a shard's sizes are part of its
    layout, guarded by the spec (NOTE [torch.compile and ShardTensor])."""
    tensor._dynamo_static_indices = set(range(tensor.dim()))  # type: ignore[attr-defined]


def _holds_shardsci_ops(module: torch.fx.GraphModule) -> bool:
    """Whether ``module`` calls one of shardsci's ops, bare or as an effect."""
    with_effects = torch.ops.higher_order.with_effects
    for node in module.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.args[1] if node.target is with_effects else node.target
        if getattr(target, "namespace", None) == "shardsci":
            return True
    return False


def _forward_laid_out_as_traced(stage: Callable[..., Any]) -> Callable[..., Any]:
    """AOTAutograd's ``aot_stage2_autograd`` (partition a joint graph, compile its forward),
    with inductor's layout optimisation off while it runs for a joint graph that holds
    shardsci's ops. Its forward may hold none (a convolution that exchanges no halo, whose
    backward sums the weight's gradient) and would be optimised as a plain graph
    (``_no_layout_optimization_with_shardsci``). A setting, not a decision: inductor's graph
    cache keys it, so a forward cached from a plain graph with the same ops is not reused."""

    @functools.wraps(stage)
    def aot_stage2_autograd(
        aot_state: Any, aot_graph_capture: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if "torch._inductor.config" not in sys.modules or not _holds_shardsci_ops(
            aot_graph_capture.graph_module
        ):
            return stage(aot_state, aot_graph_capture, *args, **kwargs)
        with _torch_compat.inductor_config.patch(layout_optimization=False):
            return stage(aot_state, aot_graph_capture, *args, **kwargs)

    return aot_stage2_autograd


def _no_layout_optimization_with_shardsci(decide: Callable[..., bool]) -> Callable[..., bool]:
    """Inductor's ``GraphLowering.decide_layout_opt``, declining for a graph that holds
    shardsci's ops: layout optimisation replaces a convolution's weight, in every op of the
    graph, by a channels-last copy that no gradient sink owns (NOTE [Where the gradient of a
    replicated parameter is summed]); each use of the weight was then summed in the graph
    and again by the reducer."""

    @functools.wraps(decide)
    def decide_layout_opt(module: torch.fx.GraphModule, *, is_inference: bool) -> bool:
        if _holds_shardsci_ops(module):
            return False
        return decide(module, is_inference=is_inference)

    return decide_layout_opt


def _empty_complex_sums_left_to_aten(decompose: Callable[..., Any]) -> Callable[..., Any]:
    """Inductor's decomposition of ``aten.add`` that leaves an empty complex operand to aten:
    it views complex operands as real pairs, which an empty tensor's strides refuse (torch
    2.13: ``torch.compile(lambda x, y: x + y)`` on two ``(4, 0)`` complex tensors raises
    "self.stride(0) must be divisible by 2 to view Double as ComplexDouble"), and a rank's FFT
    shard is empty where it holds no kept mode (the FNO on a 2x2 mesh)."""

    @functools.wraps(decompose)
    def add(x: Any, y: Any, *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(t, torch.Tensor) and t.numel() == 0 and t.is_complex() for t in (x, y)):
            return NotImplemented
        return decompose(x, y, *args, **kwargs)

    return add


def _plain_tangents_read_as_replicated(
    process: Callable[..., Any], cls: type
) -> Callable[..., Any]:
    """AOTAutograd's ``process_runtime_tangent`` (the check of each gradient entering a
    compiled backward) that first reads a plain gradient where a ``cls`` was traced as
    replicated, as eager ShardTensor code reads one (``_api._as_shard_tensor``); the check
    then moves it to the traced layout (``__coerce_same_metadata_as_tangent__``). See NOTE
    [torch.compile and ShardTensor]: autograd's zeros for an output the loss does not reach."""
    from shardsci.tensor._api import _as_shard_tensor  # _api imports this module

    @functools.wraps(process)
    def process_runtime_tangent(x: Any, meta: Any, *args: Any, **kwargs: Any) -> Any:
        expected = getattr(meta, "original_subclass_type", None)
        if type(x) is torch.Tensor and expected is not None and issubclass(expected, cls):
            x = _as_shard_tensor(x, meta.meta)
        return process(x, meta, *args, **kwargs)

    return process_runtime_tangent


def _mutated_inputs_tangents_as(collect: Callable[..., Any], cls: type) -> Callable[..., Any]:
    """AOTAutograd's ``run_functionalized_fw_and_collect_metadata`` that, for a graph with a
    ``cls`` input, traces the gradient of a subclass input the graph mutates in place as the
    subclass (functorch's ``disable_guess_zero_tangent_for_mutated_input_subclass``) where
    torch guesses a plain one: a ShardTensor read after the graph gets a ShardTensor gradient,
    which the guess refused; plain zeros, where they come, are read as replicated
    (``_plain_tangents_read_as_replicated``). Graphs without one keep torch's guess."""

    @functools.wraps(collect)
    def run_functionalized_fw_and_collect_metadata(*args: Any, **kwargs: Any) -> Any:
        inner = collect(*args, **kwargs)

        def collect_metadata(*flat_args: Any) -> Any:
            if not any(isinstance(a, cls) for a in flat_args):
                return inner(*flat_args)
            config = _torch_compat.functorch_config
            with config.patch(disable_guess_zero_tangent_for_mutated_input_subclass=True):
                return inner(*flat_args)

        return collect_metadata

    return run_functionalized_fw_and_collect_metadata


def _then(passes: Callable[..., Any], ours: Callable[..., Any]) -> Callable[..., Any]:
    """AOTAutograd's ``run_joint_graph_passes_on_hops`` followed by shardsci's joint pass,
    which looks only for shardsci's own gradient effects (NOTE [Where the gradient of a
    replicated parameter is summed]); a user's ``joint_custom_pass`` runs after both, on the
    joint graph the partitioner receives, as without shardsci."""

    @functools.wraps(passes)
    def run_joint_graph_passes_on_hops(module: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        return ours(passes(module, inputs, *args, **kwargs), inputs)

    return run_joint_graph_passes_on_hops
