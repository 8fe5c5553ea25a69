"""The ShardTensor class: a global tensor whose shards may have any sizes.

# NOTE [Autograd interaction between torch.Tensor and ShardTensor]
A ShardTensor is a wrapper subclass: autograd records ops on the ShardTensor itself, and the
local tensor inside never requires grad. Crossing between the two worlds goes through
autograd Functions (``from_local``, ``to_local``, ``redistribute``), whose backward passes
move gradients to the layout of the forward input: Shard stays Shard (same sizes), Replicate
stays Replicate, Partial becomes Replicate. A plain tensor that requires grad and meets a
ShardTensor (a module's weight) enters as ``from_local(w, mesh, [Replicate()] * ndim)``, so its
gradient is the sum over shards (NOTE [Where the gradient of a replicated parameter is summed]
in ``_promotion``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from shardsci.tensor import _dispatch, _function_dispatch
from shardsci.tensor._caches import cached
from shardsci.tensor._copies import CopyOf
from shardsci.tensor._gather_guard import check_built_whole
from shardsci.tensor._layout_inference import explicit_dim_sizes, sizes_for_from_local
from shardsci.tensor._redistribute import redistribute_local, target_spec
from shardsci.tensor._spec import ShardTensorSpec, replicated_spec
from shardsci.tensor._torch_compat import Tensor_is_zerotensor, _make_wrapper_subclass
from shardsci.tensor._torch_compile import allow_in_graph, static_for_dynamo

__all__ = [
    "ShardTensor",
    "from_local_spec",
    "grad_spec",
    "gradient_shard",
    "local_gradient",
    "moved_local",
    "redistribute",
]

ShardingShapes = str | Mapping[int, Sequence[Sequence[int] | int]]


class ShardTensor(torch.Tensor):
    """A tensor sharded over a :class:`DeviceMesh` with arbitrary shard sizes.

    Create one with :meth:`from_local` (every rank passes its shard) or
    :func:`shardsci.scatter_tensor` (one rank passes the whole tensor). Any torch op works on
    it: ops with a shardsci handler run shard-aware code, all others go through DTensor's
    sharding propagation with shardsci's uneven-aware redistribution, and results carry the
    true shard sizes.
    """

    _local: torch.Tensor
    _spec: ShardTensorSpec
    _halo: Any
    """Cells around this shard gathered with it, for the next windowed op (NOTE [A padded
    tensor carries the halo its convolution reads] in ``_ops/_windows.py``), or None."""
    _copy_of: CopyOf | None
    """For the output of a view op that is a copy here (a select along a split dim, a
    reshape that moves cells), or a view of one: what made it, and where an in-place op on it
    writes through, if anywhere (NOTE [A write into a view that is a copy] in
    ``_copies.py``); else None."""
    __slots__ = ("_copy_of", "_halo", "_local", "_spec")

    @staticmethod
    def __new__(
        cls, local: torch.Tensor, spec: ShardTensorSpec, *, requires_grad: bool = False
    ) -> ShardTensor:
        result = _make_wrapper_subclass(
            cls,
            spec.shape,
            strides=spec.stride,
            dtype=spec.dtype,
            device=local.device,
            requires_grad=requires_grad,
        )
        result._local = local
        result._spec = spec
        result._halo = None
        result._copy_of = None
        return result

    def __repr__(self) -> str:  # type: ignore[override]
        return f"ShardTensor(local={self._local}, spec={self._spec})"

    def __tensor_flatten__(self) -> tuple[list[str], ShardTensorSpec]:
        # Its sizes and the shard's are the layout's, guarded by the spec: static for dynamo
        # whatever automatic dynamic shapes make of a new layout (NOTE [torch.compile and
        # ShardTensor]).
        static_for_dynamo(self)
        static_for_dynamo(self._local)
        return ["_local"], self._spec

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], spec: ShardTensorSpec, outer_size: Any, outer_stride: Any
    ) -> ShardTensor:
        return ShardTensor(inner["_local"], spec)

    @classmethod
    def __metadata_guard__(cls, traced: ShardTensorSpec, current: ShardTensorSpec) -> bool:
        """Dynamo's guard on the flatten context: a compiled graph runs again only on the
        layout it was traced for (``traced`` is a deep copy, so specs compare by value)."""
        return traced.key == current.key

    def __coerce_same_metadata_as_tangent__(
        self, expected: ShardTensorSpec, expected_type: type | None = None
    ) -> ShardTensor | None:
        """A gradient flowing into a compiled backward in the layout the graph was traced
        with: the same tensor re-labelled when only hints differ, else redistributed."""
        if expected_type not in (None, ShardTensor):
            return None
        if self._spec is expected:
            return self
        if self._spec.same_layout(expected) and self._spec.dtype == expected.dtype:
            return ShardTensor(self._local, expected)
        return redistribute(self, expected)

    def _stable_hash_for_caching(self) -> str:
        """This input's part of AOTAutograd's cache key (torch's NOTE [Tensor subclass stable
        hashing for AOT autograd cache]); it replaces, for a subclass that has it, the pickled
        flatten context, which holds the device mesh and is not the same in two processes, so
        a graph cached by one process was never found by the next.

        The key is the layout by value (``ShardTensorSpec.stable_text``: placements, every
        shard extent and hint, mesh), this rank's mesh coordinate and its shard's metadata:
        the graph AOTAutograd traces through a ShardTensor is the rank's own (a halo's split
        sizes, a boundary rank's one-sided exchange), and ranks of one machine share the cache
        directory, so two ranks with equal shards but different neighbours must not share an
        entry. Two layouts never do."""
        local = self._local
        value = (
            self._spec.stable_text,
            self._spec.mesh.get_coordinate(),
            tuple(local.shape),
            local.stride(),
            local.storage_offset(),
            local.dtype,
            str(local.device),
            self.requires_grad,
        )
        return hashlib.blake2b(repr(value).encode(), digest_size=16).hexdigest()

    __torch_dispatch__ = classmethod(_dispatch.dispatch)  # type: ignore[assignment]
    __torch_function__ = classmethod(_function_dispatch.dispatch)  # type: ignore[assignment]

    # NOTE [Metadata reads skip __torch_function__]
    # On a subclass whose ``__torch_function__`` is not torch's disabled one, reading
    # ``x.shape`` calls ``__torch_function__`` with ``Tensor.shape.__get__`` (torch's C getter
    # checks for an override first): a Python dispatch for a value that never changes. A
    # training step reads 400-800 of them, most from the handlers (1 rank, ViT 417, MeshGraphNet
    # 772). DTensor avoids it by disabling ``__torch_function__`` altogether; ShardTensor needs
    # it (function handlers, promotion of parameters), so these properties answer the reads
    # from the layout instead: the wrapper was made with the spec's shape and dtype and the
    # shard's device, and the only code that replaces ``_spec`` or ``_local`` in place keeps
    # them equal to the wrapper's (the in-place view ops, which also reshape the wrapper, and a
    # Partial made whole in place). ``requires_grad``, ``grad`` and ``grad_fn`` are the
    # wrapper's autograd state, not the layout's: they keep torch's getters.
    @property
    def shape(self) -> torch.Size:  # type: ignore[override]
        return self._spec.shape

    @property
    def dtype(self) -> torch.dtype:  # type: ignore[override]
        return self._spec.dtype

    @property
    def ndim(self) -> int:  # type: ignore[override]
        return len(self._spec.shape)

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self._local.device

    # ------------------------------------------------------------------ layout queries
    @property
    def local(self) -> torch.Tensor:
        """This rank's shard as stored, outside autograd: for aten handlers (they run below
        autograd) and for reading. Code above autograd (function handlers, models) uses
        :meth:`to_local`, whose result is differentiable."""
        return self._local

    @property
    def spec(self) -> ShardTensorSpec:
        """The layout, the same on every rank: global shape, stride and dtype, placements,
        and the shard sizes of every sharded dim."""
        return self._spec

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.placements

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    def sharding_shapes(self) -> dict[int, tuple[torch.Size, ...]]:
        """Mesh axis -> local shapes of the ranks along it, as in PhysicsNeMo."""
        return self._spec.sharding_shapes()

    def offsets(self, axis: int | None = None) -> int | tuple[int, ...]:
        """Global index where this rank's shard starts.

        Parameters
        ----------
        axis : int, optional
            A mesh axis: the offset along the tensor dim sharded over it (0 when that axis
            does not shard). Without it, the offset along every tensor dim.
        """
        offsets = self._spec.local_offsets()
        if axis is None:
            return offsets
        placement = self._spec.placements[axis]
        return offsets[placement.dim] if isinstance(placement, Shard) else 0

    # ------------------------------------------------------------------ conversions
    @staticmethod
    def from_local(
        local_tensor: torch.Tensor,
        device_mesh: DeviceMesh,
        placements: Sequence[Placement],
        sharding_shapes: ShardingShapes = "infer",
        *,
        shape: Sequence[int] | None = None,
        run_check: bool = False,
    ) -> ShardTensor:
        """Assemble a ShardTensor from every rank's shard. Differentiable.

        Parameters
        ----------
        local_tensor : Tensor
            This rank's shard.
        device_mesh : DeviceMesh
        placements : sequence of Placement
            One per mesh axis.
        sharding_shapes : "infer", "chunk" or dict
            ``"infer"`` gathers every rank's shape once (validating that they form one tensor).
            ``"chunk"`` assumes ``torch.chunk`` sizes of ``shape`` (or of local size times the
            number of shards), no communication. A dict maps each sharded mesh axis to the
            local shapes (or sizes along the sharded dim) of the ranks along it, no
            communication.
        shape : sequence of int, optional
            The global shape, checked against the sizes.
        run_check : bool
            With ``"chunk"`` or a dict, also verify across ranks that every shard matches
            (one small all-reduce), so a mismatch raises on every rank.
        """
        spec = sizes_for_from_local(
            local_tensor, device_mesh, placements, sharding_shapes, shape, run_check
        )
        return _from_local(local_tensor, spec)

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's shard. Differentiable: the gradient of the returned tensor is read as
        a shard with ``grad_placements`` (default: the same placements, Partial as
        Replicate)."""
        if not torch.is_grad_enabled():
            return self._local
        return _to_local(self, None if grad_placements is None else tuple(grad_placements))

    def full_tensor(self) -> torch.Tensor:
        """The whole tensor on every rank. Differentiable."""
        return self.redistribute(placements=[Replicate()] * self._spec.mesh.ndim).to_local()

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        sharding_shapes: Mapping[int, Sequence[Sequence[int] | int]] | None = None,
    ) -> ShardTensor:
        """Move to new placements (and shard sizes) with the least communication.

        Parameters
        ----------
        device_mesh : DeviceMesh, optional
            Must be this tensor's mesh (moving between meshes is not supported).
        placements : sequence of Shard or Replicate
            Target placements; Partial is produced by ops, never requested.
        sharding_shapes : dict, optional
            Mesh axis -> sizes (or local shapes) of the ranks along it, to rebalance. Default:
            unchanged sizes for dims that stay sharded the same way, the sizes a dim had when
            last sharded that way, else ``torch.chunk`` sizes.
        """
        spec = self._spec
        if device_mesh is not None and device_mesh != spec.mesh:
            raise ValueError(
                f"redistribute keeps the device mesh: got {device_mesh}, tensor is on {spec.mesh}"
            )
        if placements is None:
            raise ValueError("redistribute needs target placements")
        placements = _checked_user_placements(placements, spec)
        sizes = None
        if sharding_shapes is not None:
            sizes = explicit_dim_sizes(sharding_shapes, placements, spec.mesh, spec.shape)
        return redistribute(self, target_spec(spec, placements, sizes))

    @staticmethod
    def from_dtensor(dtensor: DTensor) -> ShardTensor:
        """Wrap a DTensor (``torch.chunk`` shard sizes). Differentiable."""
        spec = ShardTensorSpec.build(
            dtensor.device_mesh,
            dtensor.placements,
            dtensor.shape,
            dtensor.dtype,
            order={e.tensor_dim: e.mesh_dims for e in dtensor._spec.shard_order},
            stride=dtensor.stride(),
        )
        return _from_local(dtensor.to_local(), spec)

    def to_dtensor(self) -> DTensor:
        """A DTensor with the same placements; shards are first rebalanced to ``torch.chunk``
        sizes when they differ. Differentiable."""
        chunked = target_spec(
            ShardTensorSpec.build(self._spec.mesh, self._spec.placements, self.shape, self.dtype),
            self._spec.placements,
        )
        local = redistribute(self, chunked).to_local()
        return DTensor.from_local(
            local, self._spec.mesh, self._spec.placements, shape=self.shape, stride=self.stride()
        )


# ---------------------------------------------------------------------------- autograd
def redistribute(x: ShardTensor, spec: ShardTensorSpec) -> ShardTensor:
    """Differentiable move of ``x`` to ``spec`` (internal: any placements, Partial included)."""
    if x._spec.same_layout(spec):
        return x
    return _Redistribute.apply(x, spec)


def from_local_spec(local: torch.Tensor, spec: ShardTensorSpec) -> ShardTensor:
    """Differentiable ``from_local`` with a known spec (no checks, no communication)."""
    return _from_local(local, spec)


def grad_spec(spec: ShardTensorSpec) -> ShardTensorSpec:
    """The layout a gradient is returned in for a forward tensor of layout ``spec``."""
    if not spec.partial:
        return spec
    placements = [Replicate() if isinstance(p, Partial) else p for p in spec.placements]
    return target_spec(spec, placements)


def local_gradient(grad: torch.Tensor, spec: ShardTensorSpec) -> torch.Tensor:
    """This rank's shard of ``grad``, the gradient of a tensor laid out as ``spec``, in the
    layout ``grad_spec(spec)``: what ``from_local``'s backward returns for its local tensor.
    Differentiable in a backward that builds a graph (NOTE [Second derivatives through
    ShardTensors]). Where ``spec`` holds a pending sum, the gradient is replicated along its
    axes and every rank reads the same value, so the derivatives that reach that local in a
    second backward are each rank's term of one sum: they go back pending (``spec``'s
    placements), not as a replica (a product summing over a split dim had a wrong second
    derivative, by 691 on 2x2 in ``tests/test_higher_order_grad.py``)."""
    grad = _as_shard_tensor(grad, spec)
    target = grad_spec(spec).with_dtype(grad.dtype)
    if spec.partial and _builds_graph(grad):
        return _to_local(redistribute(grad, target), tuple(spec.placements))
    return moved_local(grad, target)


# NOTE [Second derivatives through ShardTensors]
# A backward that builds a graph (``create_graph=True``, or ``torch.autograd.grad`` of a
# gradient) runs with grad mode on, and what it returns is differentiated again. The
# wrapper's autograd sees only ShardTensors: the plain ``_local`` inside never requires grad,
# so a backward that reads a gradient's ``_local`` (to move it) or wraps a plain gradient
# with ``ShardTensor(...)`` returns a value with no graph behind it, and a second derivative
# through it is silently missing terms (``grad`` of ``y.square().sum()`` w.r.t. a weight,
# then w.r.t. x, was wrong on 1 and 2 ranks for a linear layer and a convolution). So every
# crossing in a backward goes through ``moved_local`` and ``gradient_shard``: outside a
# graph-building backward the direct, cheap move (as before); inside one the autograd
# Functions (``redistribute``, ``to_local``, ``from_local``), whose backwards are the same
# moves again. shardsci's own autograd Functions follow one of two rules: a backward written
# in differentiable ops (the halo's extension and its sum to the owners are each other's
# adjoint, ``_halo._AddedToOwners`` and ``_gather_plan``'s pair; the linear node recomputes
# its composition), or ``_first_order.first_order_only`` (the norms over split dims, ring
# attention and the ring product, the overlapped halo, the scans, unpooling, scatter
# extrema), whose results raise when differentiated: never a silently wrong value
# (``tests/test_higher_order_grad.py``). torch's ``once_differentiable`` is not enough: it
# marks the results only when an incoming gradient requires grad, but a backward also reads
# what its forward saved (a norm's input, a product's operands), so ``grad`` of ``u.sum()``
# w.r.t. x with ``create_graph=True`` (a constant incoming gradient) returned a derivative with
# no graph behind it, and a loss built on it silently lost those terms.
def _builds_graph(grad: torch.Tensor) -> bool:
    """Whether ``grad``, met in a backward, is to be differentiated again."""
    return grad.requires_grad and torch.is_grad_enabled()


def moved_local(grad: ShardTensor, spec: ShardTensorSpec) -> torch.Tensor:
    """This rank's shard of ``grad`` moved to ``spec``; differentiable where a backward
    builds a graph (NOTE above)."""
    if _builds_graph(grad):
        return _to_local(redistribute(grad, spec), None)
    return redistribute_local(grad._local, grad._spec, spec)


def gradient_shard(local: torch.Tensor, spec: ShardTensorSpec) -> ShardTensor:
    """A ShardTensor of layout ``spec`` over this rank's ``local``, met in a backward;
    differentiable where the backward builds a graph (NOTE above)."""
    if _builds_graph(local):
        return _from_local(local, spec)
    return ShardTensor(local, spec)


def _as_shard_tensor(grad: torch.Tensor, spec: ShardTensorSpec) -> ShardTensor:
    """A gradient as a ShardTensor. A plain one comes from a backward formula that builds a
    fresh tensor of the global shape (``zeros(sizes)``), the same on every rank: it is read
    as replicated, a gradient built whole (the gather guard's to judge, NOTE [Gathers an op
    was not asked to make])."""
    if isinstance(grad, ShardTensor):
        return grad
    if grad.shape == spec.shape:
        if not Tensor_is_zerotensor(grad):  # a zero gradient with no storage holds nothing
            check_built_whole(spec.with_dtype(grad.dtype))
        return gradient_shard(grad, replicated_spec(grad, spec.mesh))
    raise TypeError(
        f"expected a gradient of shape {tuple(spec.shape)} for {spec}, got a plain tensor "
        f"of shape {tuple(grad.shape)}"
    )


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: ShardTensor, spec: ShardTensorSpec) -> ShardTensor:  # type: ignore[override]
        ctx.source = x._spec
        local = redistribute_local(x._local, x._spec, spec)
        return ShardTensor(local, spec.with_dtype(local.dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = _as_shard_tensor(grad, ctx.source)
        target = grad_spec(ctx.source).with_dtype(grad.dtype)
        return redistribute(grad, target), None


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, spec: ShardTensorSpec) -> ShardTensor:  # type: ignore[override]
        ctx.spec = spec
        return ShardTensor(local.view_as(local), spec)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return local_gradient(grad, ctx.spec), None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: ShardTensor, grad_placements: tuple[Placement, ...] | None
    ) -> torch.Tensor:
        spec = x._spec
        ctx.grad_spec = (
            grad_spec(spec) if grad_placements is None else _as_placed(spec, grad_placements)
        )
        return x._local.view_as(x._local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[ShardTensor, None]:  # type: ignore[override]
        return gradient_shard(grad, ctx.grad_spec.with_dtype(grad.dtype)), None


# Calls dynamo puts into its graph whole, for AOTAutograd to trace the autograd Function
# inside: dynamo's own trace of ``_FromLocal``/``_ToLocal`` fails with an internal error when
# the spec holds a graph input (the mesh) (NOTE [torch.compile and ShardTensor]).
@allow_in_graph
def _from_local(local: torch.Tensor, spec: ShardTensorSpec) -> ShardTensor:
    return _FromLocal.apply(local, spec)


@allow_in_graph
def _to_local(x: ShardTensor, grad_placements: tuple[Placement, ...] | None) -> torch.Tensor:
    return _ToLocal.apply(x, grad_placements)


@cached("placement changes", 4096)
def _as_placed(spec: ShardTensorSpec, placements: tuple[Placement, ...]) -> ShardTensorSpec:
    """``spec`` with other placements, the same shard sizes (cached: ``to_local`` with
    gradient placements is on the path of every weight's use)."""
    return spec.relaid(
        placements,
        {s.dim: s.sizes for s in spec.shardings},
        order={s.dim: s.axes for s in spec.shardings},
        hints=(),
    )


# ---------------------------------------------------------------------------- validation
def _checked_user_placements(
    placements: Sequence[Placement], spec: ShardTensorSpec
) -> tuple[Placement, ...]:
    placements = tuple(placements)
    if len(placements) != spec.mesh.ndim:
        raise ValueError(
            f"got {len(placements)} placements {placements} for a {spec.mesh.ndim}-D mesh"
        )
    for axis, p in enumerate(placements):
        if isinstance(p, Partial):
            raise ValueError(
                f"cannot redistribute to {p} on mesh axis {axis}: Partial placements are "
                f"produced by ops (e.g. a sum over a sharded dim), not requested"
            )
        if isinstance(p, Shard) and not -spec.ndim <= p.dim < spec.ndim:
            raise ValueError(
                f"Shard({p.dim}) on mesh axis {axis} is out of range for a {spec.ndim}-D "
                f"tensor of shape {tuple(spec.shape)}"
            )
    return tuple(Shard(p.dim % spec.ndim) if isinstance(p, Shard) else p for p in placements)


_dispatch.bind_tensor_type(ShardTensor)
