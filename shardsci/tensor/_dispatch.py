"""``__torch_dispatch__`` for ShardTensor: handlers, a fast path, and planned propagation.

Order of business for an aten op:
1. the dim argument of reductions is made explicit (NOTE [An empty dim list reduces every
   dim]);
2. a registered aten handler (see ``_registry``), unless it declines;
3. the fast path: a pointwise op whose operands share one layout with no Partial axis, or
   broadcast into it along dims no mesh axis splits (NOTE [Operands that broadcast into the
   layout]), runs on the local shards and keeps that layout, with no sharding propagation;
4. the default path: a cached plan (NOTE [The default path: DTensor decides placements,
   shardsci decides sizes] in ``_propagation``) moves the operands, runs the op on the
   local shards and wraps the results.
Around 2 to 4 the op is on the stack of ops being dispatched, which tells a redistribution
that an op, not the user, asks for it (NOTE [Gathers an op was not asked to make]). Which of
2 to 4 an op took is counted on request (NOTE [Dispatch paths]).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import Replicate, Shard

from shardsci.tensor import _propagation
from shardsci.tensor._caches import cached, register_cache
from shardsci.tensor._copies import (
    after_write,
    before_write,
    mark_moved,
    mark_view,
    returns_view,
)
from shardsci.tensor._gather_guard import asked_for, check_result, dispatching, gathers
from shardsci.tensor._propagation import (
    Plan,
    decomposition,
    flatten_args,
    functional_twin,
    plan_for,
    unflatten_args,
)
from shardsci.tensor._redistribute import redistribute_local, target_spec
from shardsci.tensor._registry import AtenHandler, aten_handler_for, on_registration
from shardsci.tensor._spec import DimSharding, ShardTensorSpec, replicated_spec
from shardsci.tensor._torch_compat import (
    OpOverload,
    _meta_in_tls_dispatch_include,
    _set_meta_in_tls_dispatch_include,
    no_dispatch,
)

__all__ = ["PathTally", "bind_tensor_type", "dispatch", "run_with_propagation", "tally_paths"]

aten = torch.ops.aten
_ShardTensor: type = torch.Tensor  # bound to ShardTensor by bind_tensor_type


def bind_tensor_type(cls: type) -> None:
    """Called once by ``_api`` (which imports this module) to break the import cycle."""
    global _ShardTensor
    _ShardTensor = cls
    _propagation.bind_tensor_type(cls)


class _Route(NamedTuple):
    """What dispatch needs to know about one aten overload, worked out once: one lookup per
    op (an overload hashes in Python)."""

    func: OpOverload  # the op to run: a lazy view's materialising twin, else the overload
    handler: AtenHandler | None
    fast: bool
    mutates: bool
    dim_argument: int | None
    in_place_view: bool
    view: str | None  # torch's op returns a view: "view", or "copy" where it runs as a copy


_ROUTES: dict[OpOverload, _Route] = {}
on_registration(_ROUTES.clear)
# Keyed by aten overloads, a finite set, so unbounded; registered to be cleared with the rest.
register_cache("dispatch routes", _ROUTES.__len__, _ROUTES.clear)


def _route(func: OpOverload) -> _Route:
    runs = _MATERIALIZED_VIEWS.get(func, func)
    route = _Route(
        runs,
        aten_handler_for(runs),
        _is_fast_pointwise(runs),
        _mutates_first_argument(runs),
        _DIM_ARGUMENT.get(runs),
        runs in _IN_PLACE_VIEWS,
        ("view" if runs is func else "copy") if returns_view(func) else None,
    )
    _ROUTES[func] = route
    return route


def dispatch(cls: type, func: OpOverload, types: Any, args: tuple = (), kwargs: dict | None = None):
    route = _ROUTES.get(func) or _route(func)
    func = route.func
    if kwargs is None:
        kwargs = {}
    if route.in_place_view:
        return _in_place_view(func, args, kwargs)
    if route.dim_argument is not None:
        args, kwargs = _explicit_reduction_dims(func, args, kwargs)
    tallies = _TALLIES
    start = time.perf_counter() if tallies else 0.0
    for tally in tallies:
        tally.enter()
    path = "raised"
    ops = dispatching()  # NOTE [Gathers an op was not asked to make]
    ops.append(func)
    try:
        # NOTE [A write into a view that is a copy] in _copies.py
        copy = route.mutates and type(args[0]) is _ShardTensor and args[0]._copy_of is not None
        if copy:
            before_write(func, args[0])
        path, result = _dispatched(func, route, args, kwargs)
        if copy:
            after_write(args[0])
        elif route.view is not None and type(args[0]) is _ShardTensor:
            mark_view(func, args[0], result, "copy" if route.view == "copy" else path)
        check_result(args, result)
        return result
    finally:
        ops.pop()
        for tally in tallies:
            tally.leave(path, start)


def _dispatched(func: OpOverload, route: _Route, args: tuple, kwargs: dict) -> tuple[str, Any]:
    """The path taken (NOTE [Dispatch paths]) and the op's result."""
    if route.handler is not None:
        result = route.handler(func, args, kwargs)
        if result is not NotImplemented:
            return "handler", result
    if route.fast:
        result = _pointwise_fast_path(func, args, kwargs, route.mutates)
        if result is not NotImplemented:
            return "fast", result
    return "propagation", run_with_propagation(func, args, kwargs)


# NOTE [Dispatch paths]
# Every aten op on a ShardTensor takes one of three paths: ``handler`` (a registered aten
# handler accepted it), ``fast`` (the pointwise fast path: operands of one layout, or
# broadcast into it, run on the local shards with no propagation), or ``propagation`` (the
# cached plan of ``_propagation``, which may run the op's decomposition, each inner op
# dispatched on its own). ``tally_paths`` counts them, for ``benchmarks.host_overhead``: every
# op by path, and the host time of the outermost ones (an op a handler runs is inside its
# caller's time); and for ``planning._work.WorkCounter``, which counts a step's ops by path
# (what an op costs the host depends on it: NOTE [Host time by dispatch path] in
# ``benchmarks/calibrate_dispatch.py``). Tallies nest: each open one counts every op in it.
# Off (one global read per op) unless a tally is open.
@dataclass
class PathTally:
    """Ops dispatched per path while a :func:`tally_paths` block is open.

    Attributes
    ----------
    ops : Counter
        Path -> every op that took it, nested ones included.
    outermost : Counter
        Path -> ops not dispatched from inside another op's dispatch.
    seconds : Counter
        Path -> wall time of the outermost ops, seconds.
    """

    ops: Counter = field(default_factory=Counter)
    outermost: Counter = field(default_factory=Counter)
    seconds: Counter = field(default_factory=Counter)
    _depth: int = 0

    def enter(self) -> None:
        self._depth += 1

    def leave(self, path: str, start: float) -> None:
        self._depth -= 1
        self.ops[path] += 1
        if self._depth == 0:
            self.outermost[path] += 1
            self.seconds[path] += time.perf_counter() - start


_TALLIES: tuple[PathTally, ...] = ()


@contextmanager
def tally_paths() -> Iterator[PathTally]:
    """Count the dispatch path of every aten op on a ShardTensor in the block (NOTE
    [Dispatch paths]); blocks nest, each counting every op in it."""
    global _TALLIES
    tally = PathTally()
    _TALLIES = (*_TALLIES, tally)
    try:
        yield tally
    finally:
        _TALLIES = tuple(t for t in _TALLIES if t is not tally)


# NOTE [Shards never carry a conjugate or negative bit]
# ``x.conj()`` of a complex tensor is a lazy view: a bit on the tensor says "read me
# conjugated". A ShardTensor's wrapper cannot carry the bit for its shard (ops on the wrapper
# would then conjugate once more, and redistribution reads raw bytes), so the lazy views
# are materialised on the shard: ``conj`` of a ShardTensor is ``conj_physical``, a copy.
_MATERIALIZED_VIEWS = {
    aten._conj.default: aten.conj_physical.default,
    aten._neg_view.default: aten.neg.default,
}


# NOTE [In-place ops that change a ShardTensor's shape]
# ``x.squeeze_(0)`` (which ``torch.matmul`` of a vector uses) changes the shape of ``x``
# itself. Running it on the shard would leave the wrapper's shape and spec as they were, so
# the out-of-place twin computes the new shard and spec, which replace ``x``'s, and the
# op then runs on the wrapper's metadata alone (as a meta op, touching no data).
_IN_PLACE_VIEWS = {
    aten.squeeze_.default: aten.squeeze.default,
    aten.squeeze_.dim: aten.squeeze.dim,
    aten.squeeze_.dims: aten.squeeze.dims,
    aten.unsqueeze_.default: aten.unsqueeze.default,
    aten.transpose_.default: aten.transpose.int,
    aten.t_.default: aten.t.default,
    aten.as_strided_.default: aten.as_strided.default,
}


def _in_place_view(func: OpOverload, args: tuple, kwargs: dict):
    x = args[0]
    result = _IN_PLACE_VIEWS[func](*args, **kwargs)
    x._local, x._spec = result._local, result._spec
    with no_dispatch():
        meta_in_tls = _meta_in_tls_dispatch_include()
        _set_meta_in_tls_dispatch_include(True)
        try:
            func(*args, **kwargs)
        finally:
            _set_meta_in_tls_dispatch_include(meta_in_tls)
    return x


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
    aten._to_copy.default,
    aten.detach.default,
    aten.alias.default,
    aten.clone.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
    aten.zero_.default,
    aten.fill_.Scalar,
    aten.fill_.Tensor,
}


# Ops whose result ignores the input's values. On a tensor with a pending reduction (Partial)
# they make a replicated tensor: DTensor keeps ``empty_like`` Partial, so ATen's ``1 - x``
# (``empty_like(x).fill_(1).sub_(x)``) would count the 1 once per rank.
_VALUE_FREE = {
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
    aten.zero_.default,
    aten.fill_.Scalar,
    aten.fill_.Tensor,
}


def _is_fast_pointwise(func: OpOverload) -> bool:
    """Layout-preserving ops, and pointwise ops that return tensors (``aten.equal``, tagged
    pointwise, returns one bool for the whole tensor)."""
    schema = func._schema
    returns_tensors = bool(schema.returns) and all(
        isinstance(r.type, torch.TensorType) for r in schema.returns
    )
    return func in _LAYOUT_PRESERVING or (
        torch.Tag.pointwise in func.tags
        and returns_tensors
        and not any(a.is_out for a in schema.arguments)
    )


def _pointwise_fast_path(func: OpOverload, args: tuple, kwargs: dict, mutates: bool):
    """Pointwise ops on operands that share one layout (no Partial axis), operands that
    broadcast into it (NOTE [Operands that broadcast into the layout]) and scalars: run on
    the local shards, keep the layout. A 0-d ShardTensor operand (``y * y.mean()``) broadcasts
    like any other: one with a pending reduction is reduced (an all-reduce of one element)
    rather than the large operand moved. Anything else returns NotImplemented."""
    spec = _reference_layout(args)
    if spec is None:
        return NotImplemented
    if spec.partial and func not in _VALUE_FREE:
        return _scaled_pending_sum(func, args, kwargs, spec, mutates)
    local_args = []
    memory = []  # other operands' hints (NOTE [Shard-size hints])
    for position, arg in enumerate(args):
        if type(arg) is _ShardTensor:
            arg_spec = arg._spec
            if arg_spec is spec or arg_spec.same_layout(spec):
                local_args.append(arg._local)
                if arg_spec.hints != spec.hints:
                    memory.append(arg_spec.hints)
            elif (position or not mutates) and (cuts := _fits(arg, spec)) is not None:
                local_args.append(_cut(arg._local, arg_spec, cuts))
                if arg_spec.hints:
                    memory.append(arg_spec.hints)
            elif (position or not mutates) and _moves_into(arg, spec):
                # NOTE [Operands of one shape laid out differently]
                local_args.append(
                    redistribute_local(arg._local, arg_spec, spec.with_dtype(arg.dtype))
                )
            elif (
                (position or not mutates)
                and arg_spec.partial
                and _broadcasts_into(reduced := _reduced(arg_spec), spec)
            ):
                local_args.append(redistribute_local(arg._local, arg_spec, reduced))
            else:
                return NotImplemented
        elif isinstance(arg, torch.Tensor) and arg.ndim != 0:
            cuts = _fitted(arg.shape, spec, cut=not arg.requires_grad)
            if (position or not mutates) and cuts is not None:
                local_args.append(
                    _cut(arg, replicated_spec(arg, spec.mesh) if cuts else None, cuts)
                )
            else:
                return NotImplemented
        else:
            local_args.append(arg)
    if kwargs:
        if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
            return NotImplemented
        if kwargs.get("memory_format") not in (None, torch.preserve_format):
            return NotImplemented  # the output's strides are not the input's
    filled = spec.partial
    if filled:
        spec = _reduced(spec)
    out = func(*local_args, **kwargs)
    if mutates:
        if filled:
            args[0]._spec = spec
        return args[0]
    if memory:
        spec = spec.remembering(*memory)
    if isinstance(out, tuple):
        return tuple(_ShardTensor(o, spec.with_dtype(o.dtype)) for o in out)
    return _ShardTensor(out, spec if out.dtype == spec.dtype else spec.with_dtype(out.dtype))


def _reference_layout(args: tuple) -> ShardTensorSpec | None:
    """The layout of the ShardTensor operand with the most dims, then the most elements, the
    first sharded one among equals (else the first): the one the others may broadcast into."""
    best = None
    for arg in args:
        if type(arg) is _ShardTensor:
            spec = arg._spec
            if best is None or spec.ndim > best.ndim:
                best = spec
            elif spec.ndim == best.ndim and spec is not best:
                mine, theirs = math.prod(spec.shape), math.prod(best.shape)
                if mine > theirs or (mine == theirs and spec.shardings and not best.shardings):
                    best = spec
    return best


# NOTE [Operands that broadcast into the layout]
# ``x + bias`` with ``x`` sharded along H and ``bias`` of shape (C, 1, 1) is the commonest
# op of a convolutional model; before the fast path took it, each such op paid for a plan
# lookup and, on its first call, for DTensor's sharding propagation (seconds on a 2x2x2 mesh).
# An operand broadcasts into the reference layout (the operand with the most dims) when the
# result has the reference's global shape and each rank's result is the op of the local
# shards. That holds when, dim by dim (aligned from the right, as broadcasting aligns dims),
# the operand's dim is
# - sharded exactly as the reference's (the same mesh axes, the same shard sizes), or
# - whole on every rank and 1, or whole on every rank and the reference's extent along a
#   dim no mesh axis splits in the reference, or
# - whole on every rank and the reference's extent along a dim the reference splits: each
#   rank cuts its part out of its local tensor, the redistribution DTensor's rule would make
#   (``Replicate -> Shard``, a slice, no communication) without the planning; it goes through
#   ``redistribute_local``, so the probe that finds compilable regions sees that the module's
#   plain tensors depend on the global shape (NOTE [Compiled local regions]). Its gradient, which
#   the op's derivative computes on ShardTensors, comes back split like the reference, and
#   what consumes it reduces it (the expand that made the operand, or a promotion's backward,
#   NOTE [Where the gradient of a replicated parameter is summed]). So an operand whose
#   ``.grad`` would receive it, a leaf ShardTensor or a plain tensor that requires grad, is
#   not cut: it takes the default path, whose redistribution gathers its gradient back.
# Then its local tensor (cut) broadcasts against every rank's shard. This covers a replicated
# operand (a ShardTensor whose placements are all Replicate, or a plain tensor, which every
# rank holds whole: the commonest, a bias), an operand with the reference's layout along
# some dims and extent 1 along the others (a per-row statistic ``(N, C, H, 1, 1)`` of a
# field split over H, W and D), and one with the reference's whole layout. The result keeps
# the reference's layout (placements, sizes, stride), as DTensor's pointwise rule would give;
# the other operands' hints are remembered. An operand with pending reductions (Partial
# axes) that broadcasts once reduced is reduced first: an all-reduce of that operand, as
# DTensor's rule would choose (the per-row mean subtracted in a variance's backward). A
# Partial reference stays pending when scaled by a number and goes to the default path
# otherwise, as does anything else (whose first call on a 2x2x2 mesh costs seconds of
# DTensor's strategy expansion).
# NOTE [Operands of one shape laid out differently]
# ``shortcut + f(x)``, a residual add, is the commonest op of a model and its operands may
# come laid out differently: ``f`` (a window partition and its reverse, a flatten of H x W
# blocks into tokens and back) may return its output split another way than its input, H
# over both mesh axes rather than H x W blocks. DTensor's pointwise rule then chooses by its
# cost model, which prefers the slabs whatever the operands' order, so one such block in the
# middle of a model turned every later layer, and the output, into slabs (MONAI's SwinUNETR on
# a 2 x 2 mesh, ``tests/third_party`` ``monai-swinunetr-2x2``). The result takes the
# reference operand's layout (the first one among operands of its shape, ``_reference_layout``),
# as every other pointwise route does (the broadcast cut above, ``_ops/_elementwise_ops``): an
# operand of the reference's global shape laid out otherwise is moved to it, with no pending
# reduction on either side and only where the move is no gather (the reference splits the
# tensor into at least as many pieces, NOTE [Gathers an op was not asked to make]); else the
# default path decides, as before. Not a leaf that requires grad, whose ``.grad`` must keep
# its layout (as the cut above). The move is ``redistribute_local``, below autograd: the
# operand's gradient comes back in the result's layout, as after DTensor's own move.
def _moves_into(operand: torch.Tensor, spec: ShardTensorSpec) -> bool:
    """Whether ShardTensor ``operand`` is moved to ``spec`` (NOTE [Operands of one shape laid
    out differently])."""
    layout = operand._spec
    return (
        layout.shape == spec.shape
        and not layout.partial
        and layout.mesh == spec.mesh
        and not (operand.requires_grad and operand.grad_fn is None)
        and not gathers(layout, spec)
    )


def _broadcasts_into(operand: ShardTensorSpec, spec: ShardTensorSpec) -> bool:
    return _fits_spec(operand, spec, cut=False) is not None


def _fits(
    operand: torch.Tensor, spec: ShardTensorSpec
) -> tuple[tuple[int, DimSharding], ...] | None:
    """How ShardTensor ``operand`` fits every shard of ``spec`` (``_fitted``); it is not cut
    where it is a leaf that requires grad, whose ``.grad`` must keep its layout."""
    leaf = operand.requires_grad and operand.grad_fn is None
    return _fits_spec(operand._spec, spec, cut=not leaf)


def _fits_spec(
    operand: ShardTensorSpec, spec: ShardTensorSpec, cut: bool
) -> tuple[tuple[int, DimSharding], ...] | None:
    if operand.partial or (operand.mesh is not spec.mesh and operand.mesh != spec.mesh):
        return None
    offset = spec.ndim - operand.ndim
    own = {s.dim + offset: s for s in operand.shardings}
    return _fitted(operand.shape, spec, own, cut)


def _fitted(
    shape: torch.Size,
    spec: ShardTensorSpec,
    own: dict[int, DimSharding] | None = None,
    cut: bool = True,
) -> tuple[tuple[int, DimSharding], ...] | None:
    """Whether a tensor of ``shape``, whole on every rank but along the reference dims in
    ``own`` (their shardings), gives every shard of ``spec`` its operand: None if not, else
    the cuts, (operand dim, the reference's sharding of it), of the dims it holds whole at the
    extent of a dim ``spec`` splits (none allowed unless ``cut``)."""
    offset = spec.ndim - len(shape)
    if offset < 0:
        return None
    sharded = spec.sharding_by_dim
    cuts = []
    for dim, n in enumerate(shape, offset):
        mine, theirs = (own or {}).get(dim), sharded.get(dim)
        if mine is not None:
            if theirs is None or (mine.axes, mine.sizes) != (theirs.axes, theirs.sizes):
                return None
        elif n == 1 or (n == spec.shape[dim] and theirs is None):
            continue
        elif n == spec.shape[dim] and cut:
            cuts.append((dim - offset, theirs))
        else:
            return None
    return tuple(cuts)


def _cut(
    local: torch.Tensor,
    operand: ShardTensorSpec | None,
    cuts: tuple[tuple[int, DimSharding], ...],
) -> torch.Tensor:
    """This rank's part of ``operand``'s ``local`` tensor along the dims in ``cuts``: a
    redistribution (``Replicate -> Shard``, a slice), so that whatever watches layout changes
    (NOTE [Taps on record_comm and redistribute_local]) sees the operand split."""
    if not cuts:
        return local
    return redistribute_local(local, operand, _cut_spec(operand, cuts))


@cached("fast-path cuts", 1024)
def _cut_spec(
    operand: ShardTensorSpec, cuts: tuple[tuple[int, DimSharding], ...]
) -> ShardTensorSpec:
    placements = list(operand.placements)
    sizes = {s.dim: s.sizes for s in operand.shardings}
    order = {s.dim: s.axes for s in operand.shardings}
    for dim, sharding in cuts:
        for axis in sharding.axes:
            placements[axis] = Shard(dim)
        sizes[dim], order[dim] = sharding.sizes, sharding.axes
    return operand.relaid(placements, sizes, order=order)


def _reduced(spec: ShardTensorSpec) -> ShardTensorSpec:
    """``spec`` with its pending reductions done (Partial axes replicated)."""
    return target_spec(spec, [Replicate() if p.is_partial() else p for p in spec.placements])


# A pending sum (or mean) scaled by a number is the sum of the scaled pending terms, so
# ``Partial * c``, ``Partial / c`` and ``-Partial`` stay pending, each rank scaling its term.
_SCALINGS = {
    aten.mul.Scalar,
    aten.div.Scalar,
    aten.neg.default,
    aten.mul_.Scalar,
    aten.div_.Scalar,
    aten.neg_.default,
}


def _scaled_pending_sum(func: OpOverload, args: tuple, kwargs: dict, spec, mutates: bool):
    """A number times, or over, a ShardTensor with pending sums: the same pending sums of the
    scaled terms; NotImplemented for any other op on a Partial reference."""
    x, *numbers = args
    if (
        func not in _SCALINGS
        or kwargs
        or type(x) is not _ShardTensor
        or any(isinstance(n, torch.Tensor) for n in numbers)
        or any(p.is_partial() and p.reduce_op not in ("sum", "avg") for p in spec.placements)
    ):
        return NotImplemented
    out = func(x._local, *numbers)
    if mutates:
        return x
    return _ShardTensor(out, spec if out.dtype == spec.dtype else spec.with_dtype(out.dtype))


def _mutates_first_argument(func: OpOverload) -> bool:
    arguments = func._schema.arguments
    return (
        bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write
    )


# ---------------------------------------------------------------------------- default path
def run_with_propagation(
    func: OpOverload,
    args: tuple,
    kwargs: dict,
    local_impl: Callable[..., Any] | None = None,
):
    """Run ``func`` by its cached plan (see ``_propagation``).

    Parameters
    ----------
    local_impl : callable, optional
        Runs instead of the op on the moved local shards (same arguments), for handlers that
        need only a different local kernel, e.g. one that copes with empty shards.
    """
    leaves, structure = flatten_args(args)
    plan = plan_for(func, leaves, structure, kwargs, local_impl)
    if plan.action == "decompose":
        return _decompose(func, args, kwargs)
    if plan.action == "copy_back":
        return _in_place_through_copy(func, args, kwargs)
    if plan.returns_destination:
        with asked_for():  # operands go to the layout of the destination, which the user chose
            local_leaves = _moved_leaves(leaves, plan)
    else:
        local_leaves = _moved_leaves(leaves, plan)
    local_args = unflatten_args(local_leaves, structure)
    local_args.extend(plan.extra_args)
    if plan.shape_argument is not None:
        index, shape, stride_index, stride = plan.shape_argument
        local_args[index] = shape
        if stride_index is not None:
            local_args[stride_index] = stride
    local_kwargs = {k: local_of(v) for k, v in kwargs.items()} if kwargs else {}
    if plan.empty_outputs:
        device = next(t.device for t in local_leaves if isinstance(t, torch.Tensor))
        out = _empty_outputs(plan.outputs, device)
    else:
        out = (local_impl or plan.op)(*local_args, **local_kwargs)
    if plan.returns_destination:
        return args[0]
    result = _wrap(out, plan.outputs, plan, func)
    plan.checked = True
    if plan.targets and plan.targets[0] is not None and returns_view(func):
        mark_moved(func, result)  # NOTE [A write into a view that is a copy] in _copies.py
    return result


def _empty_outputs(specs: object, device: torch.device) -> object:
    """This rank's outputs when they are all empty (NOTE [No kernel sees an empty shard it
    cannot reduce] in ``_propagation``), on the operands' device."""
    if isinstance(specs, (tuple, list)):
        return type(specs)(_empty_outputs(s, device) for s in specs)
    return torch.empty(specs.local_shape(), dtype=specs.dtype, device=device)


def _moved_leaves(leaves: list, plan: Plan) -> list:
    """Each argument as the local op takes it: a tensor's shard in the plan's target layout."""
    return [
        value if source is None else _moved(leaf, source, target)
        for leaf, value, source, target in zip(leaves, plan.values, plan.sources, plan.targets)
    ]


def _moved(leaf: torch.Tensor, source: ShardTensorSpec, target: ShardTensorSpec | None):
    local = local_of(leaf)
    return local if target is None else redistribute_local(local, source, target)


def local_of(value: object) -> object:
    """A ShardTensor's local shard, or ``value`` itself when it is anything else."""
    return value._local if type(value) is _ShardTensor else value


def _decompose(func: OpOverload, args: tuple, kwargs: dict):
    """NOTE [An op without a sharding rule runs its decomposition] in ``_propagation``."""
    result = decomposition(func)(*args, **kwargs)
    if result is NotImplemented:
        raise NotImplementedError(f"shardsci: cannot decompose {func}")
    return result


def _in_place_through_copy(func: OpOverload, args: tuple, kwargs: dict):
    """Run the out-of-place op, then copy the result into the destination's own layout
    (``copy_``'s result is its source, broadcast)."""
    destination = args[0]
    if func is aten.copy_.default:
        result = args[1]
        if result.shape != destination.shape:
            result = aten.expand.default(result, list(destination.shape))
        if type(result) is not _ShardTensor:
            destination._local.copy_(destination._spec.narrow(result))
            return destination
    else:
        functional = functional_twin(func)
        if functional is None:
            raise NotImplementedError(
                f"in-place {func} would need to move its destination {destination._spec}, and "
                f"it has no out-of-place twin; redistribute the destination first"
            )
        result = functional(*args, **kwargs)
    target = destination._spec.with_dtype(result.dtype)
    with asked_for():  # the destination's own layout
        destination._local.copy_(redistribute_local(result._local, result._spec, target))
    return destination


def _wrap(out: object, specs: object, plan: Plan, func: OpOverload):
    if isinstance(out, torch.Tensor):
        if specs is None:
            return out
        if not plan.checked and tuple(out.shape) != tuple(specs.local_shape()):
            raise RuntimeError(
                f"shardsci internal error: {func} produced a shard of shape "
                f"{tuple(out.shape)}, expected {tuple(specs.local_shape())} for {specs}"
            )
        return _ShardTensor(out, specs if out.dtype == specs.dtype else specs.with_dtype(out.dtype))
    if isinstance(out, (tuple, list)):
        structure = specs if isinstance(specs, (tuple, list)) else [specs] * len(out)
        return type(out)(_wrap(o, s, plan, func) for o, s in zip(out, structure))
    return out
