"""Plans for ops without a handler: DTensor decides placements, shardsci decides sizes.

# NOTE [The default path: DTensor decides placements, shardsci decides sizes]
DTensor's sharding propagation picks output placements and the placements each input must
be moved to; it reasons about placements only, which do not depend on shard sizes. shardsci
then
- chooses the shard sizes of every input it must move so that all operands sharded over the
  same mesh axes are aligned (the largest operand already laid out that way sets the sizes,
  so operands sharded with different boundaries are realigned, the smaller ones moving),
- moves inputs with its own uneven-aware redistribution,
- gives each output the sizes of the aligned inputs along the matching mesh axes,
- rewrites global shape arguments to local ones from those sizes (DTensor's rewrite assumes
  ``torch.chunk`` sizes), and
- refuses a ``Partial("avg")`` result on unevenly sharded inputs (a mean of unequal shards is
  not the average of their means): such ops (mean, losses) have handlers.
A plan depends only on the op, the operands' layouts and the non-tensor arguments, so it is
made once and cached: a training step's ops pay for propagation on the first step only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch._ops import OpOverload
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor import _redistribute as _dtensor_redistribute
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding, RuntimeSchemaInfo
from torch.distributed.tensor.placement_types import _StridedShard

from shardsci.tensor._caches import BoundedCache, register_cache
from shardsci.tensor._spec import (
    DimSharding,
    ShardTensorSpec,
    contiguous_stride,
    merged_hints,
    mesh_coordinate,
    nested_chunk_sizes,
    replicated_spec,
)

__all__ = ["Plan", "flatten_args", "plan_for", "unflatten_args"]

_PROPAGATOR = DTensor._op_dispatcher.sharding_propagator
_MAX_PLANS = 4096
_ShardTensor: type = torch.Tensor  # bound by ``_api`` through ``_dispatch.bind_tensor_type``


def bind_tensor_type(cls: type) -> None:
    global _ShardTensor
    _ShardTensor = cls


@dataclass
class Plan:
    """How to run one op on operands of given layouts.

    Attributes
    ----------
    action : str
        ``"run"``; ``"decompose"`` (no rule, run the op's decomposition); ``"copy_back"`` (an
        in-place op whose rule moves its destination: run out of place, copy back).
    op : OpOverload
        The op to run locally (DTensor may rewrite it, e.g. squeeze -> squeeze.dims).
    sources, targets : tuple of ShardTensorSpec or None
        Per flattened argument: its layout and the layout to move it to (None: no tensor, or
        no move).
    values : tuple
        Per flattened argument: the non-tensor value to pass (possibly rewritten).
    extra_args : tuple
        Arguments appended by a rewritten op.
    shape_argument : tuple or None
        ``(index, local shape, stride index or None, local stride)``: a global shape argument
        replaced by this rank's.
    outputs : object
        The output specs, in the structure of the op's result (None for non-tensors).
    returns_destination : bool
        An in-place op: the result is its first argument.
    checked : bool
        Whether the local outputs have been checked against ``outputs`` (first run only).
    """

    action: str
    op: OpOverload
    sources: tuple = ()
    targets: tuple = ()
    values: tuple = ()
    extra_args: tuple = ()
    shape_argument: tuple | None = None
    outputs: object = None
    returns_destination: bool = False
    checked: bool = field(default=False)


# ---------------------------------------------------------------------------- arguments
def flatten_args(args: tuple) -> tuple[list, tuple]:
    """Leaves: tensors (or DTensor specs) and whole other values; a list of tensors is opened
    one level (aten ops take at most that), a shape list stays one leaf."""
    leaves: list = []
    structure = []
    for arg in args:
        if isinstance(arg, (list, tuple)) and any(
            isinstance(i, (torch.Tensor, DTensorSpec)) for i in arg
        ):
            structure.append(len(arg))
            leaves.extend(arg)
        else:
            structure.append(None)
            leaves.append(arg)
    return leaves, tuple(structure)


def unflatten_args(leaves: list, structure: tuple) -> list:
    args = []
    position = 0
    for length in structure:
        if length is None:
            args.append(leaves[position])
            position += 1
        else:
            args.append(list(leaves[position : position + length]))
            position += length
    return args


def _key(value: object) -> object:
    if type(value) is _ShardTensor:
        return value._spec.key
    if isinstance(value, torch.Tensor):
        return ("plain", tuple(value.shape), value.stride(), value.dtype, value.device)
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_key(v) for v in value))
    return (type(value), value)


# ---------------------------------------------------------------------------- plans
# Keyed by value (NOTE [Caches are keyed by value]): the op, the operands' spec keys, the
# other arguments.
_PLANS: BoundedCache[tuple, Plan] = BoundedCache("sharding plans", _MAX_PLANS)
# DTensor's own propagation cache never evicts: this bounded one stands in front of it.
_SHARDINGS: BoundedCache[OpSchema, OutputSharding] = BoundedCache(
    "DTensor sharding propagations", _MAX_PLANS
)
register_cache(
    "DTensor's propagation cache",
    lambda: _PROPAGATOR.propagate_op_sharding.cache_info().currsize,
    _PROPAGATOR.propagate_op_sharding.cache_clear,
)
# DTensor's propagation prices redistributions with planners it caches per (mesh, shape) and
# transform lists it caches per pair of specs, and never evicts either (they hold their meshes,
# so they outlive them too): both are emptied whenever one passes this bound.
_MAX_PRICING_ENTRIES = 256
_PRICING_CACHES = {
    "DTensor's redistribute planners": (
        lambda: len(_dtensor_redistribute._planner_cache),
        _dtensor_redistribute.clear_redistribute_planner_cache,
    ),
    "DTensor's transform infos": (
        lambda: _dtensor_redistribute._gen_transform_infos.cache_info().currsize,
        _dtensor_redistribute._gen_transform_infos.cache_clear,
    ),
}
for _name, (_size, _clear) in _PRICING_CACHES.items():
    register_cache(_name, _size, _clear)


def _propagated(schema: OpSchema) -> OutputSharding:
    sharding = _PROPAGATOR.propagate_op_sharding_non_cached(schema)
    if any(size() > _MAX_PRICING_ENTRIES for size, _ in _PRICING_CACHES.values()):
        for _, clear in _PRICING_CACHES.values():
            clear()
    return sharding


def plan_for(func: OpOverload, leaves: list, structure: tuple, kwargs: dict) -> Plan:
    """The cached plan for ``func`` on these operands (see the NOTE above)."""
    try:
        key = (
            func,
            structure,
            tuple(_key(v) for v in leaves),
            tuple(sorted((k, _key(v)) for k, v in kwargs.items())),
        )
        hash(key)
    except TypeError:
        return _make_plan(func, leaves, structure, kwargs)
    return _PLANS.get_or_make(key, lambda: _make_plan(func, leaves, structure, kwargs))


def _make_plan(func: OpOverload, leaves: list, structure: tuple, kwargs: dict) -> Plan:
    mesh = _common_mesh(func, leaves, kwargs)
    sources = [_spec_of(v, mesh) for v in leaves]
    sharding = _propagate(func, leaves, structure, kwargs, sources, mesh)
    if sharding is None:
        return Plan("decompose", func)
    if _has_uneven_average(sharding.output_spec, sources):
        raise NotImplementedError(
            f"{func} averages over unevenly sharded dims (a mean of unequal shards is not the "
            f"average of their means); it needs a shardsci handler"
        )
    op, suggested, values, extra_args = _suggestion(func, sharding, leaves, sources)
    targets = _aligned_targets(sources, suggested)
    if _mutates_first_argument(func) and not sources[0].same_layout(targets[0]):
        return Plan("copy_back", func)
    sizes_by_axes = _sizes_by_axes(targets)
    shape_argument = None
    if sharding.use_val_from_redistribute_schema:
        shape_argument = _local_shape_argument(op, sharding.output_spec, sizes_by_axes, func)
    hints = merged_hints(*(s.hints + s.shardings for s in sources if s is not None))
    return Plan(
        "run",
        op,
        tuple(sources),
        tuple(None if s is None or s.same_layout(t) else t for s, t in zip(sources, targets)),
        tuple(None if s is not None else v for v, s in zip(values, sources)),
        tuple(extra_args),
        shape_argument,
        _output_specs(sharding.output_spec, sizes_by_axes, mesh, func, hints),
        returns_destination=_mutates_first_argument(func),
    )


def _mutates_first_argument(func: OpOverload) -> bool:
    arguments = func._schema.arguments
    return (
        bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write
    )


def _common_mesh(func: OpOverload, leaves: list, kwargs: dict):
    mesh = None
    for arg in (*leaves, *kwargs.values()):
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


# ---------------------------------------------------------------------------- propagation
def _propagate(
    func: OpOverload,
    leaves: list,
    structure: tuple,
    kwargs: dict,
    sources: list[ShardTensorSpec | None],
    mesh,
) -> OutputSharding | None:
    schema_args = [s.dtensor_spec if s is not None else v for v, s in zip(leaves, sources)]
    schema_kwargs = {
        k: _spec_of(v, mesh).dtensor_spec if isinstance(v, torch.Tensor) else v
        for k, v in kwargs.items()
    }
    schema = OpSchema(
        func,
        tuple(unflatten_args(schema_args, structure)),
        schema_kwargs,
        schema_info=_schema_info(func, kwargs),
    )
    try:
        return _SHARDINGS.get_or_make(schema, lambda: _propagated(schema))
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


def _suggestion(
    func: OpOverload,
    sharding: OutputSharding,
    leaves: list,
    sources: list[ShardTensorSpec | None],
) -> tuple[OpOverload, list[DTensorSpec | None], list, list]:
    """The op to run, each operand's target DTensor spec, the (possibly rewritten)
    non-tensor values, and extra arguments a rewritten op takes."""
    suggested = sharding.redistribute_schema
    if not sharding.needs_redistribute or suggested is None:
        return func, [None] * len(leaves), leaves, []
    suggested_leaves, _ = flatten_args(tuple(suggested.args_schema))
    targets = [
        t if isinstance(t, DTensorSpec) and s is not None else None
        for t, s in zip(suggested_leaves, sources)
    ]
    if not sharding.use_val_from_redistribute_schema:
        return suggested.op, targets, leaves, []
    values = [v if s is not None else w for v, w, s in zip(leaves, suggested_leaves, sources)]
    return suggested.op, targets, values, list(suggested_leaves[len(leaves) :])


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


# ---------------------------------------------------------------------------- outputs
def _output_specs(
    output_spec: object,
    sizes_by_axes: dict[tuple[int, ...], DimSharding],
    mesh,
    func: OpOverload,
    hints: tuple[DimSharding, ...],
) -> object:
    if isinstance(output_spec, DTensorSpec):
        return _output_spec(output_spec, sizes_by_axes, mesh, func, hints)
    if isinstance(output_spec, (tuple, list)):
        return type(output_spec)(
            _output_specs(s, sizes_by_axes, mesh, func, hints) for s in output_spec
        )
    return None


def _output_spec(
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
    order = _order_of(dspec)
    sizes = {}
    for dim, axes in order.items():
        known = sizes_by_axes.get(axes)
        if known is None or known.extent != meta.shape[dim]:
            raise NotImplementedError(
                f"{func}: cannot tell the shard sizes of output dim {dim} (extent "
                f"{meta.shape[dim]}, placements {dspec.placements}) from its inputs (sharded "
                f"as { {axes: list(s.sizes) for axes, s in sizes_by_axes.items()} }); this "
                f"op needs a shardsci handler"
            )
        sizes[dim] = known.sizes
    return ShardTensorSpec.build(
        mesh,
        dspec.placements,
        meta.shape,
        meta.dtype,
        sizes,
        stride=meta.stride,
        order=order,
        hints=hints,
    )


def _local_shape_argument(
    op: OpOverload,
    output_spec: object,
    sizes_by_axes: dict[tuple[int, ...], DimSharding],
    func: OpOverload,
) -> tuple | None:
    """This rank's value for a global shape argument DTensor rewrote assuming chunk sizes."""
    index = _PROPAGATOR.op_to_shape_and_stride_idx.get(op)
    if index is None:
        if op in _PROPAGATOR.op_to_scalar_shape_adjuster and any(
            not s.is_even() for s in sizes_by_axes.values()
        ):
            raise NotImplementedError(f"{func} on unevenly sharded inputs needs a shardsci handler")
        return None
    if not isinstance(output_spec, DTensorSpec) or output_spec.tensor_meta is None:
        return None
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
    if isinstance(index, int):
        return (index, local_shape, None, None)
    return (index[0], local_shape, index[1], list(contiguous_stride(local_shape)))
