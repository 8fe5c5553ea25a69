"""``__torch_dispatch__`` for ShardTensor: handlers, a fast path, and DTensor propagation.

Order of business for an aten op:
1. a registered aten handler (see ``_registry``), unless it declines;
2. the fast path: a pointwise op whose ShardTensor operands share one layout with no Partial
   axis runs on the local shards and keeps that layout, with no sharding propagation;
3. the default path below.

# NOTE [The default path: DTensor decides placements, shardsci decides sizes]
DTensor's sharding propagation picks output placements and the placements each input must
be moved to; it reasons about placements only, which do not depend on shard sizes. shardsci
then
- chooses the shard sizes of every input it must move so that all operands sharded over the
  same mesh axes are aligned (the largest operand already laid out that way sets the sizes,
  so operands sharded with different boundaries are realigned, the smaller ones moving),
- moves inputs with its own uneven-aware redistribution,
- gives each output the sizes of the aligned inputs along the matching axes, or, where an
  output extent differs from every input's, the sizes found by running the op on meta
  tensors of each rank's local shapes,
- rewrites global shape arguments to local ones from those sizes (DTensor's rewrite assumes
  ``torch.chunk`` sizes), and
- refuses a ``Partial("avg")`` result on unevenly sharded inputs (a mean of unequal shards is
  not the average of their means): such ops (mean, losses) have handlers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch._ops import OpOverload
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding, RuntimeSchemaInfo
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils import _pytree as pytree

from shardsci.tensor._redistribute import redistribute_local
from shardsci.tensor._registry import aten_handler_for
from shardsci.tensor._spec import (
    DimSharding,
    ShardTensorSpec,
    contiguous_stride,
    merged_hints,
    mesh_coordinate,
    nested_chunk_sizes,
    replicated_spec,
)

__all__ = ["bind_tensor_type", "dispatch", "run_with_propagation"]

aten = torch.ops.aten
_PROPAGATOR = DTensor._op_dispatcher.sharding_propagator
_ShardTensor: type = torch.Tensor  # bound to ShardTensor by bind_tensor_type


def bind_tensor_type(cls: type) -> None:
    """Called once by ``_api`` (which imports this module) to break the import cycle."""
    global _ShardTensor
    _ShardTensor = cls


def dispatch(cls: type, func: OpOverload, types: Any, args: tuple = (), kwargs: dict | None = None):
    kwargs = kwargs or {}
    if func in _DIM_ARGUMENT:
        args, kwargs = _explicit_reduction_dims(func, args, kwargs)
    handler = aten_handler_for(func)
    if handler is not None:
        result = handler(func, args, kwargs)
        if result is not NotImplemented:
            return result
    if _is_fast_pointwise(func):
        result = _pointwise_fast_path(func, args, kwargs)
        if result is not NotImplemented:
            return result
    return run_with_propagation(func, args, kwargs)


# NOTE [An empty dim list reduces every dim]
# For torch reductions ``dim=[]`` means all dims, but DTensor's reduction rules read it as "no
# dims" and return the input's placements: silently wrong, on even shards too. The dim
# argument is therefore made explicit before any handler or rule sees it.
_DIM_ARGUMENT = {
    aten.sum.dim_IntList: 1,
    aten.nansum.default: 1,
    aten.mean.dim: 1,
    aten.amax.default: 1,
    aten.amin.default: 1,
    aten.linalg_vector_norm.default: 2,
    aten.var.correction: 1,
    aten.std.correction: 1,
    aten.var_mean.correction: 1,
    aten.std_mean.correction: 1,
    aten.logsumexp.default: 1,
    aten.count_nonzero.dim_IntList: 1,
    aten.any.dims: 1,
    aten.all.dims: 1,
}


def _explicit_reduction_dims(func: OpOverload, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    index = _DIM_ARGUMENT[func]
    ndim = args[0].ndim
    if len(args) > index:
        dims = args[index]
    else:
        dims = kwargs.get("dim", func._schema.arguments[index].default_value)
    if not isinstance(dims, (list, tuple)) or len(dims) != 0 or not ndim:
        return args, kwargs
    if len(args) > index:
        return (*args[:index], list(range(ndim)), *args[index + 1 :]), kwargs
    if len(args) == index:
        return (*args, list(range(ndim))), kwargs
    return args, {**kwargs, "dim": list(range(ndim))}


# ---------------------------------------------------------------------------- fast path
_LAYOUT_PRESERVING = {
    aten.detach.default,
    aten.alias.default,
    aten.clone.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
    aten.zero_.default,
    aten.fill_.Scalar,
}
_FAST: dict[OpOverload, bool] = {}


def _is_fast_pointwise(func: OpOverload) -> bool:
    try:
        return _FAST[func]
    except KeyError:
        fast = func in _LAYOUT_PRESERVING or (
            torch.Tag.pointwise in func.tags and not _has_out_arguments(func)
        )
        _FAST[func] = fast
        return fast


def _has_out_arguments(func: OpOverload) -> bool:
    return any(a.is_out for a in func._schema.arguments)


def _pointwise_fast_path(func: OpOverload, args: tuple, kwargs: dict):
    spec = None
    local_args = []
    for arg in args:
        if type(arg) is _ShardTensor:
            if spec is None:
                spec = arg._spec
            elif arg._spec is not spec and not arg._spec.same_layout(spec):
                return NotImplemented
            local_args.append(arg._local)
        elif isinstance(arg, torch.Tensor) and arg.ndim != 0:
            return NotImplemented
        else:
            local_args.append(arg)
    if spec is None or spec.has_partial():
        return NotImplemented
    for value in kwargs.values():
        if isinstance(value, torch.Tensor):
            return NotImplemented
    out = func(*local_args, **kwargs)
    if _mutates_first_argument(func):
        return args[0]
    return _ShardTensor(out, spec.with_dtype(out.dtype))


def _mutates_first_argument(func: OpOverload) -> bool:
    arguments = func._schema.arguments
    return (
        bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write
    )


# ---------------------------------------------------------------------------- default path
def _holds_tensors(x: object) -> bool:
    return isinstance(x, (list, tuple)) and any(
        isinstance(i, (torch.Tensor, DTensorSpec)) for i in x
    )


def _flatten(args: tuple) -> tuple[list, pytree.TreeSpec]:
    """Leaves are tensors (or their specs) and whole other values: a shape list stays one
    leaf, a list of tensors is opened."""
    root = list(args)
    return pytree.tree_flatten(
        root,
        is_leaf=lambda x: x is not root and isinstance(x, (list, tuple)) and not _holds_tensors(x),
    )


def run_with_propagation(
    func: OpOverload,
    args: tuple,
    kwargs: dict,
    local_impl: Callable[..., Any] | None = None,
):
    """The default path of NOTE [The default path: DTensor decides placements, ...].

    Parameters
    ----------
    local_impl : callable, optional
        Runs instead of the op on the moved local shards (same arguments), for handlers that
        need only a different local kernel, e.g. one that copes with empty shards.
    """
    flat_args, args_tree = _flatten(args)
    mesh = _common_mesh(func, flat_args, kwargs)
    specs = [_spec_of(a, mesh) for a in flat_args]
    sharding = _propagate(func, kwargs, flat_args, args_tree, specs, mesh)
    if sharding is None:
        return _decompose(func, args, kwargs)
    if _has_uneven_average(sharding.output_spec, specs):
        raise NotImplementedError(
            f"{func} averages over unevenly sharded dims (a mean of unequal shards is not the "
            f"average of their means); it needs a shardsci handler"
        )
    op, targets, values, extra_args = _suggestion(func, sharding, flat_args, specs)
    target_specs = _aligned_targets(specs, targets)
    if _moves_destination(func, specs, target_specs):
        return _in_place_through_copy(func, args, kwargs)
    local_flat = [
        redistribute_local(_local_of(arg), spec, target) if spec is not None else value
        for arg, value, spec, target in zip(flat_args, values, specs, target_specs)
    ]
    local_args = [*pytree.tree_unflatten(local_flat, args_tree), *extra_args]
    sizes_by_axes = _sizes_by_axes(target_specs)
    if sharding.use_val_from_redistribute_schema:
        _localise_shape_arguments(op, local_args, sharding.output_spec, sizes_by_axes, func)
    local_kwargs = {k: _local_of(v) for k, v in kwargs.items()}
    out = (local_impl or op)(*local_args, **local_kwargs)
    if _mutates_first_argument(func):
        return args[0]
    hints = merged_hints(*(s.hints + s.shardings for s in specs if s is not None))
    return _wrap(out, sharding.output_spec, sizes_by_axes, mesh, func, hints)


def _suggestion(
    func: OpOverload,
    sharding: OutputSharding,
    flat_args: list,
    specs: list[ShardTensorSpec | None],
) -> tuple[OpOverload, list[DTensorSpec | None], list, list]:
    """The op to run, each operand's target DTensor spec, the (possibly rewritten)
    non-tensor values, and extra arguments a rewritten op takes."""
    suggested = sharding.redistribute_schema
    if not sharding.needs_redistribute or suggested is None:
        return func, [None] * len(flat_args), flat_args, []
    suggested_flat, _ = _flatten(tuple(suggested.args_schema))
    targets = [
        t if isinstance(t, DTensorSpec) and s is not None else None
        for t, s in zip(suggested_flat, specs)
    ]
    if not sharding.use_val_from_redistribute_schema:
        return suggested.op, targets, flat_args, []
    values = [a if s is not None else v for a, v, s in zip(flat_args, suggested_flat, specs)]
    return suggested.op, targets, values, list(suggested_flat[len(flat_args) :])


def _common_mesh(func: OpOverload, flat_args: list, kwargs: dict):
    mesh = None
    for arg in (*flat_args, *kwargs.values()):
        if type(arg) is _ShardTensor:
            if mesh is None:
                mesh = arg._spec.mesh
            elif arg._spec.mesh is not mesh and arg._spec.mesh != mesh:
                raise ValueError(
                    f"{func}: operands live on different device meshes ({mesh} and "
                    f"{arg._spec.mesh}); redistribute them onto one mesh first"
                )
    if mesh is None:
        raise RuntimeError(f"{func}: no ShardTensor operand found")
    return mesh


def _spec_of(arg: object, mesh) -> ShardTensorSpec | None:
    if type(arg) is _ShardTensor:
        return arg._spec
    if isinstance(arg, torch.Tensor):
        return replicated_spec(arg, mesh)
    return None


def _local_of(arg: object) -> object:
    return arg._local if type(arg) is _ShardTensor else arg


def _propagate(
    func: OpOverload,
    kwargs: dict,
    flat_args: list,
    args_tree: pytree.TreeSpec,
    specs: list[ShardTensorSpec | None],
    mesh,
) -> OutputSharding | None:
    schema_args = [s.dtensor_spec if s is not None else a for a, s in zip(flat_args, specs)]
    schema_kwargs = {
        k: _spec_of(v, mesh).dtensor_spec if isinstance(v, torch.Tensor) else v
        for k, v in kwargs.items()
    }
    schema = OpSchema(
        func,
        tuple(pytree.tree_unflatten(schema_args, args_tree)),
        schema_kwargs,
        schema_info=_schema_info(func, kwargs),
    )
    try:
        return _PROPAGATOR.propagate_op_sharding(schema)
    except NotImplementedError:
        if _can_decompose(func):
            return None
        raise NotImplementedError(
            f"shardsci: {func} has no sharding rule; register a handler with "
            f"shardsci.register_aten_handler({func})"
        ) from None


def _schema_info(func: OpOverload, kwargs: dict) -> RuntimeSchemaInfo:
    """Which arguments key DTensor's propagation cache. Without this, non-tensor arguments
    (flip's dims, a reduction's keepdim) are left out of the key and a cached result for
    other values is reused."""
    info = _PROPAGATOR.op_to_schema_info.get(
        func
    ) or _PROPAGATOR.op_to_schema_info_for_single_dim_strategy.get(func)
    if info is not None:
        return info
    return RuntimeSchemaInfo(static_argnum=0, static_kwargkey=sorted(kwargs) or None)


def _can_decompose(func: OpOverload) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(
        func.name(), torch._C.DispatchKey.CompositeImplicitAutograd
    )


def _decompose(func: OpOverload, args: tuple, kwargs: dict):
    result = func.decompose(*args, **kwargs)
    if result is NotImplemented:
        raise NotImplementedError(f"shardsci: cannot decompose {func}")
    return result


def _has_uneven_average(output_spec: object, specs: list[ShardTensorSpec | None]) -> bool:
    outputs = output_spec if isinstance(output_spec, (tuple, list)) else (output_spec,)
    averaged_axes = {
        axis
        for o in outputs
        if isinstance(o, DTensorSpec)
        for axis, p in enumerate(o.placements)
        if isinstance(p, Partial) and p.reduce_op == "avg"
    }
    return any(
        axis in s.axes and not s.is_even()
        for spec in specs
        if spec is not None
        for s in spec.shardings
        for axis in averaged_axes
    )


# ---------------------------------------------------------------------------- alignment
def _aligned_targets(
    specs: list[ShardTensorSpec | None], targets: list[DTensorSpec | None]
) -> list[ShardTensorSpec | None]:
    """Our target spec for each operand: DTensor's placements, sizes aligned across operands."""
    reference = _reference_sizes(specs, targets)
    result: list[ShardTensorSpec | None] = []
    for spec, target in zip(specs, targets):
        if spec is None:
            result.append(None)
            continue
        if target is None or (
            target.placements == spec.placements and _order_of(target) == _order_of_spec(spec)
        ):
            if all(reference.get(s.axes, s.sizes) == s.sizes for s in spec.shardings):
                result.append(spec)
                continue
            target = spec.dtensor_spec
        result.append(_spec_for(spec, target, reference))
    return result


def _order_of(target: DTensorSpec) -> dict[int, tuple[int, ...]]:
    return {e.tensor_dim: tuple(e.mesh_dims) for e in target.shard_order}


def _order_of_spec(spec: ShardTensorSpec) -> dict[int, tuple[int, ...]]:
    return {s.dim: s.axes for s in spec.shardings}


def _reference_sizes(
    specs: list[ShardTensorSpec | None], targets: list[DTensorSpec | None]
) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Mesh axes -> shard sizes all operands sharded over them will share.

    The largest operand already sharded that way decides; otherwise the remembered sizes of
    any operand (hints); otherwise ``torch.chunk`` sizes.
    """
    best: dict[tuple[int, ...], tuple[int, tuple[int, ...]]] = {}
    wanted: dict[tuple[int, ...], int] = {}
    for spec, target in zip(specs, targets):
        if spec is None:
            continue
        order = _order_of(target) if target is not None else _order_of_spec(spec)
        for dim, axes in order.items():
            extent = spec.shape[dim]
            if wanted.setdefault(axes, extent) != extent:
                raise NotImplementedError(
                    f"operands sharded over mesh axes {axes} have different extents "
                    f"({wanted[axes]} and {extent}) along their sharded dims"
                )
            current = spec.sharding_by_dim.get(dim)
            if current is not None and current.axes == axes:
                numel = math.prod(spec.shape)
                if axes not in best or numel > best[axes][0]:
                    best[axes] = (numel, current.sizes)
    reference = {axes: sizes for axes, (_, sizes) in best.items()}
    for axes, extent in wanted.items():
        if axes not in reference:
            mesh_shape = next(s.mesh_shape for s in specs if s is not None)
            reference[axes] = _remembered(specs, axes, extent) or nested_chunk_sizes(
                extent, [mesh_shape[a] for a in axes]
            )
    return reference


def _remembered(
    specs: list[ShardTensorSpec | None], axes: tuple[int, ...], extent: int
) -> tuple[int, ...] | None:
    for spec in specs:
        if spec is not None:
            for hint in spec.hints:
                if hint.axes == axes and hint.extent == extent:
                    return hint.sizes
    return None


def _spec_for(
    spec: ShardTensorSpec, target: DTensorSpec, reference: dict[tuple[int, ...], tuple[int, ...]]
) -> ShardTensorSpec:
    placements = tuple(
        p if not isinstance(p, _StridedShard) else Shard(p.dim) for p in target.placements
    )
    order = _order_of(target)
    return ShardTensorSpec.build(
        spec.mesh,
        placements,
        spec.shape,
        spec.dtype,
        {dim: reference[axes] for dim, axes in order.items()},
        stride=spec.stride,
        order=order,
        hints=merged_hints(spec.hints, spec.shardings),
    )


def _sizes_by_axes(
    target_specs: list[ShardTensorSpec | None],
) -> dict[tuple[int, ...], DimSharding]:
    found: dict[tuple[int, ...], DimSharding] = {}
    for spec in target_specs:
        if spec is not None:
            for s in spec.shardings:
                found.setdefault(s.axes, s)
    return found


def _moves_destination(
    func: OpOverload, specs: list[ShardTensorSpec | None], targets: list[ShardTensorSpec | None]
) -> bool:
    """Whether an in-place op's rule wants its destination in another layout."""
    return (
        _mutates_first_argument(func)
        and specs[0] is not None
        and not specs[0].same_layout(targets[0])
    )


def _in_place_through_copy(func: OpOverload, args: tuple, kwargs: dict):
    """Run the out-of-place op, then copy the result into the destination's own layout."""
    name = func.overloadpacket.__name__.rstrip("_")
    functional = getattr(getattr(aten, name), func._overloadname, None)
    if functional is None:
        raise NotImplementedError(
            f"in-place {func} would need to move its destination {args[0]._spec}, and it has "
            f"no out-of-place twin; redistribute the destination first"
        )
    destination = args[0]
    result = functional(*args, **kwargs)
    target = destination._spec.with_dtype(result.dtype)
    destination._local.copy_(redistribute_local(result._local, result._spec, target))
    return destination


# ---------------------------------------------------------------------------- outputs
def _wrap(
    out: object,
    output_spec: object,
    sizes_by_axes: dict[tuple[int, ...], DimSharding],
    mesh,
    func: OpOverload,
    hints: tuple[DimSharding, ...],
):
    if isinstance(out, torch.Tensor):
        if not isinstance(output_spec, DTensorSpec):
            return out
        spec = _output_spec(out, output_spec, sizes_by_axes, mesh, func, hints)
        return _ShardTensor(out, spec)
    if isinstance(out, (tuple, list)):
        specs = output_spec if isinstance(output_spec, (tuple, list)) else [output_spec] * len(out)
        wrapped = [_wrap(o, s, sizes_by_axes, mesh, func, hints) for o, s in zip(out, specs)]
        return type(out)(wrapped)
    return out


def _output_spec(
    local: torch.Tensor,
    dspec: DTensorSpec,
    sizes_by_axes: dict[tuple[int, ...], DimSharding],
    mesh,
    func: OpOverload,
    hints: tuple[DimSharding, ...],
) -> ShardTensorSpec:
    if any(isinstance(p, _StridedShard) for p in dspec.placements):
        raise NotImplementedError(
            f"{func} produced an interleaved (strided) sharding that a ShardTensor cannot "
            f"describe; redistribute the input so that the sharded dim is not merged with "
            f"dims before it"
        )
    meta = dspec.tensor_meta
    shape = meta.shape if meta is not None else local.shape
    order = _order_of(dspec)
    sizes = {}
    for dim, axes in order.items():
        known = sizes_by_axes.get(axes)
        if known is not None and known.extent == shape[dim]:
            sizes[dim] = known.sizes
        else:
            raise NotImplementedError(
                f"{func}: cannot tell the shard sizes of output dim {dim} (extent {shape[dim]}, "
                f"placements {dspec.placements}) from its inputs (sharded as "
                f"{ {axes: list(s.sizes) for axes, s in sizes_by_axes.items()} }); this op "
                f"needs a shardsci handler"
            )
    spec = ShardTensorSpec.build(
        mesh,
        dspec.placements,
        shape,
        local.dtype,
        sizes,
        stride=meta.stride if meta is not None else None,
        order=order,
        hints=hints,
    )
    if tuple(local.shape) != tuple(spec.local_shape()):
        raise RuntimeError(
            f"shardsci internal error: {func} produced a shard of shape {tuple(local.shape)}, "
            f"expected {tuple(spec.local_shape())} for {spec}"
        )
    return spec


def _localise_shape_arguments(
    op: OpOverload,
    local_args: list,
    output_spec: object,
    sizes_by_axes: dict[tuple[int, ...], DimSharding],
    func: OpOverload,
) -> None:
    """Replace DTensor's chunk-based local shape arguments (in place) by ones from the true
    sizes."""
    index = _PROPAGATOR.op_to_shape_and_stride_idx.get(op)
    if index is None:
        if op in _PROPAGATOR.op_to_scalar_shape_adjuster and any(
            not s.is_even() for s in sizes_by_axes.values()
        ):
            raise NotImplementedError(f"{func} on unevenly sharded inputs needs a shardsci handler")
        return
    if not isinstance(output_spec, DTensorSpec) or output_spec.tensor_meta is None:
        return
    global_shape = list(output_spec.tensor_meta.shape)
    local_shape = list(global_shape)
    coordinate = mesh_coordinate(output_spec.mesh)
    mesh_shape = tuple(output_spec.mesh.shape)
    for dim, axes in _order_of(output_spec).items():
        known = sizes_by_axes.get(axes)
        if known is None or known.extent != global_shape[dim]:
            raise NotImplementedError(
                f"{func}: cannot localise its shape argument for sharded output dim {dim}; "
                f"this op needs a shardsci handler"
            )
        local_shape[dim] = known.sizes[known.flat_index(mesh_shape, coordinate)]
    shape_index = index if isinstance(index, int) else index[0]
    local_args[shape_index] = local_shape
    if not isinstance(index, int):
        local_args[index[1]] = list(contiguous_stride(local_shape))
