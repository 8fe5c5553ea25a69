"""Discrete Fourier transforms (``torch.fft``) of tensors sharded along transformed dims.

# NOTE [Where a distributed FFT leaves the spectrum]
A dim is transformed where it is local. The transformed dims that are not sharded, and the
sharded ones that one rank holds whole (every other shard of the dim empty: ``(0, 5, 0, 0)``
over 4 ranks), are transformed first, together, in place. A dim held whole keeps its one
holder, at the output's extent, and takes no other dim's axes, so it stays whole through the
call (and an inverse transform finds it whole): nothing moves for it, where moving it would
send the holder's cells to ranks that held none of them. Each other sharded dim is then made
local by moving its mesh axes onto another dim (``Shard(i) -> Shard(j)``: one all-to-all, NOTE
[Redistribution is one box exchange plus reductions]) and transformed, the last dim first. Its
axes go to, in order (never to a transformed dim held whole):
1. the dim this call transformed most recently: it never needs to be local again. fft2 over
   (H, W) of an H-sharded tensor transforms W, then moves H's axes onto W: the spectrum is
   W-sharded (the slab FFT). A D-sharded fftn over (D, H, W) gives a W-sharded spectrum, a
   (D/0, H/1) pencil an (H/0, W/1) one. Each axis moves once.
2. else (nothing transformed yet, or only dims held whole) a transformed dim still to
   transform, an already sharded one first; that axis moves again later. Only transforms
   whose dims are all sharded get here: fft2 of a 2-D block (H/0, W/1) goes H/(0, 1), then
   W/(0, 1), and an rfft whose real dim is sharded (W-sharded rfft2: W -> H, then H -> W).
   They pay a second all-to-all so that the leading batch and channel dims stay whole:
   batches are often of size 1, and spectral weights contract channels on the local modes.
3. else the last dim not transformed: fft over H of an H-sharded (B, C, H, W) tensor returns a
   W-sharded spectrum, fft over W of a W-sharded one an H-sharded spectrum.
4. else (every dim is transformed, e.g. a 1-D signal) the dim is gathered, transformed and
   sliced back to its shards.
Axes joining a sharded dim nest inside its own axes: each of its shards is split further and
its boundaries stay, so an output cell stays with the ranks along those axes that held the
input cells it is computed from (NOTE [An output cell belongs to the shard it depends on] in
``tests/expected_layouts.py``; fft along H of an (H/0, W/1) block gives W/(1, 0), each W
block split between the two ranks that held its H halves, not W/(0, 1), which moves W's
cells across axis 1). rfft's real (last) dim is
transformed first, with the local dims or alone; irfft's real dim last, after every complex
dim (c2r keeps only the real part of what the others produce). A moved dim takes the shard
sizes last remembered (hints) for that dim, axes and extent, else ``torch.chunk``'s; a dim
whose sharding does not change keeps its sizes.

Inverse transforms (ifft*, irfft*) return to the layout the forward transform came from: of the
layouts that the forward rule maps onto the spectrum's layout they take the one the hints
remember (with the output's extents, else any extents; the most recent; a dim the transform
leaves alone and that keeps its sharding is no evidence either way), else the one needing
the fewest moves, and run its forward plan backwards, each move undone and each transform
inverted. So a forward transform followed by its inverse gives back the input's layout and
uneven shard sizes, for the same all-to-alls. The spectrum's own layout is no memory of where
it came from (any op on it, such as slicing the kept modes, remembers it again), nor is a
transformed dim's layout at the spectrum's extent: so per-dim transforms of a D-sharded volume
(rfft W, fft H, fft D moving D's axes onto W) are undone at the matching inverse (ifft D moves
them back), where the data is smallest, as in an FNO's spectral convolution. A layout no
forward transform produces is inverted by the forward rule itself.

Every move is one all-to-all of the data held at that point, so modes truncated before the
transform that moves a dim are never sent: rfft along W, keep ``m`` modes, fft along H moves
``m / (W / 2 + 1)`` of the spectrum. Partial(sum / avg) placements stay Partial (a DFT is
linear); other Partial placements are reduced first. Values and gradients come from the local
``torch.fft`` calls composed with differentiable redistributions.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from shardsci.tensor._api import ShardTensor, from_local_spec, redistribute
from shardsci.tensor._binding import Arguments, bind, replaced
from shardsci.tensor._caches import cached
from shardsci.tensor._ops._common import accepts, connected_empty
from shardsci.tensor._redistribute import target_spec
from shardsci.tensor._registry import register_function_handler
from shardsci.tensor._shape_probe import probe_on_meta, shape_probe
from shardsci.tensor._spec import DimSharding, ShardTensorSpec, merged_hints, nested_chunk_sizes

# Tensor dim -> mesh axes sharding it (outermost first), sorted by dim.
Layout = tuple[tuple[int, tuple[int, ...]], ...]


@dataclass(frozen=True)
class _Kind:
    """What a ``torch.fft`` function computes.

    Attributes
    ----------
    inverse : bool
        An inverse transform (ifft*, irfft*).
    real : bool
        Its last dim is real-to-complex (rfft*) or complex-to-real (irfft*).
    rank : int or None
        1 (``n``, ``dim=-1``), 2 (``s``, ``dim=(-2, -1)``) or None (``s``, ``dim=None``).
    """

    inverse: bool
    real: bool
    rank: int | None


_FUNCTIONS = {
    torch.fft.fft: _Kind(False, False, 1),
    torch.fft.ifft: _Kind(True, False, 1),
    torch.fft.rfft: _Kind(False, True, 1),
    torch.fft.irfft: _Kind(True, True, 1),
    torch.fft.fft2: _Kind(False, False, 2),
    torch.fft.ifft2: _Kind(True, False, 2),
    torch.fft.rfft2: _Kind(False, True, 2),
    torch.fft.irfft2: _Kind(True, True, 2),
    torch.fft.fftn: _Kind(False, False, None),
    torch.fft.ifftn: _Kind(True, False, None),
    torch.fft.rfftn: _Kind(False, True, None),
    torch.fft.irfftn: _Kind(True, True, None),
}
# (inverse, real) -> the local transform over several dims.
_LOCAL: dict[tuple[bool, bool], Callable[..., torch.Tensor]] = {
    (False, False): torch.fft.fftn,
    (True, False): torch.fft.ifftn,
    (False, True): torch.fft.rfftn,
    (True, True): torch.fft.irfftn,
}
_LINEAR_PARTIALS = ("sum", "avg")


# ---------------------------------------------------------------------------- handler
@register_function_handler(*_FUNCTIONS)
def _fft(func, args, kwargs):
    a = bind(func, args, kwargs)
    x = a.input
    if not accepts(x, partial=True) or a.out is not None:
        return NotImplemented
    kind = _FUNCTIONS[func]
    call = _Call.parse(func, kind, a, args, kwargs)
    if not call.dims:
        return NotImplemented
    x = _linear_partials_only(x)
    layout = tuple((s.dim, s.axes) for s in x._spec.shardings)
    whole = _held_whole(x._spec)
    if kind.inverse:
        steps = _inverse_steps(layout, x._spec, call, whole)
    else:
        steps, _ = _plan(layout, call.dims, x.ndim, kind.real, False, whole)
    hints = merged_hints(x._spec.hints, x._spec.shardings)
    return _run(x, steps, call, hints)


#: ``hfft*`` / ``ihfft*`` -> the real transform of the conjugate they are, with ``norm``
#: swapped: ``ihfftn(x) = conj(rfftn(x))``, ``hfftn(x) = irfftn(conj(x))``.
_CONJUGATE_TWINS = {
    torch.fft.ihfft: torch.fft.rfft,
    torch.fft.ihfft2: torch.fft.rfft2,
    torch.fft.ihfftn: torch.fft.rfftn,
    torch.fft.hfft: torch.fft.irfft,
    torch.fft.hfft2: torch.fft.irfft2,
    torch.fft.hfftn: torch.fft.irfftn,
}
_SWAPPED_NORM = {None: "forward", "backward": "forward", "forward": "backward", "ortho": "ortho"}


@register_function_handler(*_CONJUGATE_TWINS)
def _hermitian_fft(func, args, kwargs):
    """Hermitian transforms take their real twin's path and layouts (DTensor gathered them):
    the input (``hfft*``) or the output (``ihfft*``) conjugated, ``backward`` and ``forward``
    normalisation swapped."""
    a = bind(func, args, kwargs)
    x = a.input
    if not accepts(x, partial=True) or a.out is not None:
        return NotImplemented
    probe_on_meta(func, args, kwargs)  # torch's errors, named for this function, on every rank
    inverse = func in (torch.fft.hfft, torch.fft.hfft2, torch.fft.hfftn)
    values = {"norm": _SWAPPED_NORM[a.norm]}
    if inverse:
        values["input"] = torch.conj_physical(x)
    args, kwargs = replaced(func, args, kwargs, values)
    out = _CONJUGATE_TWINS[func](*args, **kwargs)
    return out if inverse else torch.conj_physical(out)


@dataclass(frozen=True)
class _Call:
    """One call's transformed dims and each one's output length.

    Attributes
    ----------
    kind : _Kind
    dims : tuple of int
        Transformed dims, non-negative, in the call's order (the real dim last).
    lengths : dict
        Dim -> the ``s`` entry its local transform gets: the signal length (rfft's real dim:
        the real input length, irfft's: the real output length).
    out_shape : torch.Size
        Global shape of the result.
    norm : str or None
    """

    kind: _Kind
    dims: tuple[int, ...]
    lengths: dict[int, int]
    out_shape: torch.Size
    norm: str | None

    @classmethod
    def parse(cls, func, kind: _Kind, a: Arguments, args: tuple, kwargs: dict) -> _Call:
        """Validate on a meta tensor (same error on every rank, before any collective);
        ``a`` is the call bound, ``args`` and ``kwargs`` as given."""
        x = a.input
        out = probe_on_meta(func, args, kwargs)
        sizes, dims, norm = a.n if kind.rank == 1 else a.s, a.dim, a.norm
        if kind.rank == 1:
            dims, sizes = (dims,), None if sizes is None else (sizes,)
        # The n-D transforms also take one int for ``s`` and ``dim`` (``rfftn(x, dim=-1)``).
        dims = (dims,) if isinstance(dims, int) else dims
        sizes = (sizes,) if isinstance(sizes, int) else sizes
        if dims is None:
            dims = range(x.ndim) if sizes is None else range(x.ndim - len(sizes), x.ndim)
        dims = tuple(d % x.ndim for d in dims)
        lengths = {d: out.shape[d] for d in dims}
        if kind.real and not kind.inverse:
            signal = -1 if sizes is None else sizes[-1]
            lengths[dims[-1]] = x.shape[dims[-1]] if signal == -1 else signal
        return cls(kind, dims, lengths, out.shape, norm)


def _linear_partials_only(x: ShardTensor) -> ShardTensor:
    """``x`` with every Partial that a DFT does not commute with reduced."""
    placements = [
        Replicate()
        if isinstance(p, Partial) and not (type(p) is Partial and p.reduce_op in _LINEAR_PARTIALS)
        else p
        for p in x._spec.placements
    ]
    if tuple(placements) == x._spec.placements:
        return x
    return redistribute(x, target_spec(x._spec, placements))


# ---------------------------------------------------------------------------- plans
#: ``(dim, axes)`` of sharded dims that one rank holds whole: local, transformed in place.
Whole = frozenset[tuple[int, tuple[int, ...]]]


def _held_whole(spec: ShardTensorSpec) -> Whole:
    """The shardings of ``spec`` with exactly one non-empty shard (NOTE [Where a distributed
    FFT leaves the spectrum])."""
    return frozenset((s.dim, s.axes) for s in spec.shardings if sum(map(bool, s.sizes)) == 1)


@dataclass(frozen=True)
class _Move:
    """Redistribute so that the sharded dims are exactly ``layout``."""

    layout: Layout


@dataclass(frozen=True)
class _Transform:
    """Transform ``dims`` (all local) with one local call; ``real``: the last is the real dim."""

    dims: tuple[int, ...]
    real: bool


Step = _Move | _Transform


@cached("FFT plans", 4096)
def _plan(
    layout: Layout,
    dims: tuple[int, ...],
    ndim: int,
    real_first: bool,
    real_last: bool,
    whole: Whole = frozenset(),
) -> tuple[tuple[Step, ...], Layout]:
    """The steps of NOTE [Where a distributed FFT leaves the spectrum] and the final layout.

    ``real_first``: the real dim ``dims[-1]`` goes first (r2c); ``real_last``: last (c2r).
    ``whole``: the shardings of ``layout`` that one rank holds whole; those of transformed
    dims are transformed in place and take no other axes, so they stay whole throughout.
    """
    axes_of = dict(layout)
    held = {d for d, axes in layout if (d, axes) in whole and d in dims}
    steps: list[Step] = []
    done: list[int] = []

    def in_place(dim: int) -> bool:
        return dim not in axes_of or dim in held

    def transform(group: list[int], real: bool) -> None:
        steps.append(_Transform(tuple(group), real))
        done.extend(group)

    def transform_alone(dim: int, real: bool) -> None:
        if in_place(dim):
            transform([dim], real)
            return
        moved = axes_of.pop(dim)
        target = _target(dim, axes_of, dims, done, ndim, held)
        if target is not None:
            axes_of[target] = axes_of.get(target, ()) + moved
        steps.append(_Move(_frozen(axes_of)))
        transform([dim], real)
        if target is None:
            axes_of[dim] = moved
            steps.append(_Move(_frozen(axes_of)))

    real_dim = dims[-1]
    if real_first and not in_place(real_dim):
        transform_alone(real_dim, True)
    held_back = real_last and not all(in_place(d) for d in dims[:-1])
    local = [d for d in dims if d not in done and in_place(d) and not (held_back and d == real_dim)]
    if local:
        transform(local, (real_first or real_last) and local[-1] == real_dim)
    for dim in reversed(dims):
        if dim not in done and not (real_last and dim == real_dim):
            transform_alone(dim, False)
    if real_last and real_dim not in done:
        transform_alone(real_dim, True)
    return tuple(steps), _frozen(axes_of)


def _target(
    dim: int,
    axes_of: dict[int, tuple[int, ...]],
    dims: tuple[int, ...],
    done: list[int],
    ndim: int,
    held: set[int],
) -> int | None:
    """Where the axes of ``dim`` go before it is transformed (the NOTE's order; never a
    transformed dim one rank holds whole, ``held``)."""
    landed = [d for d in done if d not in held]
    if landed:
        return landed[-1]
    pending = [d for d in dims if d != dim and d not in done]
    if pending:
        return ([d for d in pending if d in axes_of] or pending)[0]
    others = [d for d in range(ndim) if d not in dims]
    return others[-1] if others else None


def _frozen(axes_of: dict[int, tuple[int, ...]]) -> Layout:
    return tuple(sorted(axes_of.items()))


@cached("FFT inverse sources", 1024)
def _sources(
    layout: Layout, dims: tuple[int, ...], ndim: int, real: bool, whole: Whole = frozenset()
) -> tuple[tuple[Layout, tuple[Step, ...]], ...]:
    """Every layout the forward rule maps onto ``layout``, with its forward steps.

    Only transformed dims' axes move, so each axis comes from its current dim or from a
    transformed one; every assignment and nesting order is tried. A sharding of ``whole``
    (held whole by one rank in ``layout``) is held whole in a source that has it too: a
    transform keeps such a dim's sizes but for the holder's extent.
    """
    home = {axis: dim for dim, axes in layout for axis in axes}
    axes = sorted(home)
    options = [sorted({home[a], *dims}) for a in axes]
    found = []
    for choice in itertools.product(*options):
        by_dim: dict[int, list[int]] = {}
        for axis, dim in zip(axes, choice):
            by_dim.setdefault(dim, []).append(axis)
        for orders in itertools.product(*(itertools.permutations(a) for a in by_dim.values())):
            source = tuple(sorted(zip(by_dim, orders)))
            steps, final = _plan(source, dims, ndim, real, False, whole)
            if final == layout:
                found.append((source, steps))
    return tuple(found)


def _inverse_steps(
    layout: Layout, spec: ShardTensorSpec, call: _Call, whole: Whole
) -> tuple[Step, ...]:
    """The forward plan of the layout the spectrum came from, run backwards (``whole``: the
    shardings of ``layout`` that one rank holds whole).

    A dim held whole came from a dim held whole, transformed where it lay, unless the hints
    remember it split at the output's extent (modes sliced off a split spectrum can leave
    them all on one rank): it goes back to that split.
    """
    real = call.kind.real
    evidence = [h for h in spec.hints if _is_evidence(h, spec, call)]
    whole = frozenset(
        (d, axes)
        for d, axes in whole
        if (at := _remembered_at(evidence, d, axes, call.out_shape[d])) is None
        or sum(map(bool, evidence[at].sizes)) == 1
    )
    sources = _sources(layout, call.dims, spec.ndim, real, whole)
    if not sources:
        steps, _ = _plan(layout, call.dims, spec.ndim, False, real, whole)
        return steps

    unchanged = {(d, axes) for d, axes in layout if d not in call.dims or (d, axes) in whole}

    def preference(item: tuple[Layout, tuple[Step, ...]]) -> tuple:
        source, steps = item
        # A dim the call leaves alone, sharded as it is now, is no choice the hints decide:
        # D/0 of a (D/0, H/1, W/2) block is D/0 in every source of its W-rfft's spectrum;
        # nor is a dim held whole, transformed where it lies.
        chosen = [(d, axes) for d, axes in source if (d, axes) not in unchanged]
        sized = [_remembered_at(evidence, d, axes, call.out_shape[d]) for d, axes in chosen]
        ages = [_remembered_at(evidence, d, axes) for d, axes in chosen]
        remembered = bool(chosen) and all(age is not None for age in ages)
        newest = min(ages, default=len(evidence)) if remembered else -1
        moves = sum(isinstance(s, _Move) for s in steps)
        return (remembered and None not in sized, remembered, newest, -moves)

    source, steps = max(sources, key=preference)
    before = []
    current = source
    for step in steps:
        before.append(current)
        if isinstance(step, _Move):
            current = step.layout
    return tuple(
        _Move(previous) if isinstance(step, _Move) else step
        for step, previous in zip(reversed(steps), reversed(before))
    )


def _is_evidence(hint: DimSharding, spec: ShardTensorSpec, call: _Call) -> bool:
    """Whether ``hint`` can tell which layout the spectrum ``spec`` came from.

    The spectrum's own sharding cannot (any op on it, e.g. a slice of the kept modes,
    remembers it again as the newest hint), nor a transformed dim's sharding at the spectrum's
    extent rather than the signal's (an earlier spectrum's layout, not a signal's).
    """
    if hint in spec.shardings:
        return False
    dim = hint.dim
    return (
        dim not in call.dims or hint.extent == call.out_shape[dim] or hint.extent != spec.shape[dim]
    )


def _remembered_at(
    hints: Sequence[DimSharding], dim: int, axes: tuple[int, ...], extent: int | None = None
) -> int | None:
    """Position of the newest hint of ``dim`` over ``axes`` (with ``extent`` if given)."""
    for position in range(len(hints) - 1, -1, -1):
        hint = hints[position]
        if hint.dim == dim and hint.axes == axes and extent in (None, hint.extent):
            return position
    return None


# ---------------------------------------------------------------------------- execution
def _run(
    x: ShardTensor, steps: tuple[Step, ...], call: _Call, hints: tuple[DimSharding, ...]
) -> ShardTensor:
    memory = [*x._spec.hints, *x._spec.shardings]
    for step in steps:
        if isinstance(step, _Move):
            spec = _moved_spec(x._spec, step.layout, memory, hints)
            x = redistribute(x, spec)
            memory.extend(spec.shardings)
        else:
            x = _transformed(x, step, call, hints)
    return x


def _moved_spec(
    spec: ShardTensorSpec,
    layout: Layout,
    memory: list[DimSharding],
    hints: tuple[DimSharding, ...],
) -> ShardTensorSpec:
    """``spec`` sharded as ``layout``; Replicate and Partial axes stay as they are."""
    placements = [Replicate() if isinstance(p, Shard) else p for p in spec.placements]
    sizes = {}
    for dim, axes in layout:
        for axis in axes:
            placements[axis] = Shard(dim)
        sizes[dim] = _sizes(spec, dim, axes, memory)
    return ShardTensorSpec.build(
        spec.mesh,
        placements,
        spec.shape,
        spec.dtype,
        sizes,
        order=dict(layout),
        hints=hints,
    )


def _sizes(
    spec: ShardTensorSpec, dim: int, axes: tuple[int, ...], memory: list[DimSharding]
) -> tuple[int, ...]:
    """Unchanged sharding keeps its sizes; else the newest remembered ones; else, for axes
    nested inside the dim's own, each shard chunked over them; else chunk."""
    current = spec.sharding_by_dim.get(dim)
    if current is not None and current.axes == axes:
        return current.sizes
    position = _remembered_at(memory, dim, axes, spec.shape[dim])
    if position is not None:
        return memory[position].sizes
    if current is not None and axes[: len(current.axes)] == current.axes:
        inner = [spec.mesh_shape[a] for a in axes[len(current.axes) :]]
        return tuple(n for size in current.sizes for n in nested_chunk_sizes(size, inner))
    return nested_chunk_sizes(spec.shape[dim], [spec.mesh_shape[a] for a in axes])


def _transformed(
    x: ShardTensor, step: _Transform, call: _Call, hints: tuple[DimSharding, ...]
) -> ShardTensor:
    """One local transform over dims that are whole on every rank that holds any of them
    (a sharded one held by one rank keeps its holder, at the output's extent)."""
    func = _LOCAL[(call.kind.inverse, step.real)]
    lengths = [call.lengths[d] for d in step.dims]
    spec = x._spec
    shape = list(spec.shape)
    for dim in step.dims:
        shape[dim] = call.out_shape[dim]  # each dim is transformed once: its final extent
    sizes = {
        s.dim: tuple(shape[s.dim] if n else 0 for n in s.sizes) if s.dim in step.dims else s.sizes
        for s in spec.shardings
    }
    local = x.to_local()
    out = None
    if local.numel():
        out = func(local, s=lengths, dim=step.dims, norm=call.norm)
        dtype = out.dtype
    else:  # pocketfft and MKL reject empty batches; the result is empty anyway
        with shape_probe():
            meta = torch.empty(local.shape, dtype=local.dtype, device="meta")
            dtype = func(meta, s=lengths, dim=step.dims, norm=call.norm).dtype
    out_spec = ShardTensorSpec.build(
        spec.mesh,
        spec.placements,
        shape,
        dtype,
        sizes,
        order={s.dim: s.axes for s in spec.shardings},
        hints=hints,
    )
    if out is None:
        like = torch.empty((), dtype=dtype, device=local.device)
        out = connected_empty(list(out_spec.local_shape()), like, local.real)
    return from_local_spec(out, out_spec)
