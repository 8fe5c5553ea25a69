"""Every private PyTorch symbol shardsci uses, resolved in one place.

# NOTE [Private PyTorch symbols live in _torch_compat]
shardsci builds on DTensor internals (its spec, sharding propagator and view rules), on
dispatcher hooks of ``torch._C`` and on test utilities, none of which PyTorch promises to keep.
Every such symbol is imported from this module, never from torch directly
(``tests/test_torch_compat.py`` scans the library for private torch imports and attribute
chains, and smoke-tests each entry of ``PRIVATE_SYMBOLS`` for the attributes and parameters
shardsci relies on). So a PyTorch upgrade that moves or removes one fails here, at the first
import of the name, with a ``TorchCompatError`` naming the symbol, what shardsci uses it for,
the installed torch version and the one shardsci is tested with; the fix goes here too.

Names are resolved lazily (PEP 562 ``__getattr__``): a symbol only the test harness needs
(``LocalTensorMode``) cannot break ``import shardsci``.

# NOTE [Which torch versions are tested]
shardsci installs on the torch releases in ``TESTED_TORCH`` (the pin in pyproject.toml is
their range). 2.13 is the CI's; 2.11 (the GPU machines' CUDA 13 build, which also runs on the
CPU) and 2.12 are tested with ``scripts/test_torch_versions.sh VENV``, which runs the suite in
a virtual environment holding that torch. Where a private symbol differs between them, a
function below absorbs it, its docstring naming the versions that need it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "PRIVATE_SYMBOLS",
    "TESTED_TORCH",
    "PrivateSymbol",
    "TorchCompatError",
    "all_gather_single",
    "backport_sharding_rules",
    "channel_split_grid_sampler_rules",
    "resolve",
    "scalar_shape_adjusters",
    "torch_release",
]

TESTED_TORCH = ("2.11", "2.12", "2.13")
"""The torch releases the suite passes on (NOTE [Which torch versions are tested])."""


class TorchCompatError(ImportError):
    """A private PyTorch symbol shardsci needs is missing from the installed torch."""


@dataclass(frozen=True)
class PrivateSymbol:
    """Where a private symbol lives in torch and why shardsci needs it.

    Attributes
    ----------
    module : str
        The torch module to import.
    path : str
        Attribute path inside it (dotted); empty for the module itself.
    why : str
        What shardsci uses it for, shown when it is missing.
    after : str
        A torch module to import first, where ``module`` imported on its own is a circular
        import in torch; empty for none.
    """

    module: str
    path: str
    why: str
    after: str = ""

    @property
    def qualified_name(self) -> str:
        return f"{self.module}.{self.path}" if self.path else self.module


def _at(location: str, why: str, after: str = "") -> PrivateSymbol:
    """``"torch.x._y:Name.attr"`` -> a PrivateSymbol (module before the colon)."""
    module, _, path = location.partition(":")
    return PrivateSymbol(module, path, why, after)


#: Exported name -> where it comes from. Names keep torch's spelling so that a grep for the
#: torch symbol finds it here.
PRIVATE_SYMBOLS: dict[str, PrivateSymbol] = {
    # --- DTensor internals: specs, sharding propagation, view rules
    "DTensorSpec": _at(
        "torch.distributed.tensor._dtensor_spec:DTensorSpec",
        "the spec DTensor's sharding rules read and return",
    ),
    "TensorMeta": _at(
        "torch.distributed.tensor._dtensor_spec:TensorMeta",
        "global shape, stride and dtype in a DTensorSpec",
    ),
    "OpSchema": _at(
        "torch.distributed.tensor._op_schema:OpSchema",
        "the input of DTensor's sharding propagation",
    ),
    "OutputSharding": _at(
        "torch.distributed.tensor._op_schema:OutputSharding",
        "the result of DTensor's sharding propagation",
    ),
    "RuntimeSchemaInfo": _at(
        "torch.distributed.tensor._op_schema:RuntimeSchemaInfo",
        "which op arguments key DTensor's sharding propagation",
    ),
    "_StridedShard": _at(
        "torch.distributed.tensor.placement_types:_StridedShard",
        "a placement DTensor's rules may return, mapped back to Shard",
    ),
    "sharding_propagator": _at(
        "torch.distributed.tensor:DTensor._op_dispatcher.sharding_propagator",
        "DTensor's sharding rules, reused for ops without a shardsci handler",
    ),
    "dtensor_sharding_prop": _at(
        "torch.distributed.tensor._sharding_prop",
        "where DTensor's propagation looks up its single-dim expansion, fronted by the search "
        "for an unmoved combination",
    ),
    "_PreparedSingleDimStrategy": _at(
        "torch.distributed.tensor._ops.single_dim_strategy:_PreparedSingleDimStrategy",
        "an op's single-axis rules with their placeholders filled in",
    ),
    "expand_to_full_mesh_op_strategy": _at(
        "torch.distributed.tensor._ops.utils:expand_to_full_mesh_op_strategy",
        "DTensor's expansion of single-axis rules to a mesh, run on the rules that move no operand",
    ),
    "TupleStrategy": _at(
        "torch.distributed.tensor._op_schema:TupleStrategy",
        "a list-of-tensors argument in DTensor's propagation (left to its full expansion)",
    ),
    "dtensor_redistribute": _at(
        "torch.distributed.tensor._redistribute",
        "DTensor's redistribution planner caches, cleared by clear_caches()",
    ),
    "Flatten": _at(
        "torch.distributed.tensor._ops._view_ops:Flatten",
        "a view rule: several input dims become one",
    ),
    "InputDim": _at(
        "torch.distributed.tensor._ops._view_ops:InputDim",
        "a view rule: an output dim is an input dim",
    ),
    "Split": _at(
        "torch.distributed.tensor._ops._view_ops:Split",
        "a view rule: one input dim becomes several",
    ),
    "infer_size": _at(
        "torch.distributed.tensor._ops._view_ops:infer_size",
        "the shape of a view with a -1 size",
    ),
    "view_groups": _at(
        "torch.distributed.tensor._ops._view_ops:view_groups",
        "how a view regroups input dims into output dims",
    ),
    # --- the dispatcher, autograd engine and tensor subclassing
    "OpOverload": _at("torch._ops:OpOverload", "the type of an aten overload"),
    "_native_batch_norm_legit": _at(
        "torch:_native_batch_norm_legit",
        "aten's batch norm as a torch function, whose layouts the normalisation handler keeps",
    ),
    "decomposition_table": _at(
        "torch._decomp:decomposition_table",
        "running an op without a sharding rule as its aten decomposition",
    ),
    "no_dispatch": _at(
        "torch.utils._mode_utils:no_dispatch", "calling a kernel below every dispatch mode"
    ),
    "OpOverloadPacket": _at("torch._ops:OpOverloadPacket", "the type of an aten op's overloads"),
    "_make_wrapper_subclass": _at(
        "torch:Tensor._make_wrapper_subclass", "creating a ShardTensor wrapper subclass"
    ),
    "_disabled_torch_function_impl": _at(
        "torch._C:_disabled_torch_function_impl",
        "calling a torch function below __torch_function__",
    ),
    "_dispatch_has_kernel_for_dispatch_key": _at(
        "torch._C:_dispatch_has_kernel_for_dispatch_key",
        "whether an op decomposes (CompositeImplicitAutograd) instead of being propagated",
    ),
    "DispatchKey": _at("torch._C:DispatchKey", "the dispatch key of composite ops"),
    "DelayedError": _at(
        "torch._C:_functions.DelayedError",
        "results of a backward that raise when differentiated (first_order_only)",
    ),
    "_is_any_autocast_enabled": _at(
        "torch._C:_is_any_autocast_enabled",
        "a linear layer's autocast check in 0.3 us where autocast is off (any device)",
    ),
    "_current_graph_task_id": _at(
        "torch._C:_current_graph_task_id", "telling one backward pass from the next"
    ),
    "_will_engine_execute_node": _at(
        "torch._C:_will_engine_execute_node",
        "whether this backward pass reaches a parameter's gradient accumulator",
    ),
    "_execution_engine": _at(
        "torch.autograd:Variable._execution_engine",
        "queueing a callback at the end of a backward pass",
    ),
    "TorchDispatchMode": _at(
        "torch.utils._python_dispatch:TorchDispatchMode", "counting collectives at the dispatcher"
    ),
    "is_traceable_wrapper_subclass_type": _at(
        "torch.utils._python_dispatch:is_traceable_wrapper_subclass_type",
        "letting tensor subclasses through a dispatch mode",
    ),
    "tree_map": _at("torch.utils._pytree:tree_map", "mapping over nested results"),
    "tree_leaves": _at("torch.utils._pytree:tree_leaves", "the tensors in nested arguments"),
    "_push_mode": _at(
        "torch.utils._python_dispatch:_push_mode",
        "a work counter on inside a ShardTensor op, counting its local kernels",
    ),
    "_pop_mode": _at(
        "torch.utils._python_dispatch:_pop_mode",
        "a work counter on inside a ShardTensor op, counting its local kernels",
    ),
    "any_torch_dispatch_mode_on_stack": _at(
        "torch.utils._python_dispatch:any_torch_dispatch_mode_on_stack",
        "whether a dispatch mode (fake tensors, a tracer) is active",
    ),
    "_meta_in_tls_dispatch_include": _at(
        "torch._C:_meta_in_tls_dispatch_include",
        "whether the Meta key is forced on, for an in-place view's metadata update",
    ),
    "_set_meta_in_tls_dispatch_include": _at(
        "torch._C:_set_meta_in_tls_dispatch_include",
        "forcing the Meta key on, for an in-place view's metadata update",
    ),
    "_current_autograd_node": _at(
        "torch._C:_current_autograd_node", "which autograd node a backward op belongs to"
    ),
    "Tensor_is_zerotensor": _at(
        "torch:Tensor._is_zerotensor",
        "a backward formula's zero gradient that holds no storage (not a gradient built whole)",
    ),
    "Module_call_impl": _at(
        "torch.nn.modules.module:Module._call_impl",
        "the frame of a module's call, for naming the module an unasked-for gather ran in",
    ),
    # --- torch.compile and the dry-run planner
    "trace_rules": _at(
        "torch._dynamo.trace_rules",
        "keeping dynamo from compiling shardsci.tensor's frames on their own (inlined instead)",
    ),
    "functorch_config": _at(
        "torch._functorch.config",
        "tracing the gradient of a ShardTensor a compiled graph mutates in place as a ShardTensor",
    ),
    "GraphLowering": _at(
        "torch._inductor.graph:GraphLowering",
        "declining layout optimisation for a graph holding shardsci's ops (its decide_layout_opt)",
    ),
    "inductor_config": _at(
        "torch._inductor.config",
        "declining layout optimisation for the forward graph of a joint graph that holds "
        "shardsci's ops (a setting in inductor's cache key, unlike decide_layout_opt)",
    ),
    "aot_autograd_module": _at(
        "torch._functorch.aot_autograd",
        "tracing the gradient of a ShardTensor a compiled graph mutates in place as a "
        "ShardTensor (its run_functionalized_fw_and_collect_metadata)",
    ),
    "aot_graph_compile": _at(
        "torch._functorch._aot_autograd.graph_compile",
        "running shardsci's joint pass after torch's (its run_joint_graph_passes_on_hops); "
        "the forward of a joint graph holding shardsci's ops laid out as traced (its "
        "aot_stage2_autograd)",
        after="torch._functorch.aot_autograd",
    ),
    "inductor_lowerings": _at(
        "torch._inductor.lowering:lowerings",
        "keeping the collectives of a graph traced through ShardTensors in program order in "
        "inductor's schedule (the lowering of with_effects)",
    ),
    "inductor_decomposition": _at(
        "torch._inductor.decomposition",
        "leaving the sum of empty complex shards to aten (inductor's decomposition of a "
        "complex add refuses their strides)",
    ),
    "inductor_virtualized": _at(
        "torch._inductor.virtualized:V",
        "the graph inductor is lowering, whose effect ordering edges shardsci re-keys",
    ),
    "AOTDispatchAutograd": _at(
        "torch._functorch._aot_autograd.runtime_wrappers:AOTDispatchAutograd",
        "reading a plain gradient that reaches a compiled backward where a ShardTensor was "
        "traced (autograd's zeros for an output the loss does not reach) as replicated",
        after="torch._functorch.aot_autograd",  # runtime_wrappers imports back from it
    ),
    "register_effectful_op": _at(
        "torch._higher_order_ops.effects:_register_effectful_op",
        "the collectives of a graph traced through ShardTensors as effects no compiler drops",
    ),
    "with_effects": _at(
        "torch._higher_order_ops.effects:with_effects",
        "counting the collectives a compiled graph runs as effects (count_traffic)",
    ),
    "DispatchKeySet": _at(
        "torch._C:DispatchKeySet",
        "running a traced collective's kernel with count_traffic's mode on, to count it",
    ),
    "EffectType": _at(
        "torch._higher_order_ops.effects:_EffectType",
        "the kind of effect (ORDERED) of a traced collective",
    ),
    "get_proxy_mode": _at(
        "torch.fx.experimental.proxy_tensor:get_proxy_mode",
        "whether AOTAutograd is tracing, so collectives must be functional",
    ),
    "nn_pad": _at("torch._C._nn:pad", "F.pad as the graphs dynamo captures call it"),
    "disable_current_modes": _at(
        "torch.utils._python_dispatch:_disable_current_modes",
        "reading a mesh's real rank tensor while torch.compile traces under a fake mode",
    ),
    "_get_dispatch_mode": _at(
        "torch._C:_get_dispatch_mode", "whether a fake mode is active (torch.compile's trace)"
    ),
    "_TorchDispatchModeKey": _at(
        "torch._C:_TorchDispatchModeKey", "the key of the fake mode among dispatch modes"
    ),
    "is_fake": _at(
        "torch._subclasses.fake_tensor:is_fake",
        "whether a handler runs on fake shards (torch.compile's trace)",
    ),
    "maybe_mark_dynamic": _at(
        "torch._dynamo:maybe_mark_dynamic", "shard sizes as dynamic dims in a region"
    ),
    "active_fake_mode": _at("torch._guards:active_fake_mode", "the fake mode of a dry run"),
    "FakeProcessGroup": _at(
        "torch._C._distributed_c10d:FakeProcessGroup", "process groups of a dry run's fake world"
    ),
    "_resolve_process_group": _at(
        "torch.distributed.distributed_c10d:_resolve_process_group",
        "the process group a functional collective names",
    ),
    # --- the test harness
    "set_pg_timeout": _at(
        "torch.distributed.distributed_c10d:_set_pg_timeout",
        "a process group's collective timeout, set after joining (the test rank pool joins "
        "with a longer one)",
    ),
    "LocalTensorMode": _at(
        "torch.distributed._local_tensor:LocalTensorMode", "simulated ranks in one process"
    ),
    "_map_to_rank_local_val": _at(
        "torch.distributed._local_tensor:_map_to_rank_local_val",
        "one simulated rank's value of a result",
    ),
    "dtensor_random": _at(
        "torch.distributed.tensor._random", "resetting DTensor's RNG tracker between runs"
    ),
}


def resolve(name: str) -> Any:
    """The torch object exported as ``name``, or a ``TorchCompatError`` that says what is
    missing and why shardsci needs it."""
    symbol = PRIVATE_SYMBOLS[name]
    try:
        if symbol.after:
            importlib.import_module(symbol.after)
        value: Any = importlib.import_module(symbol.module)
        for part in filter(None, symbol.path.split(".")):
            value = getattr(value, part)
    except (ImportError, AttributeError) as error:
        raise TorchCompatError(
            f"shardsci needs {symbol.qualified_name} ({symbol.why}), a private PyTorch API that "
            f"torch {torch.__version__} does not provide ({error}); shardsci is tested with "
            f"torch {', '.join(TESTED_TORCH)}: install one of those, or adapt "
            "shardsci/tensor/_torch_compat.py"
        ) from error
    return value


def torch_release() -> tuple[int, int]:
    """The installed torch's (major, minor): ``(2, 11)`` for ``2.11.0+cu130``."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


# ---------------------------------------------------------------------------- version differences
def scalar_shape_adjusters() -> Mapping[Any, Callable]:
    """DTensor's ops whose scalar shape arguments (``native_group_norm``'s N, C and HxW) its
    sharding propagation rewrites to a shard's values, op -> rewriter.

    torch 2.13 keeps them in ``ShardingPropagator.op_to_scalar_shape_adjuster``. torch 2.11 and
    2.12 have no such table and rewrite no scalar shape argument (they have no sharding rule
    for ``native_group_norm``, the one op 2.13 registers there): none.
    """
    if torch_release() < (2, 13):
        return {}
    return resolve("sharding_propagator").op_to_scalar_shape_adjuster


def all_gather_single() -> Callable[..., Any]:
    """``torch.distributed.all_gather_single(output, input, group=...)``: every member's
    ``input`` concatenated into ``output`` (c10d's ``_allgather_base_``).

    New in torch 2.13; torch 2.11 and 2.12 name the same collective, with the same
    signature, ``all_gather_into_tensor``.
    """
    if torch_release() < (2, 13):
        return torch.distributed.all_gather_into_tensor
    return torch.distributed.all_gather_single


def backport_sharding_rules() -> tuple[Any, ...]:
    """Bring DTensor's sharding rules up to torch 2.12's where the installed torch lacks one
    or has a wrong one; the ops whose rule it registered (none on 2.12 and 2.13).

    torch 2.11 has no rule for ``aten.squeeze.dims`` and ``squeeze_.dims`` (it squeezes one
    dim at a time), ``aten.flip.default`` and ``aten.any.dims``, and its rule for
    ``aten.div.Tensor`` and ``div_.Tensor`` keeps a divisor's pending sum pending in the
    quotient (``1 / (a0 + a1)`` is not ``1 / a0 + 1 / a1``: ``amax``'s backward divides by a
    pending count). The rules registered are 2.12's, built from 2.11's own pieces: squeeze
    drops the named dims of extent 1 as a view rule; ``any`` over dims is a linear reduction
    (a ``Partial("sum")`` of the flags, as ``any.dim``); flip keeps the shardings of the dims
    it does not flip and passes partials through; division first reduces a pending divisor
    (replicates it), then follows 2.11's own rule. Each op is registered only where the
    installed torch lacks the rule or has 2.11's, so calling this again changes nothing. The
    propagator is DTensor's own: plain DTensors gain the same rules.
    """
    propagator = resolve("sharding_propagator")
    aten = torch.ops.aten

    def has_rule(op: Any) -> bool:
        return (
            op in propagator.op_strategy_funcs
            or op in propagator.op_single_dim_strategy_funcs
            or op in propagator.op_to_rules
        )

    missing = [
        op
        for op in (aten.squeeze.dims, aten.squeeze_.dims, aten.any.dims, aten.flip.default)
        if not has_rule(op)
    ]
    if torch_release() >= (2, 12) and not missing:
        return ()
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy
    from torch.distributed.tensor._ops import _math_ops, _pointwise_ops, _view_ops
    from torch.distributed.tensor._ops.single_dim_strategy import (
        _ShardingPlaceholder,
        register_single_dim_strategy,
    )
    from torch.distributed.tensor._ops.utils import normalize_dim, register_op_strategy
    from torch.distributed.tensor.placement_types import Partial, Replicate

    linear = _pointwise_ops.linear_pointwise_strategy
    wrong = [
        op
        for op in (aten.div.Tensor, aten.div_.Tensor)
        if propagator.op_strategy_funcs.get(op) is linear
    ]
    by_dims = resolve("RuntimeSchemaInfo")(1)  # the dims argument keys the rule

    def squeeze_dims(input: Any, dim: Any) -> tuple[Any, ...]:
        squeezed = {normalize_dim(d, input.ndim) for d in dim}
        return tuple(
            _view_ops.InputDim(i)
            for i, extent in enumerate(input.shape)
            if extent != 1 or i not in squeezed
        )

    def flip_rule(op: Any, args_schema: Any, kwargs_schema: Any) -> list[list[Any]]:
        ndim = len(args_schema[0].shape)
        flipped = {normalize_dim(d, ndim) for d in args_schema[1]}
        kept = [[_ShardingPlaceholder(d)] * 2 for d in range(ndim) if d not in flipped]
        return kept + [[Partial(reduce)] * 2 for reduce in ("sum", "avg", "max", "min")]

    def replicated(spec: Any) -> Any:
        placements = tuple(Replicate() if p.is_partial() else p for p in spec.placements)
        return type(spec)(spec.mesh, placements, tensor_meta=spec.tensor_meta)

    def division_rule(op_schema: Any) -> Any:
        divisor = op_schema.args_schema[1]
        if isinstance(divisor, OpStrategy):
            divisor = OpStrategy([OpSpec(replicated(s.output_spec)) for s in divisor.strategies])
            args = (op_schema.args_schema[0], divisor, *op_schema.args_schema[2:])
            op_schema = type(op_schema)(
                op_schema.op, args, op_schema.kwargs_schema, schema_info=op_schema.schema_info
            )
        return linear(op_schema)

    for op in missing:
        if op.overloadpacket in (aten.squeeze, aten.squeeze_):
            _view_ops.dim_maps[op] = squeeze_dims
            _view_ops.register_op_strategy_map(op, op, schema_info=by_dims)
        elif op is aten.any.dims:
            _math_ops.LINEAR_REDUCTION_OP_MAP[op] = "sum"
            register_op_strategy(op, schema_info=by_dims)(_math_ops.linear_reduction_strategy)
        else:
            register_single_dim_strategy(op, schema_info=by_dims)(flip_rule)
    for op in wrong:
        register_op_strategy(op, schema_info=propagator.op_to_schema_info.get(op))(division_rule)
    propagator.propagate_op_sharding.cache_clear()  # shardings made by the rules replaced
    return (*missing, *wrong)


def channel_split_grid_sampler_rules() -> tuple[Any, ...]:
    """Let DTensor run ``grid_sampler_2d`` and ``grid_sampler_3d`` (``F.grid_sample``) and
    their backwards on an input split along its channels; the ops whose rule it registered.

    torch's rules (``grid_sampler_strategy`` and ``grid_sampler_backward_strategy`` in
    ``torch/distributed/tensor/_ops/_math_ops.py``, 2.13) split the batch only, "because the
    grid tensor has no channel dimension": an input split along its channels is moved to
    another layout (on a 2x2 mesh, its batch nested over both axes, at even sizes). Yet that is
    why a channel split is valid: every channel is sampled at the same points of the grid, so
    ``input[N, C, *S]`` split along ``C`` with the grid ``[N, *T, ndim]`` replicated gives
    ``output[N, C, *T]`` split the same way; in the backward, each rank's channels give their
    ``grad_input`` and their terms of ``grad_grid`` (a pending sum over the channel split).
    The rules registered are torch's with that one added; registered on every torch version
    (calling this again changes nothing). The propagator is DTensor's own: plain DTensors gain
    the rule.
    """
    propagator = resolve("sharding_propagator")
    aten = torch.ops.aten
    forward = (aten.grid_sampler_2d.default, aten.grid_sampler_3d.default)
    backward = (aten.grid_sampler_2d_backward.default, aten.grid_sampler_3d_backward.default)
    registered = [
        getattr(propagator.op_single_dim_strategy_funcs.get(op), "func", None)
        for op in (*forward, *backward)
    ]
    if all(getattr(rule, "channel_split", False) for rule in registered):
        return ()
    from torch.distributed.tensor._ops.single_dim_strategy import (
        _ShardingPlaceholder,
        register_single_dim_strategy,
    )
    from torch.distributed.tensor.placement_types import Partial, Replicate

    batch, channels = _ShardingPlaceholder(0), _ShardingPlaceholder(1)

    def forward_rule(op: Any, args_schema: Any, kwargs_schema: Any) -> list[list[Any]]:
        # output, input, grid
        return [
            [batch] * 3,
            [channels, channels, Replicate()],
            [Partial("sum"), Partial("sum"), Replicate()],
            [Partial("avg"), Partial("avg"), Replicate()],
        ]

    def backward_rule(op: Any, args_schema: Any, kwargs_schema: Any) -> list[list[Any]]:
        # grad_input, grad_grid, grad_output, input, grid
        return [[batch] * 5, [channels, Partial("sum"), channels, channels, Replicate()]]

    by_first = resolve("RuntimeSchemaInfo")(1)
    for ops, rule in ((forward, forward_rule), (backward, backward_rule)):
        rule.channel_split = True  # type: ignore[attr-defined]
        register_single_dim_strategy(list(ops), schema_info=by_first)(rule)
    propagator.propagate_op_sharding.cache_clear()  # shardings made by torch's rules replaced
    return (*forward, *backward)


def __getattr__(name: str) -> Any:
    if name not in PRIVATE_SYMBOLS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = resolve(name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*__all__, *PRIVATE_SYMBOLS])
