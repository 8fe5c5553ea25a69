"""Creating ShardTensors from a whole tensor: held by one rank, or by every rank."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement

from shardsci.tensor._api import ShardTensor, from_local_spec, redistribute
from shardsci.tensor._collectives import AxisGroup, axis_group, broadcast, exchange
from shardsci.tensor._layout_inference import explicit_dim_sizes
from shardsci.tensor._metadata import DTYPES, MAX_DIMS
from shardsci.tensor._spec import ShardTensorSpec, replicated_spec

__all__ = ["distribute_tensor", "scatter_tensor"]

_NO_TENSOR, _UNDESCRIBABLE = -1, -2  # error codes in the metadata header


def scatter_tensor(
    tensor: torch.Tensor | None,
    global_src: int,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    sharding_shapes: Mapping[int, Sequence[Sequence[int] | int]] | None = None,
    *,
    global_shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    requires_grad: bool = False,
) -> ShardTensor:
    """Shard a tensor that exists on one rank: every rank receives only its own piece.

    Parameters
    ----------
    tensor : Tensor or None
        The whole tensor on rank ``global_src``; ignored (may be None) elsewhere.
    global_src : int
        Global rank holding the tensor; must belong to ``mesh``.
    mesh : DeviceMesh
    placements : sequence of Placement
        Shard or Replicate, one per mesh axis.
    sharding_shapes : dict, optional
        Mesh axis -> sizes (or local shapes) of the ranks along it; default ``torch.chunk``.
    global_shape, dtype : optional
        When every rank passes both, no metadata is broadcast; otherwise the source's are.
    requires_grad : bool
        Whether the result is a leaf that requires grad.

    Returns
    -------
    ShardTensor
        Shape ``tensor.shape``. The source sends each other rank its piece once (bytes sent:
        the sum of the other ranks' pieces); every rank receives exactly its own piece.

    Raises
    ------
    ValueError
        On every rank, for a source outside the mesh, Partial placements, sizes that do not
        sum to the global size, and, when the metadata is broadcast, a source without a
        tensor or with a dtype it cannot describe. When every rank passes ``global_shape``
        and ``dtype``, only the source can see that its tensor is missing or does not match
        them: it raises alone, before the scatter that the other ranks then wait in.
    """
    group = axis_group(mesh, tuple(range(mesh.ndim)))
    if global_src not in group.global_ranks:
        raise ValueError(
            f"global_src {global_src} is not a rank of the mesh {mesh} (its ranks: "
            f"{sorted(group.global_ranks)})"
        )
    for axis, p in enumerate(placements):
        if isinstance(p, Partial):
            raise ValueError(
                f"scatter_tensor places whole values: got {p} on mesh axis {axis}, expected "
                f"Shard or Replicate"
            )
    src = group.global_ranks.index(global_src)
    is_src = group.index == src
    device = _mesh_device(mesh)
    if global_shape is None or dtype is None:
        global_shape, dtype = _broadcast_metadata(tensor if is_src else None, src, group, device)
    elif is_src and tensor is None:
        raise ValueError(f"rank {global_src} is the source of scatter_tensor but passed no tensor")
    sizes = None
    if sharding_shapes is not None:
        sizes = explicit_dim_sizes(sharding_shapes, placements, mesh, global_shape)
    spec = ShardTensorSpec.build(mesh, placements, global_shape, dtype, sizes)
    if is_src and (tuple(tensor.shape) != tuple(global_shape) or tensor.dtype != dtype):
        raise ValueError(
            f"the source tensor has shape {tuple(tensor.shape)} and dtype {tensor.dtype}, but "
            f"global_shape={tuple(global_shape)} and dtype={dtype} were given"
        )
    members = [_coordinate_of(mesh, rank) for rank in group.global_ranks]
    pieces = [spec.narrow(tensor.to(device), c) for c in members] if is_src else [None] * group.size

    def shape_of(sender: int, receiver: int) -> tuple[int, ...]:
        return (
            tuple(spec.local_shape(members[receiver]))
            if sender == src
            else (0,) * len(global_shape)
        )

    received = exchange(group, pieces, shape_of, dtype=dtype, device=device, kind="scatter")
    local = received[src]
    if is_src:
        local = local.clone()
    return ShardTensor(local, spec, requires_grad=requires_grad)


def distribute_tensor(
    tensor: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    sharding_shapes: Mapping[int, Sequence[Sequence[int] | int]] | None = None,
) -> ShardTensor:
    """Shard a tensor that every rank holds whole: each keeps its piece, no communication.

    Differentiable: the gradient of ``tensor`` is the gradient of the result, gathered (the
    whole gradient on every rank, as for any Replicate input).
    """
    sizes = None
    if sharding_shapes is not None:
        sizes = explicit_dim_sizes(sharding_shapes, placements, mesh, tensor.shape)
    spec = ShardTensorSpec.build(
        mesh, placements, tensor.shape, tensor.dtype, sizes, stride=tensor.stride()
    )
    # Replicate -> spec is a local slice forward; its backward gathers the gradient.
    return redistribute(from_local_spec(tensor, replicated_spec(tensor, mesh)), spec)


def _coordinate_of(mesh: DeviceMesh, rank: int) -> tuple[int, ...]:
    return tuple(int(c[0]) for c in (mesh.mesh == rank).nonzero(as_tuple=True))


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())


def _broadcast_metadata(
    tensor: torch.Tensor | None, src: int, group: AxisGroup, device: torch.device
) -> tuple[list[int], torch.dtype]:
    """The source's shape and dtype, on every rank. A source without a tensor, or with one it
    cannot describe, sends an error code instead, so that every rank raises."""
    header = torch.zeros(2 + MAX_DIMS, dtype=torch.int64, device=device)
    if group.index == src:
        if tensor is None:
            header[0] = _NO_TENSOR
        elif tensor.dtype not in DTYPES or tensor.ndim > MAX_DIMS:
            header[0] = _UNDESCRIBABLE
        else:
            header[0] = tensor.ndim
            header[1] = DTYPES.index(tensor.dtype)
            header[2 : 2 + tensor.ndim] = torch.tensor(tensor.shape)
    header = broadcast(
        header if group.index == src else None,
        src,
        group,
        shape=header.shape,
        dtype=torch.int64,
        device=device,
    ).tolist()
    source = group.global_ranks[src]
    if header[0] == _NO_TENSOR:
        raise ValueError(f"rank {source} is the source of scatter_tensor but passed no tensor")
    if header[0] == _UNDESCRIBABLE:
        raise ValueError(
            f"scatter_tensor cannot send the metadata of the tensor on rank {source} (a dtype "
            f"outside {[str(d) for d in DTYPES]} or more than {MAX_DIMS} dims); pass "
            f"global_shape and dtype on every rank"
        )
    return header[2 : 2 + header[0]], DTYPES[header[1]]
