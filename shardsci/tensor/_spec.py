"""The layout of a ShardTensor: placements plus the true extent of every shard.

DTensor describes a sharded dim by its placement alone and assumes ``torch.chunk`` sizes.
:class:`ShardTensorSpec` adds, for every sharded tensor dim, the extent owned by each rank, so
shards may have any sizes, zero included.

# NOTE [Shard sizes are a global, rank-independent table]
A tensor dim ``d`` sharded over mesh axes ``(a_0, ..., a_k)`` (outermost first: DTensor's
``shard_order``) is described by one flat tuple of extents, row-major over the coordinates of
those axes. The rank at coordinates ``(c_0, ..., c_k)`` owns the extent at flat index
``ravel(c_0, ..., c_k)`` and its offset along ``d`` is the sum of the extents before it. Nested
sharding is therefore a 1-D sharding over the flattened sub-mesh of its axes, and every rank
holds the same table: no rank-dependent state, so specs hash, compare and cache like values.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from shardsci.tensor._caches import BoundedCache, register_cache
from shardsci.tensor._torch_compat import DTensorSpec, TensorMeta

__all__ = [
    "DimSharding",
    "ShardTensorSpec",
    "SpecKey",
    "chunk_sizes",
    "coordinate_over_axes",
    "index_over_axes",
    "merged_hints",
    "mesh_coordinate",
    "replicated_spec",
]


def chunk_sizes(extent: int, parts: int) -> tuple[int, ...]:
    """Extents of ``torch.chunk(extent, parts)``, padded with zeros to ``parts`` entries."""
    if parts <= 0:
        raise ValueError(f"cannot split into {parts} parts")
    step = -(-extent // parts) if extent else 0
    sizes = []
    remaining = extent
    for _ in range(parts):
        take = min(step, remaining)
        sizes.append(take)
        remaining -= take
    return tuple(sizes)


# Equal layouts built separately share one spec object, so the dispatch fast path can compare
# operands' specs by identity. Keyed by value (NOTE [Caches are keyed by value]); an entry goes
# when its spec does.
_INTERNED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
register_cache("interned specs", _INTERNED.__len__, _INTERNED.clear)
_LAYOUTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
register_cache("interned layouts", _LAYOUTS.__len__, _LAYOUTS.clear)


def mesh_coordinate(mesh: DeviceMesh) -> tuple[int, ...]:
    """This rank's coordinate in ``mesh``; raises when the rank is not part of it."""
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise RuntimeError(f"this rank is not part of the device mesh {mesh}")
    return tuple(coordinate)


def index_over_axes(
    coordinate: Sequence[int] | Mapping[int, int], axes: Sequence[int], mesh_shape: Sequence[int]
) -> int:
    """Row-major index of ``coordinate`` (indexed by mesh axis) over ``axes``, outermost first:
    a shard's place in a ``DimSharding``'s sizes, a member's in the group of ``axes``."""
    index = 0
    for axis in axes:
        index = index * mesh_shape[axis] + coordinate[axis]
    return index


def coordinate_over_axes(
    index: int, axes: Sequence[int], mesh_shape: Sequence[int]
) -> dict[int, int]:
    """The coordinate along each of ``axes`` of row-major ``index`` (``index_over_axes``'s
    inverse), keyed by axis in the order of ``axes``."""
    coordinate = {}
    for axis in reversed(axes):
        index, coordinate[axis] = divmod(index, mesh_shape[axis])
    return {axis: coordinate[axis] for axis in axes}


class SpecKey:
    """A spec's value with its hash computed once: a sharding plan's key holds one per
    operand and is hashed on every op (a tuple rehashes its items each time, and placements
    and meshes hash in Python)."""

    __slots__ = ("__weakref__", "_hash", "value")

    def __init__(self, value: tuple) -> None:
        self.value = value
        self._hash = hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            type(other) is SpecKey and self._hash == other._hash and self.value == other.value
        )

    def __reduce__(self) -> tuple:
        return SpecKey, (self.value,)  # hashes of strings differ between processes


@dataclass(frozen=True)
class DimSharding:
    """How one tensor dim is split over mesh axes.

    Attributes
    ----------
    dim : int
        The tensor dim.
    axes : tuple of int
        Mesh axes sharding ``dim``, outermost first.
    sizes : tuple of int
        Extents along ``dim``, row-major over the coordinates of ``axes`` (see NOTE above).
    """

    dim: int
    axes: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def extent(self) -> int:
        return sum(self.sizes)

    def flat_index(self, mesh_shape: Sequence[int], coordinate: Sequence[int]) -> int:
        """This dim's shard index at mesh ``coordinate``: its place in ``sizes``."""
        return index_over_axes(coordinate, self.axes, mesh_shape)

    def is_even(self) -> bool:
        """True when every shard has the same, non-zero extent (DTensor's ``avg`` is exact)."""
        return self.sizes[0] > 0 and all(s == self.sizes[0] for s in self.sizes)


@dataclass(frozen=True, eq=False)
class ShardTensorSpec:
    """Global description of a sharded tensor, identical on every rank.

    Attributes
    ----------
    mesh : DeviceMesh
        The device mesh the tensor lives on.
    placements : tuple of Placement
        One per mesh axis: ``Shard(d)``, ``Replicate()`` or ``Partial(op)``.
    shape : torch.Size
        Global shape.
    stride : tuple of int
        Global stride (contiguous in the local tensor's dim order).
    dtype : torch.dtype
        Element type.
    shardings : tuple of DimSharding
        One entry per sharded tensor dim, ordered by dim.
    hints : tuple of DimSharding
        Shard sizes this tensor's dims had when last sharded, oldest first (NOTE [Shard-size
        hints]). Part of the cache key, not of ``same_layout``.
    """

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    shardings: tuple[DimSharding, ...]
    hints: tuple[DimSharding, ...] = field(default=())

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(
        cls,
        mesh: DeviceMesh,
        placements: Sequence[Placement],
        shape: Sequence[int],
        dtype: torch.dtype,
        sizes: dict[int, Sequence[int]] | None = None,
        *,
        stride: Sequence[int] | None = None,
        order: dict[int, Sequence[int]] | None = None,
        hints: tuple[DimSharding, ...] = (),
    ) -> ShardTensorSpec:
        """Validate and build a spec.

        Parameters
        ----------
        sizes : dict, optional
            Tensor dim -> flat extents (row-major over its axes). Missing dims get the
            ``torch.chunk`` split (nested: each outer piece chunked again).
        order : dict, optional
            Tensor dim -> mesh axes, outermost first; default: increasing mesh axis.
        """
        placements = tuple(placements)
        shape = torch.Size(shape)
        if len(placements) != mesh.ndim:
            raise ValueError(
                f"got {len(placements)} placements {placements} for a {mesh.ndim}-D mesh; "
                f"expected one placement per mesh axis"
            )
        axes_by_dim: dict[int, list[int]] = {}
        for axis, placement in enumerate(placements):
            if isinstance(placement, Shard):
                dim = placement.dim if placement.dim >= 0 else placement.dim + len(shape)
                if not 0 <= dim < len(shape):
                    raise ValueError(
                        f"Shard({placement.dim}) on mesh axis {axis} is out of range for a "
                        f"{len(shape)}-D tensor of shape {tuple(shape)}"
                    )
                axes_by_dim.setdefault(dim, []).append(axis)
            elif not isinstance(placement, (Replicate, Partial)):
                raise ValueError(f"unsupported placement {placement!r} on mesh axis {axis}")
        placements = tuple(
            Shard(p.dim % len(shape)) if isinstance(p, Shard) else p for p in placements
        )
        shardings = []
        for dim in sorted(axes_by_dim):
            axes = tuple(axes_by_dim[dim])
            if order and dim in order:
                axes = _checked_order(dim, axes, order[dim])
            dim_sizes = (sizes or {}).get(dim)
            if dim_sizes is None:
                dim_sizes = nested_chunk_sizes(shape[dim], [mesh.shape[a] for a in axes])
            shardings.append(_checked_sharding(dim, axes, tuple(dim_sizes), shape, mesh))
        unknown = set(sizes or {}) - set(axes_by_dim)
        if unknown:
            raise ValueError(f"sizes given for dims {sorted(unknown)} that are not sharded")
        if stride is None:
            stride = contiguous_stride(shape)
        spec = cls(mesh, placements, shape, tuple(stride), dtype, tuple(shardings), hints)
        return _INTERNED.setdefault(spec.key, spec)

    @classmethod
    def from_shardings(
        cls,
        mesh: DeviceMesh,
        shardings: Iterable[DimSharding],
        shape: Sequence[int],
        dtype: torch.dtype,
        *,
        pending: Iterable[int] = (),
        stride: Sequence[int] | None = None,
        hints: tuple[DimSharding, ...] = (),
    ) -> ShardTensorSpec:
        """A spec from its dims' shardings: each ``DimSharding``'s dim split over its axes
        (outermost first) in its sizes, a pending sum (``Partial``) over the mesh axes
        ``pending``, every other axis replicated; validated and interned by :meth:`build`."""
        placements: list[Placement] = [Replicate()] * mesh.ndim
        for axis in pending:
            placements[axis] = Partial()
        sizes, order = {}, {}
        for s in shardings:
            sizes[s.dim], order[s.dim] = s.sizes, s.axes
            for axis in s.axes:
                placements[axis] = Shard(s.dim)
        return cls.build(
            mesh, placements, shape, dtype, sizes, stride=stride, order=order, hints=hints
        )

    # ------------------------------------------------------------------ queries
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @cached_property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.shape)

    @cached_property
    def sharding_by_dim(self) -> dict[int, DimSharding]:
        return {s.dim: s for s in self.shardings}

    def local_shape(self, coordinate: Sequence[int] | None = None) -> torch.Size:
        """Shape of the shard held at ``coordinate`` (default: this rank)."""
        if coordinate is None:
            coordinate = mesh_coordinate(self.mesh)
        shape = list(self.shape)
        for s in self.shardings:
            shape[s.dim] = s.sizes[s.flat_index(self.mesh_shape, coordinate)]
        return torch.Size(shape)

    def local_offsets(self, coordinate: Sequence[int] | None = None) -> tuple[int, ...]:
        """Global index of the first element of the shard at ``coordinate``, per tensor dim."""
        if coordinate is None:
            coordinate = mesh_coordinate(self.mesh)
        offsets = [0] * self.ndim
        for s in self.shardings:
            offsets[s.dim] = sum(s.sizes[: s.flat_index(self.mesh_shape, coordinate)])
        return tuple(offsets)

    def narrow(self, tensor: torch.Tensor, coordinate: Sequence[int] | None = None) -> torch.Tensor:
        """The shard at ``coordinate`` (default: this rank) of a whole ``tensor`` (a view)."""
        offsets = self.local_offsets(coordinate)
        shape = self.local_shape(coordinate)
        for s in self.shardings:
            tensor = tensor.narrow(s.dim, offsets[s.dim], shape[s.dim])
        return tensor

    @cached_property
    def key(self) -> SpecKey:
        """Everything that identifies this layout, by value (NOTE [Caches are keyed by value])."""
        return SpecKey(
            (
                self.mesh,
                self.placements,
                tuple(self.shape),
                self.stride,
                self.dtype,
                self.shardings,
                self.hints,
            )
        )

    @cached_property
    def stable_text(self) -> str:
        """Everything in ``key``, as text that is the same in every process (no ``hash`` or
        ``id``): the mesh by its device type, ranks and axis names. For AOTAutograd's cache key
        (``ShardTensor._stable_hash_for_caching``)."""
        mesh = (self.mesh.device_type, self.mesh.mesh.tolist(), self.mesh.mesh_dim_names)
        fields = (self.placements, tuple(self.shape), self.stride, self.dtype)
        return repr((mesh, *fields, self.shardings, self.hints))

    @cached_property
    def partial(self) -> bool:
        """Whether any mesh axis holds a pending reduction."""
        return any(isinstance(p, Partial) for p in self.placements)

    @cached_property
    def layout_key(self) -> SpecKey:
        """Mesh, placements, global shape and shard extents by value: what ``same_layout``
        compares. Interned, so specs of one layout (other dtypes or hints) share it and
        compare by identity; a copy (dynamo's guard) still compares by value."""
        key = SpecKey((self.mesh, self.placements, tuple(self.shape), self.shardings))
        return _LAYOUTS.setdefault(key, key)

    def same_layout(self, other: ShardTensorSpec) -> bool:
        """Same mesh, placements, global shape and shard extents (dtype and hints ignored)."""
        return self is other or self.layout_key == other.layout_key

    def sharding_shapes(self) -> dict[int, tuple[torch.Size, ...]]:
        """PhysicsNeMo's form: mesh axis -> local shapes of the ranks along it (others fixed
        at this rank's coordinate), for every sharded axis."""
        coordinate = list(mesh_coordinate(self.mesh))
        result: dict[int, tuple[torch.Size, ...]] = {}
        for axis, placement in enumerate(self.placements):
            if isinstance(placement, Shard):
                shapes = []
                for c in range(self.mesh_shape[axis]):
                    coordinate_c = coordinate.copy()
                    coordinate_c[axis] = c
                    shapes.append(self.local_shape(coordinate_c))
                result[axis] = tuple(shapes)
        return result

    # ------------------------------------------------------------------ derived specs
    def with_dtype(self, dtype: torch.dtype) -> ShardTensorSpec:
        """This layout with another dtype, interned."""
        if dtype == self.dtype:
            return self
        spec = replace(self, dtype=dtype)
        return _INTERNED.setdefault(spec.key, spec)

    def remembering(self, *groups: tuple[DimSharding, ...]) -> ShardTensorSpec:
        """This layout with the hints of other specs of the same layout merged after its own
        (NOTE [Shard-size hints]), interned. Cached per value of the arguments: the fast
        path asks it on every op whose operands remember different sizes (a gradient and
        the activation it meets, in backward)."""
        key = (self.key, groups)
        spec = _REMEMBERED.get(key)
        if spec is None:
            hints = merged_hints(self.hints, *groups)
            spec = self if hints == self.hints else replace(self, hints=hints)
            spec = _REMEMBERED.put(key, _INTERNED.setdefault(spec.key, spec))
        return spec

    def relaid(
        self,
        placements: Sequence[Placement],
        sizes: Mapping[int, Sequence[int]] | None = None,
        *,
        order: Mapping[int, Sequence[int]] | None = None,
        hints: tuple[DimSharding, ...] | None = None,
    ) -> ShardTensorSpec:
        """This tensor (mesh, global shape, stride, dtype) laid out anew, interned.

        ``placements``, ``sizes`` and ``order`` are read as :meth:`build` reads them;
        ``hints`` default to this spec's. Cached per value of the arguments: a layout
        change on every step's path (a redistribution's target, a gradient's layout) is
        validated once.
        """
        placements = tuple(placements)
        hints = self.hints if hints is None else hints
        key = (
            self.key,
            placements,
            None if sizes is None else tuple((d, tuple(s)) for d, s in sizes.items()),
            None if order is None else tuple((d, tuple(a)) for d, a in order.items()),
            hints,
        )
        spec = _RELAID.get(key)
        if spec is None:
            spec = _RELAID.put(
                key,
                ShardTensorSpec.build(
                    self.mesh,
                    placements,
                    self.shape,
                    self.dtype,
                    sizes,
                    stride=self.stride,
                    order=order,
                    hints=hints,
                ),
            )
        return spec

    @cached_property
    def dtensor_spec(self) -> DTensorSpec:
        """The DTensor view of this spec, for DTensor's sharding propagation: placements,
        shape, stride and dtype, every dim's axes in the default order (NOTE [The nesting of
        a dim sharded over several axes is shardsci's, like its sizes] in ``_propagation``)."""
        meta = TensorMeta(self.shape, self.stride, self.dtype)
        return DTensorSpec(self.mesh, self.placements, meta)

    def __repr__(self) -> str:
        parts = ", ".join(
            f"dim {s.dim} over axes {s.axes}: {list(s.sizes)}" for s in self.shardings
        )
        return (
            f"ShardTensorSpec(shape={tuple(self.shape)}, placements={self.placements}"
            f"{', ' + parts if parts else ''}, dtype={self.dtype})"
        )


# NOTE [Shard-size hints]
# Uneven shard sizes are chosen once (by the user, the data, or an op's ownership rule) and
# must survive layout changes that forget them: ``Shard(i) -> Shard(j) -> Shard(i)``,
# downsample then upsample, a forward FFT then its inverse, a slice then its backward. So a
# spec carries ``hints``: the DimShardings its dims had before, oldest first, at most
# ``_MAX_HINTS``, one per (axes, sizes). Writers: every op that derives an output spec from its
# inputs' passes their hints on (``merged_hints``: the inputs' hints and current shardings,
# newest last) -- the default path (``_propagation``), views (``unbind`` and ``stack``
# renumbered past the dim they remove or insert), matmul/einsum, windowed ops,
# FFTs, slices; redistribution keeps the newest per (dim, set of axes) (``_updated_hints``).
# Readers, each taking a hint only when its axes (and extent) match what it must size:
# - ``_redistribute.target_spec``: a dim sharded again over the same set of axes takes the
#   newest hint's sizes and axis order (a current sharding wins over a hint);
# - ``_propagation._reference_sizes``: operands aligned over a set of axes no operand is
#   currently sharded over take the order and sizes an operand remembers for those axes (in
#   any order) and extent (the newest match);
# - ``_ops/_windows.owned_sizes``: an upsampling window (transposed conv, interpolation) whose
#   output extent a newest hint remembers takes those sizes (the layout before downsampling);
# - ``_ops/_fft_ops``: a moved dim takes the sizes last remembered for that dim, axes and
#   extent; an inverse transform returns to the layout the hints remember;
# - ``_ops/_index_ops``: a slice's backward writes into the remembered forward layout when its
#   counts match; ``select_backward`` finds the forward's sharding among the newest hints;
# - ``_ops/_factory_ops._new_layout``: ``new_zeros`` and kin of another shape take, for a dim
#   of changed extent, the newest hint for that dim and extent over axes the source leaves
#   replicated (a read through an index, ``_gather_scatter_ops._reading``, remembers the
#   input's shardings at the input's dims for this: NOTE [New tensors of a backward take the
#   forward's layout]); a dim split over the same axes at another extent takes the
#   sizes the newest hint for that dim, axes and extent remembers (a reduction's output
#   remembers its input's sizes: ``_reduction_ops.reduced_spec``).
# The dispatch fast path (operands of one layout) merges every operand's hints after the first
# operand's (``ShardTensorSpec.remembering``), so a product keeps the memory of either factor.
# Hints are not part of ``same_layout``: two specs with the same shards are the same layout.
_MAX_HINTS = 8


def merged_hints(*groups: tuple[DimSharding, ...]) -> tuple[DimSharding, ...]:
    """Hints from several specs, de-duplicated by (axes, sizes), the newest kept last."""
    seen: dict[tuple, DimSharding] = {}
    for group in groups:
        for hint in group:
            key = (hint.axes, hint.sizes)
            seen.pop(key, None)
            seen[key] = hint
    return tuple(seen.values())[-_MAX_HINTS:]


def nested_chunk_sizes(extent: int, parts_per_axis: Sequence[int]) -> tuple[int, ...]:
    """``torch.chunk`` split of ``extent``, each piece split again over the next axis."""
    pieces = [extent]
    for parts in parts_per_axis:
        pieces = [size for piece in pieces for size in chunk_sizes(piece, parts)]
    return tuple(pieces)


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride = []
    running = 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


def _checked_order(dim: int, axes: tuple[int, ...], order: Sequence[int]) -> tuple[int, ...]:
    if sorted(order) != sorted(axes):
        raise ValueError(
            f"shard order {tuple(order)} for tensor dim {dim} must list exactly the mesh axes "
            f"that shard it, {axes}"
        )
    return tuple(order)


def _checked_sharding(
    dim: int, axes: tuple[int, ...], sizes: tuple[int, ...], shape: torch.Size, mesh: DeviceMesh
) -> DimSharding:
    expected = math.prod([mesh.shape[a] for a in axes])  # dynamo breaks on a generator
    if len(sizes) != expected:
        raise ValueError(
            f"tensor dim {dim} is sharded over mesh axes {axes} ({expected} shards) but "
            f"{len(sizes)} sizes were given: {list(sizes)}"
        )
    if any(s < 0 for s in sizes):
        raise ValueError(f"negative shard size in {list(sizes)} for tensor dim {dim}")
    if sum(sizes) != shape[dim]:
        raise ValueError(
            f"shard sizes {list(sizes)} for tensor dim {dim} sum to {sum(sizes)}, "
            f"but the global size of that dim is {shape[dim]}"
        )
    return DimSharding(dim, axes, sizes)


_RELAID: BoundedCache[tuple, ShardTensorSpec] = BoundedCache("relaid specs", 4096)
_REPLICATED: BoundedCache[tuple, ShardTensorSpec] = BoundedCache("replicated specs", 1024)
_REMEMBERED: BoundedCache[tuple, ShardTensorSpec] = BoundedCache("remembered specs", 1024)


def replicated_spec(tensor: torch.Tensor, mesh: DeviceMesh) -> ShardTensorSpec:
    """Spec of a plain tensor that every rank of ``mesh`` holds whole (cached)."""
    key = (mesh, tuple(tensor.shape), tensor.stride(), tensor.dtype)
    spec = _REPLICATED.get(key)
    if spec is None:
        placements = [Replicate()] * mesh.ndim
        spec = ShardTensorSpec.build(
            mesh, placements, tensor.shape, tensor.dtype, stride=tensor.stride()
        )
        _REPLICATED.put(key, spec)
    return spec
