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

# NOTE [The nesting of a dim sharded over several axes is shardsci's, like its sizes]
A dim sharded over several mesh axes is nested in an order (``DimSharding.axes``, outermost
first; ``nn.MultiheadAttention`` flattens batch and tokens into rows nested over (1, 0)).
DTensor's rules do not carry that order: they build their outputs and input targets in the
default, increasing order, so an output read as DTensor gives it would describe the shards of
a transpose (``aten.t`` in ``mm``'s backward) in another order than the one its ranks hold,
and an input in another order than the default would be moved to it first. So DTensor is
shown every operand in the default order (``ShardTensorSpec.dtensor_spec``) and reasons about
placements only; shardsci keys alignment by the *set* of axes a dim is sharded over
(``_axes_key``): operands sharded over one set share the order and sizes of the largest
operand already sharded over it (else a hint's, else the default order and chunk sizes), and
an output dim sharded over that set takes them. A view, permute or product that moves such a
dim thus moves its order and sizes with it, and nothing is moved to reorder it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardsci.tensor._caches import BoundedCache, register_cache
from shardsci.tensor._gather_guard import gathers
from shardsci.tensor._held import Held, held_on, without_held
from shardsci.tensor._shape_probe import shape_probe
from shardsci.tensor._spec import (
    DimSharding,
    ShardTensorSpec,
    contiguous_stride,
    merged_hints,
    mesh_coordinate,
    nested_chunk_sizes,
    replicated_spec,
)
from shardsci.tensor._torch_compat import (
    DispatchKey,
    DTensorSpec,
    OpOverload,
    OpSchema,
    OutputSharding,
    RuntimeSchemaInfo,
    _dispatch_has_kernel_for_dispatch_key,
    _StridedShard,
    backport_sharding_rules,
    channel_split_grid_sampler_rules,
    decomposition_table,
    scalar_shape_adjusters,
)
from shardsci.tensor._torch_compat import dtensor_redistribute as _dtensor_redistribute
from shardsci.tensor._torch_compat import sharding_propagator as _PROPAGATOR
from shardsci.tensor._unmoved_strategy import install as install_unmoved_strategy

backport_sharding_rules()  # torch 2.11's gaps (none on 2.12 and 2.13)
channel_split_grid_sampler_rules()  # torch splits the grid samplers' batch only
# NOTE [An op whose operands need not move skips DTensor's full strategy expansion]
install_unmoved_strategy()

__all__ = ["Plan", "decomposition", "flatten_args", "functional_twin", "plan_for", "unflatten_args"]

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
    empty_outputs : bool
        Every output of this rank is an empty tensor: the local op is skipped (NOTE [No
        kernel sees an empty shard it cannot reduce]).
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
    empty_outputs: bool = False
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


def plan_for(
    func: OpOverload,
    leaves: list,
    structure: tuple,
    kwargs: dict,
    local_impl: Callable[..., object] | None = None,
) -> Plan:
    """The cached plan for ``func`` on these operands (see the NOTE above); ``local_impl`` is
    the kernel a handler runs on the shards instead of the op, if any."""
    try:
        key = (
            func,
            structure,
            tuple(_key(v) for v in leaves),
            tuple(sorted((k, _key(v)) for k, v in kwargs.items())),
        )
        hash(key)
    except TypeError:
        return _make_plan(func, leaves, structure, kwargs, local_impl)
    return _PLANS.get_or_make(key, lambda: _make_plan(func, leaves, structure, kwargs, local_impl))


def _make_plan(
    func: OpOverload,
    leaves: list,
    structure: tuple,
    kwargs: dict,
    local_impl: Callable[..., object] | None,
) -> Plan:
    mesh = _common_mesh(func, leaves, kwargs)
    sources = [_spec_of(v, mesh) for v in leaves]
    held = _held_pointwise(func, sources)
    try:
        plan = _plan_on(func, leaves, structure, kwargs, local_impl, mesh, sources)
    except NotImplementedError:
        if held is None:
            raise
        return _held_plan(func, leaves, structure, kwargs, local_impl, mesh, sources, held)
    if held is None or not any(t is not None and s.shardings for s, t in held.moved(plan)):
        return plan
    try:
        return _held_plan(func, leaves, structure, kwargs, local_impl, mesh, sources, held)
    except NotImplementedError:
        return plan


def _held_plan(
    func: OpOverload,
    leaves: list,
    structure: tuple,
    kwargs: dict,
    local_impl: Callable[..., object] | None,
    mesh,
    sources: list[ShardTensorSpec | None],
    held: _HeldOperands,
) -> Plan:
    """The plan of a pointwise op on held operands run on their holder, its pending operands
    reduced first where the rule would lay an operand out along a held axis to meet them (NOTE
    [A pointwise op on held operands runs on their holder])."""
    try:
        return _plan_on(func, leaves, structure, kwargs, local_impl, mesh, sources, held)
    except NotImplementedError:
        if not any(o is not None and o.partial for o in held.off):
            raise
    reduced = held.pending_reduced()
    return _plan_on(func, leaves, structure, kwargs, local_impl, mesh, sources, reduced)


def _plan_on(
    func: OpOverload,
    leaves: list,
    structure: tuple,
    kwargs: dict,
    local_impl: Callable[..., object] | None,
    mesh,
    sources: list[ShardTensorSpec | None],
    held: _HeldOperands | None = None,
) -> Plan:
    """The plan for ``func`` on operands laid out as ``sources``; with ``held``, DTensor's rule
    decides on the operands with their held axes taken off, and they are put back (NOTE [A
    pointwise op on held operands runs on their holder])."""
    seen = sources if held is None else list(held.off)
    try:
        sharding = _propagate(func, leaves, structure, kwargs, seen, mesh)
    except (NotImplementedError, RuntimeError):
        # An in-place op whose destination would have to change layout (DTensor refuses), or
        # with no rule of its own: its out-of-place twin runs and the result is copied back.
        if _mutates_first_argument(func) and functional_twin(func) is not None:
            return Plan("copy_back", func)
        raise
    if sharding is None:
        return Plan("decompose", func)
    op, suggested, values, extra_args = _suggestion(func, sharding, leaves, seen)
    targets = _aligned_targets(func, seen, suggested)
    reduced_first = _reduced_first(func, leaves, structure, kwargs, seen, targets, mesh)
    if reduced_first is not None:
        sharding, (op, suggested, values, extra_args), targets = reduced_first
    if _has_uneven_average(sharding.output_spec, seen):
        raise NotImplementedError(
            f"{func} averages over unevenly sharded dims (a mean of unequal shards is not the "
            f"average of their means); it needs a shardsci handler"
        )
    sizes_by_axes = _sizes_by_axes(targets)
    shape_argument = None
    if sharding.use_val_from_redistribute_schema or op in _PROPAGATOR.op_to_shape_and_stride_idx:
        shape_argument = _local_shape_argument(op, sharding.output_spec, sizes_by_axes, func)
    hints = merged_hints(*(s.hints + s.shardings for s in seen if s is not None))
    outputs = _output_specs(sharding.output_spec, sizes_by_axes, mesh, func, hints)
    if held is not None:
        targets, outputs = held.restored(targets), held.restored_outputs(outputs)
    if _mutates_first_argument(func) and not sources[0].same_layout(targets[0]):
        return Plan("copy_back", func)
    local_args = _LocalArgs(local_impl or op, op, structure, values, targets, extra_args, kwargs)
    problem = local_args.misfit(mesh, outputs, sharding.output_spec, sizes_by_axes, func)
    if problem is not None:
        if decomposition(func) is not None:
            return Plan("decompose", func)
        raise NotImplementedError(
            f"shardsci: {func} cannot run on the shards DTensor's rule lays out ({problem}); "
            f"it needs a shardsci handler"
        )
    return Plan(
        "run",
        op,
        tuple(sources),
        tuple(None if s is None or s.same_layout(t) else t for s, t in zip(sources, targets)),
        tuple(None if s is not None else v for v, s in zip(values, sources)),
        tuple(extra_args),
        shape_argument,
        outputs,
        returns_destination=_mutates_first_argument(func),
        empty_outputs=not (_mutates_first_argument(func) or func.is_view) and _all_empty(outputs),
    )


# NOTE [A pointwise op on held operands runs on their holder]
# A pointwise op whose operand one rank holds whole along some mesh axes (NOTE [A dim one rank
# holds is whole on that rank] in ``_held``) meets, typically, a statistic of it held by the
# same rank: ``x / x.sum(d, keepdim=True)`` with ``x`` held along ``d``, the sum of extent 1
# there (NOTE [A sum over a dim one rank holds stays with that rank] in ``_ops/_common``).
# DTensor's rule reads the statistic's dim of extent 1 as a broadcast dim it must replicate:
# the holder would send its statistic to every rank. Where the plan would move a held operand
# so, DTensor's rule is asked again with the held axes taken off every operand (the dims whole,
# as the holder sees them), and they are put back, outermost, on the output dim the held dims
# broadcast to and on every operand spanning that dim (a replicated one is narrowed there: no
# byte moves); an operand broadcast along it (extent 1, not held) stays replicated. The holder
# computes the op; the others compute it on empty shards (an in-place op too, its destination
# held where it was: ``masked_fill_`` in a norm's backward). An operand held on another dim
# (a statistic reduced without ``keepdim``, then unsqueezed) is moved onto that one: its
# holder keeps its cells, no byte moves (the dim is the largest operand's that spans its
# output dim). Taken only where every operand sharded along a held
# axis is held along it by the same rank, and no operand is pending along it. An operand
# pending over another axis (``x - x.var(...)``'s statistics in ``VarBackward0``, pending
# over the axis of a dim split there) may lead the rule to slice an operand along a held
# axis to meet it; the pending sums are then reduced first (``Partial -> Replicate``, an
# all-reduce of a statistic, no gather) and the rule asked again.
@dataclass(frozen=True)
class _HeldOperands:
    """Operands of a pointwise op with their held axes taken off (``off``), and how to put them
    back: held axes -> (their holder, the output dim they hold) over ``shape``, the output's."""

    sources: tuple[ShardTensorSpec | None, ...]
    off: tuple[ShardTensorSpec | None, ...]
    held: tuple[tuple[tuple[int, ...], int, int], ...]
    shape: tuple[int, ...]

    def moved(self, plan: Plan) -> list[tuple[ShardTensorSpec, ShardTensorSpec | None]]:
        """The held operands and where ``plan`` moves them (None: nowhere)."""
        if plan.action != "run":
            return []
        return [
            (s, t)
            for s, o, t in zip(self.sources, self.off, plan.targets)
            if s is not None and o is not s
        ]

    def pending_reduced(self) -> _HeldOperands:
        """These operands with every pending sum reduced (``Partial -> Replicate``)."""
        off = tuple(
            None
            if o is None
            else o.relaid(
                [Replicate() if isinstance(p, Partial) else p for p in o.placements],
                {s.dim: s.sizes for s in o.shardings},
                order={s.dim: s.axes for s in o.shardings},
            )
            for o in self.off
        )
        return replace(self, off=off)

    def _back(self, spec: ShardTensorSpec, source: ShardTensorSpec | None) -> ShardTensorSpec:
        axes = [a for group, _, _ in self.held for a in group]
        if any(not isinstance(spec.placements[a], Replicate) for a in axes):
            raise NotImplementedError("the rule lays out an operand along a held axis")
        kept = []
        for axes, holder, e in self.held:
            d = e - (len(self.shape) - spec.ndim)
            if d < 0:
                continue
            was_held = source is not None and all(
                isinstance(source.placements[a], Shard) for a in axes
            )
            if spec.shape[d] == self.shape[e] or was_held:
                kept.append(Held(d, axes, holder))
        return held_on(spec, kept) if kept else spec

    def restored(self, targets: list[ShardTensorSpec | None]) -> list[ShardTensorSpec | None]:
        return [t if t is None else self._back(t, s) for t, s in zip(targets, self.sources)]

    def restored_outputs(self, outputs: object) -> object:
        if isinstance(outputs, ShardTensorSpec):
            return self._back(outputs, None)
        if isinstance(outputs, (tuple, list)):
            return type(outputs)(self.restored_outputs(o) for o in outputs)
        return outputs


def _held_pointwise(
    func: OpOverload, sources: list[ShardTensorSpec | None]
) -> _HeldOperands | None:
    """The operands of a pointwise ``func`` with their held axes taken off, if they have any and
    agree on them (NOTE [A pointwise op on held operands runs on their holder]); else None.
    An in-place op is pointwise where its out-of-place twin is."""
    twin = functional_twin(func) if _mutates_first_argument(func) else func
    if twin is None or torch.Tag.pointwise not in twin.tags:
        return None
    specs = [s for s in sources if s is not None]
    if not any(without_held(s)[1] for s in specs):
        return None
    try:
        shape = tuple(torch.broadcast_shapes(*(s.shape for s in specs)))
    except RuntimeError:
        return None
    # held axes -> (holder, output dim, rank of the operand that chose it: spanning that dim
    # of the output, then largest)
    found: dict[tuple[int, ...], tuple[int, int, tuple[bool, int]]] = {}
    off: list[ShardTensorSpec | None] = []
    for s in sources:
        if s is None:
            off.append(None)
            continue
        spec, held = without_held(s)
        for h in held:
            e = h.dim + len(shape) - s.ndim
            rank = (shape[e] == s.shape[h.dim], math.prod(s.shape))
            holder, _, best = found.setdefault(h.axes, (h.holder, e, rank))
            if holder != h.holder:
                return None
            if rank > best:
                found[h.axes] = (holder, e, rank)
        off.append(spec)
    axes = [a for group in found for a in group]
    if len(set(axes)) != len(axes) or any(
        not isinstance(o.placements[a], Replicate) for o in off if o is not None for a in axes
    ):
        return None
    held = tuple((group, holder, e) for group, (holder, e, _) in found.items())
    return _HeldOperands(tuple(sources), tuple(off), held, shape)


# NOTE [A pending sum is reduced rather than an operand gathered]
# DTensor's rules may meet an operand with a pending reduction (Partial: ``x.sum(2,
# keepdim=True)`` over a sharded dim) by gathering the other, sharded, operand: ``mul`` is
# linear in each, so ``Replicate * Partial`` is a valid ``Partial`` result, and ``x - x.mean(2,
# keepdim=True)`` gathers ``x`` the same way. Every rank would then hold the whole field, and the
# output would be a whole-shaped pending sum. So when a plan gathers a sharded operand (NOTE
# [Gathers an op was not asked to make] in ``_gather_guard``) while another operand is Partial,
# the rule is asked again with the pending reductions done first (an all-reduce of a tensor
# every rank holds whole-shaped already), and that plan is taken when it gathers nothing: the
# output keeps the sharded operand's layout. In-place ops keep their destination's rule.
# A pointwise op that must reduce a pending operand (``clamp_min`` of a norm, pending over
# the axis that sharded the normed dim) is asked again too when the rule reduce-scatters it
# onto a dim along a mesh axis that shards no other operand: DTensor prices that below an
# all-reduce, but the output would then be split along a dim (the batch) that no input was,
# and the next op meeting the input's layout moves it back. The pending operand is reduced
# to the layout its output takes: replicated over that axis, or the other operand's shards.
# And a pointwise op that broadcasts the operands pending over an axis and keeps them pending
# (``Replicate * Partial``: in softmax's double backward, ``(output * grad_output).sum(0,
# True)``, of shape (1, 5, 4), times a replicated (6, 5, 4) gradient) is asked again too: its
# output would be a pending sum larger than they are (held whole along the broadcast dim),
# reduced later at the cost of its size, where an all-reduce of the operands now costs theirs,
# and the output, replicated over that axis, takes no more memory than the pending one.
def _reduced_first(
    func: OpOverload,
    leaves: list,
    structure: tuple,
    kwargs: dict,
    sources: list[ShardTensorSpec | None],
    targets: list[ShardTensorSpec | None],
    mesh,
) -> tuple[OutputSharding, tuple, list[ShardTensorSpec | None]] | None:
    """The propagation, suggestion and targets of the plan with Partial operands reduced
    first, when the plan given gathers an operand and that one gathers none; else None."""
    if _mutates_first_argument(func) or not any(s is not None and s.partial for s in sources):
        return None
    if not any(s is not None and gathers(s, t) for s, t in zip(sources, targets)) and not (
        torch.Tag.pointwise in func.tags
        and (_scatters_pending_astray(sources, targets) or _broadcasts_pending(sources, targets))
    ):
        return None
    reduced = [s if s is None or not s.partial else _reduced(s) for s in sources]
    try:
        sharding = _propagate(func, leaves, structure, kwargs, reduced, mesh)
    except (NotImplementedError, RuntimeError, ValueError, IndexError, TypeError):
        return None
    if sharding is None:
        return None
    suggestion = _suggestion(func, sharding, leaves, reduced)
    reduced_targets = _aligned_targets(func, reduced, suggestion[1])
    if any(s is not None and gathers(s, t) for s, t in zip(sources, reduced_targets)):
        return None
    return sharding, suggestion, reduced_targets


def _scatters_pending_astray(
    sources: list[ShardTensorSpec | None], targets: list[ShardTensorSpec | None]
) -> bool:
    """Whether a target reduce-scatters an operand's pending axis onto a dim while no operand
    not pending over that axis is sharded over it (the output's split would come from none)."""
    for source, target in zip(sources, targets):
        if source is None or target is None:
            continue
        for axis, (p, q) in enumerate(zip(source.placements, target.placements)):
            if (
                isinstance(p, Partial)
                and isinstance(q, Shard)
                and not any(
                    s is not None and isinstance(s.placements[axis], Shard) for s in sources
                )
            ):
                return True
    return False


def _broadcasts_pending(
    sources: list[ShardTensorSpec | None], targets: list[ShardTensorSpec | None]
) -> bool:
    """Whether the op keeps operands pending over an axis (their targets too) while it
    broadcasts them all to more cells than the largest has (a larger pending sum)."""
    specs = [s for s in sources if s is not None]
    try:
        cells = math.prod(torch.broadcast_shapes(*(s.shape for s in specs)))
    except RuntimeError:
        return False
    largest: dict[int, int] = {}  # axis -> the most cells an operand pending over it has
    for source, target in zip(sources, targets):
        if source is None:
            continue
        kept = (target or source).placements
        for axis, (p, q) in enumerate(zip(source.placements, kept)):
            if isinstance(p, Partial) and isinstance(q, Partial):
                largest[axis] = max(largest.get(axis, 0), math.prod(source.shape))
    return any(n < cells for n in largest.values())


def _reduced(spec: ShardTensorSpec) -> ShardTensorSpec:
    """``spec`` with its pending reductions done: Partial axes replicated, shards kept."""
    return spec.relaid(
        [Replicate() if isinstance(p, Partial) else p for p in spec.placements],
        {s.dim: s.sizes for s in spec.shardings},
        order={s.dim: s.axes for s in spec.shardings},
    )


# NOTE [Every rank's kernel call is checked on meta tensors first]
# A rule can place operands so that one rank's shards do not fit together (an empty shard
# beside a full one, nested shardings in another order), and a CPU kernel given shards that
# do not fit may raise on that rank only, or kill its process (SIGFPE in batch norm's
# backward). When a plan is made, the op therefore runs on meta tensors with the local shapes
# of every rank of the mesh (all computable from the global specs, so every rank reaches the
# same verdict), and its outputs must have the planned local shapes. A plan that fails runs
# the op's decomposition instead, or raises the same clear error on every rank.
@dataclass(frozen=True)
class _LocalArgs:
    """What the local op of a plan is called with, for any rank."""

    kernel: Callable[..., object]
    op: OpOverload
    structure: tuple
    values: list
    targets: list
    extra_args: list
    kwargs: dict

    def misfit(self, mesh, outputs, output_spec, sizes_by_axes, func) -> str | None:
        """Why the op cannot run on some rank's shards, or None (also when meta tensors
        cannot tell: an op without a meta kernel)."""
        tried = set()
        for coordinate in itertools.product(*(range(n) for n in mesh.shape)):
            shapes = tuple(
                None if t is None else tuple(t.local_shape(coordinate)) for t in self.targets
            )
            shape_argument = None
            if self.op in _PROPAGATOR.op_to_shape_and_stride_idx:
                shape_argument = _local_shape_argument(
                    self.op, output_spec, sizes_by_axes, func, coordinate
                )
            key = (shapes, repr(shape_argument))
            if key in tried:
                continue
            tried.add(key)
            try:
                with shape_probe():
                    out = self._run_on_meta(shapes, shape_argument)
            except NotImplementedError:  # no meta kernel: cannot tell
                return None
            except Exception as exc:
                return f"on the rank at {coordinate}, {type(exc).__name__}: {exc}"
            expected = _local_shapes(outputs, coordinate)
            if expected is not None and _shapes_of(out) != expected:
                return (
                    f"the rank at {coordinate} would produce shards {_shapes_of(out)}, "
                    f"its outputs' specs say {expected}"
                )
        return None

    def _run_on_meta(self, shapes: tuple, shape_argument: tuple | None) -> object:
        leaves = [
            value if shape is None else torch.empty(shape, dtype=target.dtype, device="meta")
            for value, shape, target in zip(self.values, shapes, self.targets)
        ]
        args = unflatten_args(leaves, self.structure)
        args.extend(self.extra_args)
        if shape_argument is not None:
            index, shape, stride_index, stride = shape_argument
            args[index] = shape
            if stride_index is not None:
                args[stride_index] = stride
        kwargs = {
            k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in self.kwargs.items()
        }
        return self.kernel(*args, **kwargs)


def _local_shapes(specs: object, coordinate: tuple[int, ...]) -> object:
    if isinstance(specs, ShardTensorSpec):
        return tuple(specs.local_shape(coordinate))
    if isinstance(specs, (tuple, list)):
        shapes = tuple(_local_shapes(s, coordinate) for s in specs)
        return None if any(s is None for s in shapes) else shapes
    return None


def _shapes_of(out: object) -> object:
    if isinstance(out, torch.Tensor):
        return tuple(out.shape)
    if isinstance(out, (tuple, list)):
        return tuple(_shapes_of(o) for o in out)
    return None


# NOTE [No kernel sees an empty shard it cannot reduce]
# A rank whose shard is empty must not call a kernel that rejects empty input (aminmax over
# an empty dim raises, a CPU attention kernel dies of SIGFPE): the other ranks would wait for
# it in their next collective. Where every output of the rank is empty, the plan skips the
# kernel and returns empty tensors of the planned shapes; not for views, which must stay views
# of their base's storage (a fresh tensor per call would miss every cache keyed by storage,
# such as the gather plans of an empty rank's edges, on that rank alone: a collective the
# others never join) and which no kernel rejects. Where an empty shard still has
# outputs (reductions over the sharded dim), the op's handler supplies the identity of the
# reduction instead (``_reduction_ops``).
def _all_empty(outputs: object) -> bool:
    if isinstance(outputs, ShardTensorSpec):
        return math.prod(outputs.local_shape()) == 0
    if isinstance(outputs, (tuple, list)) and outputs:
        return all(_all_empty(o) for o in outputs)
    return False


def functional_twin(func: OpOverload) -> OpOverload | None:
    """The out-of-place op of an in-place one (``add_.Tensor`` -> ``add.Tensor``)."""
    name = func.overloadpacket.__name__.rstrip("_")
    return getattr(getattr(torch.ops.aten, name, None), func._overloadname, None)


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
    if not _has_rule(func):
        if decomposition(func) is not None:
            return None
        raise _no_rule(func)
    schema_args = [s.dtensor_spec if s is not None else v for v, s in zip(leaves, sources)]
    schema_kwargs = {
        k: _spec_of(v, mesh).dtensor_spec if isinstance(v, torch.Tensor) else v
        for k, v in kwargs.items()
    }
    schema = OpSchema(
        func,
        tuple(unflatten_args(schema_args, structure)),
        schema_kwargs,
        schema_info=_schema_info(func),
    )
    try:
        return _SHARDINGS.get_or_make(schema, lambda: _propagated(schema))
    except NotImplementedError:
        if decomposition(func) is not None:
            return None
        raise _no_rule(func) from None
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:
        # DTensor's rules raise for inputs they cannot place, without naming the op.
        raise type(exc)(f"{func}: {exc}") from exc


def _schema_info(func: OpOverload) -> RuntimeSchemaInfo:
    """Which arguments key DTensor's propagation cache. Without this, non-tensor arguments
    (flip's dims, a reduction's keepdim) are left out of the key and a cached result for
    other values is reused. Every keyword-only argument of the op keys it too, named by the
    schema rather than by the call: DTensor's key holds the values only, so ``right=True``
    and ``out_int32=True`` would share an entry (and ``bucketize`` an output dtype)."""
    keywords = [a.name for a in func._schema.arguments if a.kwarg_only]
    info = _PROPAGATOR.op_to_schema_info.get(
        func
    ) or _PROPAGATOR.op_to_schema_info_for_single_dim_strategy.get(func)
    if info is None:
        return RuntimeSchemaInfo(static_argnum=0, static_kwargkey=keywords or None)
    if set(keywords) <= set(info.static_kwargkey or ()):
        return info
    keys = sorted(set(keywords) | set(info.static_kwargkey or ()))
    return RuntimeSchemaInfo(info.static_argnum, keys, info.needs_pytree)


# NOTE [An op without a sharding rule runs its decomposition]
# For an op it has no rule for, DTensor traces the op's decomposition on meta tensors once per
# combination of input placements (``DecompShardingStrategy``) to derive one: for
# ``native_batch_norm_backward``, 11,664 combinations and minutes of CPU on the first call.
# shardsci asks DTensor only about ops it has a rule for, and runs the decomposition of any
# other op on the ShardTensors themselves: each op inside plans (and caches its plan) on its
# own, in milliseconds, and those with shardsci handlers (means over uneven shards) use them.
def _has_rule(func: OpOverload) -> bool:
    return (
        func in _PROPAGATOR.op_strategy_funcs
        or func in _PROPAGATOR.op_single_dim_strategy_funcs
        or func in _PROPAGATOR.op_to_rules
    )


def decomposition(func: OpOverload) -> Callable[..., object] | None:
    """The function that computes ``func`` from other aten ops: its CompositeImplicitAutograd
    kernel or its decomposition in ``torch._decomp.decompositions``; None when it has neither.
    (The table's ``torch._refs`` entries compute through prims, meant for tracing: run on
    ShardTensors they can return uninitialised memory.)"""
    if _dispatch_has_kernel_for_dispatch_key(func.name(), DispatchKey.CompositeImplicitAutograd):
        return func.decompose
    decompose = decomposition_table.get(func)
    if decompose is not None and decompose.__module__ == "torch._decomp.decompositions":
        return decompose
    return None


def _no_rule(func: OpOverload) -> NotImplementedError:
    return NotImplementedError(
        f"shardsci: {func} has no sharding rule; register a handler with "
        f"shardsci.register_aten_handler({func})"
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
    func: OpOverload, specs: list[ShardTensorSpec | None], targets: list[DTensorSpec | None]
) -> list[ShardTensorSpec | None]:
    """Our target spec for each operand: DTensor's placements, sizes aligned across operands."""
    reference = _reference_sizes(func, specs, targets)
    result: list[ShardTensorSpec | None] = []
    for spec, target in zip(specs, targets):
        if spec is None:
            result.append(None)
            continue
        if target is None or target.placements == spec.placements:
            if all(
                reference.get(_axes_key(s.axes), _nesting(s)) == _nesting(s) for s in spec.shardings
            ):
                result.append(spec)
                continue
            target = spec.dtensor_spec
        result.append(_spec_for(spec, target, reference))
    return result


def _axes_key(axes: tuple[int, ...]) -> tuple[int, ...]:
    """The set of mesh axes a dim is sharded over, in increasing order: how DTensor names it,
    and what alignment is keyed by (NOTE [The nesting of a dim sharded over several axes is
    shardsci's, like its sizes])."""
    return tuple(sorted(axes))


def _nesting(sharding: DimSharding) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A sharded dim's mesh axes, outermost first, and its shard sizes."""
    return sharding.axes, sharding.sizes


def _sharded_dims(target: DTensorSpec) -> dict[int, tuple[int, ...]]:
    """Tensor dim -> the set of mesh axes sharding it (``_axes_key``) in a DTensor spec."""
    return {e.tensor_dim: _axes_key(e.mesh_dims) for e in target.shard_order}


def _reference_sizes(
    func: OpOverload, specs: list[ShardTensorSpec | None], targets: list[DTensorSpec | None]
) -> dict[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]]]:
    """Set of mesh axes (``_axes_key``) -> the nesting (``_nesting``) all operands
    sharded over those axes will share.

    The largest operand already sharded that way decides; otherwise the remembered order and
    sizes of any operand (hints); otherwise the default order and ``torch.chunk`` sizes.
    """
    best: dict[tuple[int, ...], tuple[int, tuple]] = {}
    wanted: dict[tuple[int, ...], int] = {}
    for spec, target in zip(specs, targets):
        if spec is None:
            continue
        if target is not None:
            dims = _sharded_dims(target)
        else:
            dims = {s.dim: _axes_key(s.axes) for s in spec.shardings}
        for dim, key in dims.items():
            extent = spec.shape[dim]
            if wanted.setdefault(key, extent) != extent:
                raise NotImplementedError(
                    f"{func}: operands sharded over mesh axes {key} have different extents "
                    f"({wanted[key]} and {extent}) along their sharded dims"
                )
            current = spec.sharding_by_dim.get(dim)
            if current is not None and _axes_key(current.axes) == key:
                numel = math.prod(spec.shape)
                if key not in best or numel > best[key][0]:
                    best[key] = (numel, _nesting(current))
    reference = {key: nesting for key, (_, nesting) in best.items()}
    for key, extent in wanted.items():
        if key not in reference:
            mesh_shape = next(s.mesh_shape for s in specs if s is not None)
            reference[key] = _remembered(specs, key, extent) or (
                key,
                nested_chunk_sizes(extent, [mesh_shape[a] for a in key]),
            )
    return reference


def _remembered(
    specs: list[ShardTensorSpec | None], key: tuple[int, ...], extent: int
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    for spec in specs:
        if spec is not None:
            for hint in reversed(spec.hints):  # newest first, as every hint reader
                if _axes_key(hint.axes) == key and hint.extent == extent:
                    return _nesting(hint)
    return None


def _spec_for(
    spec: ShardTensorSpec, target: DTensorSpec, reference: dict[tuple[int, ...], tuple]
) -> ShardTensorSpec:
    placements = tuple(
        p if not isinstance(p, _StridedShard) else Shard(p.dim) for p in target.placements
    )
    dims = _sharded_dims(target)
    return spec.relaid(
        placements,
        {dim: reference[key][1] for dim, key in dims.items()},
        order={dim: reference[key][0] for dim, key in dims.items()},
        hints=merged_hints(spec.hints, spec.shardings),
    )


def _sizes_by_axes(
    target_specs: list[ShardTensorSpec | None],
) -> dict[tuple[int, ...], DimSharding]:
    """Set of mesh axes (``_axes_key``) -> the order and sizes the aligned operands sharded
    over them share."""
    found: dict[tuple[int, ...], DimSharding] = {}
    for spec in target_specs:
        if spec is not None:
            for s in spec.shardings:
                found.setdefault(_axes_key(s.axes), s)
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
    order = {}
    sizes = {}
    for dim, axes in _sharded_dims(dspec).items():
        known = sizes_by_axes.get(axes)
        if meta.shape[dim] == 0:  # e.g. batch norm's statistics when it does not train
            order[dim] = axes if known is None else known.axes
            sizes[dim] = (0,) * math.prod(mesh.shape[a] for a in axes)
            continue
        if known is None or known.extent != meta.shape[dim]:
            raise NotImplementedError(
                f"{func}: cannot tell the shard sizes of output dim {dim} (extent "
                f"{meta.shape[dim]}, placements {dspec.placements}) from its inputs (sharded "
                f"as { {axes: list(s.sizes) for axes, s in sizes_by_axes.items()} }); this "
                f"op needs a shardsci handler"
            )
        order[dim], sizes[dim] = known.axes, known.sizes
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
    coordinate: tuple[int, ...] | None = None,
) -> tuple | None:
    """This rank's (or the rank at ``coordinate``'s) value for a global shape argument DTensor
    rewrote assuming chunk sizes."""
    index = _PROPAGATOR.op_to_shape_and_stride_idx.get(op)
    if index is None:
        if op in scalar_shape_adjusters() and any(not s.is_even() for s in sizes_by_axes.values()):
            raise NotImplementedError(f"{func} on unevenly sharded inputs needs a shardsci handler")
        return None
    if not isinstance(output_spec, DTensorSpec) or output_spec.tensor_meta is None:
        return None
    global_shape = list(output_spec.tensor_meta.shape)
    local_shape = list(global_shape)
    if coordinate is None:
        coordinate = mesh_coordinate(output_spec.mesh)
    mesh_shape = tuple(output_spec.mesh.shape)
    for dim, axes in _sharded_dims(output_spec).items():
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
