"""Small helpers shared by the op handler families, and :func:`accepts`, the one guard by
which a handler takes or declines a call."""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard

from shardsci.tensor._api import ShardTensor, grad_spec, redistribute
from shardsci.tensor._caches import cached
from shardsci.tensor._collectives import AxisGroup, axis_group
from shardsci.tensor._held import Held, held_axes, held_on, without_held
from shardsci.tensor._promotion import promoted_local
from shardsci.tensor._redistribute import redistribute_local, target_spec
from shardsci.tensor._spec import DimSharding, ShardTensorSpec

__all__ = [
    "Held",
    "accepts",
    "connected_empty",
    "cut_to",
    "dim_layout",
    "held_axes",
    "held_by_one",
    "held_local",
    "held_on",
    "no_empty_shard",
    "normalized_dims",
    "padded_to",
    "reduced_now",
    "replicated_local",
    "sharding_axes",
    "unsplit",
    "without_held",
]


def accepts(
    *operands: object,
    sharded: Iterable[int] | None = None,
    whole: Iterable[int] = (),
    partial: bool = False,
    floating: bool = False,
    replicated: Iterable[object] = (),
    plain: Iterable[object] = (),
) -> bool:
    """Whether a handler takes a call, from the layouts of its arguments alone.

    A handler returns ``NotImplemented`` (the op takes the default path) when this is False.
    It reads specs and dtypes, which every rank shares, never a shard, so every rank decides
    alike and none enters a collective that another skips. Conditions on argument values (a
    padding mode, a norm's order) join it in the same ``if``.

    Parameters
    ----------
    *operands
        The tensors the handler computes on; ``None`` and plain tensors are allowed, but at
        least one must be a ShardTensor.
    sharded : iterable of int, optional
        The dims the handler is for (a reduction along them, a slice of one): at least one of
        them must be sharded in some ShardTensor operand. Negative dims count from the end; a
        dim an operand lacks is not sharded in it.
    whole : iterable of int
        Dims no ShardTensor operand may shard (a convolution's channels); every ShardTensor
        operand must have them. Negative dims count from the end.
    partial : bool
        Also take ShardTensors with a pending reduction (``Partial`` placements), among the
        operands and ``replicated``: for handlers linear in them, or that reduce them first.
    floating : bool
        Take only floating-point ShardTensor operands.
    replicated : iterable
        Parameters (weights, biases): each ``None``, a plain tensor, or a ShardTensor that
        shards no dim.
    plain : iterable
        Arguments that must not be ShardTensors (running statistics updated in place).

    Examples
    --------
    >>> a = bind(func, args, kwargs)  # doctest: +SKIP
    >>> if not accepts(a.input, whole=[1], replicated=[a.weight, a.bias]):  # doctest: +SKIP
    ...     return NotImplemented
    """
    tensors = [t for t in operands if isinstance(t, ShardTensor)]
    sharded, whole = None if sharded is None else tuple(sharded), tuple(whole)
    if not tensors or (sharded is not None and not any(_shards(t._spec, sharded) for t in tensors)):
        return False
    for t in tensors:
        spec = t._spec
        if (spec.partial and not partial) or (floating and not t.dtype.is_floating_point):
            return False
        if not all(-spec.ndim <= d < spec.ndim for d in whole) or _shards(spec, whole):
            return False
    for t in replicated:
        if isinstance(t, ShardTensor) and (t._spec.shardings or (t._spec.partial and not partial)):
            return False
    return not any(isinstance(t, ShardTensor) for t in plain)


def _shards(spec: ShardTensorSpec, dims: tuple[int, ...]) -> bool:
    """Whether ``spec`` shards one of ``dims`` (negative from the end; a dim it lacks is not)."""
    return any(-spec.ndim <= d < spec.ndim and d % spec.ndim in spec.sharding_by_dim for d in dims)


def unsplit(spec: ShardTensorSpec, dims: Iterable[int]) -> bool:
    """True when no dim of ``dims`` is split between ranks: unsharded, or sharded over mesh
    axes of size 1 (a one-rank mesh). An op reading whole rows along them is then the local
    op (NOTE [A windowed op on unsplit dims is the local op] in ``_conv_ops``)."""
    return all(len(spec.sharding_by_dim[d].sizes) == 1 for d in dims if d in spec.sharding_by_dim)


def no_empty_shard(spec: ShardTensorSpec) -> bool:
    """True when every rank's shard has cells (torch's pad and norm kernels refuse some empty
    dims that the sharded path handles)."""
    return all(spec.shape) and not any(0 in s.sizes for s in spec.shardings)


def normalized_dims(dims: int | Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    """Reduction dims as sorted non-negative ints; ``None`` or ``[]`` means all dims."""
    if dims is None or (not isinstance(dims, int) and len(dims) == 0):
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = (dims,)
    return tuple(sorted({d % ndim if ndim else d for d in dims}))


def dim_layout(spec: ShardTensorSpec, dim: int) -> tuple[DimSharding, AxisGroup, list[int]]:
    """How sharded ``dim`` is laid out: its sharding, the ranks along its mesh axes (this
    rank's position among them is ``group.index``) and where each one's shard starts."""
    sharding = spec.sharding_by_dim[dim]
    starts, running = [], 0
    for size in sharding.sizes:
        starts.append(running)
        running += size
    return sharding, axis_group(spec.mesh, sharding.axes), starts


def with_dims_whole(x: ShardTensor, dims: Collection[int]) -> ShardTensor:
    """``x`` with the shardings of ``dims`` replicated, the rest of its layout kept.
    Differentiable; no communication when none of ``dims`` is sharded."""
    placements = [
        Replicate() if isinstance(p, Shard) and p.dim in dims else p for p in x._spec.placements
    ]
    return redistribute(x, target_spec(x._spec, placements))


def reduced_now(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its pending reductions done (an all-reduce over its Partial axes), its
    shards kept. Statistics (a max, a sum, a mean) are reduced so before they meet the
    operand they came from: left Partial, the default rule would move that operand to shard
    a dim over the reduced axes, a layout the caller never asked for."""
    if not isinstance(t, ShardTensor) or not t._spec.partial:
        return t
    spec = grad_spec(t._spec)
    return ShardTensor(redistribute_local(t._local, t._spec, spec), spec)


def sizes_at_extent(sizes: Sequence[int], extent: int) -> tuple[int, ...]:
    """Shard sizes ``sizes`` of a dim cut at ``extent``, or with the last shard grown to reach
    it: each rank keeps the cells of its range that the new extent has."""
    bounds = [min(sum(sizes[:k]), extent) for k in range(len(sizes) + 1)]
    cut = [b - a for a, b in itertools.pairwise(bounds)]
    cut[-1] += max(extent - sum(sizes), 0)
    return tuple(cut)


# NOTE [A sum over a dim one rank holds stays with that rank]
# A contraction over a split dim leaves a pending sum (Partial) over the dim's axes.
# Where one rank holds the dim whole and the others' shards are empty (an uneven split, a
# slice of one rank's part), every other rank's term is an output-sized buffer of zeros: the
# output depends on that rank alone. It keeps it: those axes shard an output dim, the holder
# holding all of it and the others none; the dim is the summed dim itself where it is kept,
# else the first dim no axis splits, else the first dim, with the holder's axes nested
# outermost over its split (the holder's row of ranks keeps its split, the others none). No
# byte moves; the others' zeros are dropped (``held_local``), and in backward they receive
# an empty gradient, their operands' shards being empty along the summed dim. A 0-d output
# has no dim to carry the axes: it stays a pending sum, one zero per other rank. A dim no
# rank holds (extent 0) sums to zeros on every rank and stays pending.
# The same holds of every pending reduction whose empty terms are its identity: a max or min,
# a product (ones), a p-norm (``_NormPartial``, pending as a sum of p-th powers: zeros; the
# empty shards of infinite and negative orders give 0 or inf, ``_vector_norm``), and of an
# argmax or argmin (the holder's indices are the global positions, its offset being 0).
# Where: ``_matmul_ops`` (einsum, matmul, linear, bmm: NOTE [A product of held operands runs
# on their holder]; ``aten.mm`` over split columns: ``held_by_one``) and ``_reduction_ops``
# (``sum``, ``amax``, ``amin``, ``prod``, ``linalg_vector_norm``, hence mean, var, logsumexp,
# softmax, the ``torch.masked`` reductions and ``pairwise_distance``; with ``keepdim`` each
# held dim carries its own axes; ``max``/``min``/``median``/``nanmedian`` with a dim and
# ``argmax``/``argmin``, values and indices alike, by torch's own kernel on the holder:
# ``_held_extremes``). ``prod``'s
# backward scans the held dim (``cumprod``, on the holder: ``_scan_ops``) after a ``cat`` of
# a row of ones (joining the holder: ``_index_ops._cat``). Such a layout is kept by what follows
# where the op's rule sees the held axes as "the whole dim, on the holder" (NOTE [A dim one
# rank holds is whole on that rank] in ``_held``): the statistic meeting its input (NOTE [A
# pointwise op on held operands runs on their holder] in ``_propagation``), ``expand`` (the
# sum's backward) and ``squeeze`` of a held dim of extent 1 (``_view_ops``).
# Pending reductions whose value is one rank's term where the others' are their identity.
_ONE_TERM_REDUCTIONS = frozenset({"sum", "max", "min", "product"})


@cached("one-holder layouts", 256)
def held_by_one(
    spec: ShardTensorSpec,
    summed: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...],
    first: tuple[int, ...] = (),
) -> tuple[ShardTensorSpec, tuple[int, ...]]:
    """``spec``, an output pending a sum over the axes of the split dims ``summed`` (each as
    its ``(axes, sizes)``), with each such sum one rank holds whole kept by that rank (NOTE [A
    sum over a dim one rank holds stays with that rank]), along the first free dim of
    ``first`` and then ``0 .. ndim-1``; and the output dims it now shards so."""
    sharded = {s.dim for s in spec.shardings}
    held: list[Held] = []
    for axes, dim_sizes in summed:
        holders = [k for k, n in enumerate(dim_sizes) if n]
        pending = all(
            isinstance(spec.placements[a], Partial)
            and spec.placements[a].reduce_op in _ONE_TERM_REDUCTIONS
            for a in axes
        )
        if len(holders) != 1 or spec.ndim == 0 or not pending:
            continue
        candidates = (*first, *range(spec.ndim))
        e = next((d for d in candidates if d not in sharded), candidates[0])
        sharded.add(e)
        held.append(Held(e, axes, holders[0]))
    if not held:
        return spec, ()
    return held_on(spec, held), tuple(h.dim for h in held)


def held_local(local: torch.Tensor, spec: ShardTensorSpec, dims: Iterable[int]) -> torch.Tensor:
    """``local``, a rank's whole term of an output along ``dims``, cut to its part of them in
    ``spec`` (``held_by_one``'s): all of it on the holder, nothing elsewhere."""
    shape = spec.local_shape()
    for dim in dims:
        local = local.narrow(dim, 0, shape[dim])
    return local


def sharding_axes(spec: ShardTensorSpec) -> set[int]:
    """Mesh axes that shard some dim of ``spec``."""
    return {a for s in spec.shardings for a in s.axes}


def replicated_local(
    t: torch.Tensor | None, mesh: DeviceMesh, partial_axes: set[int]
) -> torch.Tensor | None:
    """A replicated operand (plain tensor or replicated ShardTensor) for a local computation
    whose output is sharded over ``partial_axes``: its local gradient there is a partial sum,
    summed over those axes (NOTE [Where the gradient of a replicated parameter is summed]).
    Tensors that need no gradient pass through."""
    if t is None:
        return None
    placements = [Partial() if a in partial_axes else Replicate() for a in range(mesh.ndim)]
    if not isinstance(t, ShardTensor):
        if not t.requires_grad or not torch.is_grad_enabled():
            return t
        return promoted_local(t, mesh, placements)
    if not all(isinstance(p, Replicate) for p in t.placements):
        raise NotImplementedError(f"expected a replicated operand, got {t.placements}")
    return t.to_local(grad_placements=placements)


# NOTE [A rank with an empty shard computes nothing]
# Many torch kernels, and their meta functions, reject an empty dim even where they do not
# act on it ("non-zero size for non-batch dimensions"): pooling, reflection and replication
# padding, interpolation, grid sampling, ``im2col``, fused attention. Called on an empty shard
# (channels split with a rank holding none), the ranks holding it raise while the others wait
# in the next collective. So a handler that runs such a kernel on its shards never calls it
# on an empty one: the local output's shape comes from the layout (a window rule) or from a
# meta probe with extent 1 on the empty dims set back to 0 afterwards, and the output is zeros
# made by ``connected_empty``, so that the rank still takes part in its inputs' backward
# collectives. Where: ``_pool_ops._pool``, ``_batched_ops._run_local``, ``_interpolate_ops``,
# ``_windows.overlapped_windows``, the gather, gradient, FFT, extremum and product handlers.
# Those zeros' gradients depend on the incoming gradient only; a second derivative
# (``create_graph=True``) through them is right where the op's first derivative in its input
# does not depend on a parameter the op itself holds (pooling, interpolation, padding,
# unfolding: ``tests/test_higher_order_grad.py``). Where it does, or where the peers' kernel
# decides whether a second derivative exists, the empty rank instead runs the kernel on its
# input padded with zeros to one cell (or one window) per empty dim (``padded_to``) and keeps
# none of the result (``cut_to``), so that its graph, and the collectives a second derivative
# issues, match its peers': the convolution and the transposed convolution (NOTE [An empty
# shard's convolution in a graph] in ``_conv_ops``) and attention over keys all held here
# (NOTE [Attention over keys all held here is torch's] in ``_ring_attention``).
def connected_empty(
    shape: list[int], like: torch.Tensor, *inputs: torch.Tensor | None
) -> torch.Tensor:
    """An empty output that still depends on ``inputs`` (NOTE [A rank with an empty shard
    computes nothing]).

    A rank whose output is empty must take part in the backward collectives of its inputs
    (halo adjoints, weight reductions) like every other rank, so its output stays connected
    to them in the autograd graph, with zero gradients.
    """
    zero = sum(
        (t.sum() * 0 for t in inputs if t is not None and t.requires_grad), like.new_zeros(())
    )
    return like.new_zeros(shape) + zero


def padded_to(t: torch.Tensor, extents: dict[int, int]) -> torch.Tensor:
    """``t`` with zeros appended along each dim of ``extents`` up to that extent (NOTE [A
    rank with an empty shard computes nothing])."""
    for dim, extent in extents.items():
        missing = max(extent - t.shape[dim], 0)
        if missing:
            shape = list(t.shape)
            shape[dim] = missing
            t = torch.cat([t, t.new_zeros(shape)], dim)
    return t


def cut_to(t: torch.Tensor, extents: dict[int, int]) -> torch.Tensor:
    """The first ``extent`` cells of ``t`` along each dim of ``extents``: ``padded_to``'s
    inverse on a kernel's output."""
    for dim, extent in extents.items():
        t = t.narrow(dim, 0, extent)
    return t
