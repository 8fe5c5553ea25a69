"""Working out a ShardTensor's spec from the shards that ranks hold.

Used by ``ShardTensor.from_local``: ``"infer"`` gathers every rank's shape once and checks
that the shards form one tensor; ``"chunk"`` and explicit sizes need no communication.
Errors are raised from information every rank shares, so all ranks raise the same error; the
one exception is the check of this rank's own shard against ``"chunk"`` or explicit sizes
without ``run_check`` (no communication, so only that rank can see the mismatch).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from shardsci.tensor._collectives import axis_group, exchange
from shardsci.tensor._metadata import DTYPES, MAX_DIMS
from shardsci.tensor._spec import ShardTensorSpec, coordinate_over_axes, nested_chunk_sizes

__all__ = ["explicit_dim_sizes", "sizes_for_from_local"]


def sizes_for_from_local(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    sharding_shapes: str | Mapping,
    shape: Sequence[int] | None,
    run_check: bool,
) -> ShardTensorSpec:
    """The spec of the tensor whose shard on this rank is ``local``.

    With ``"infer"`` or ``run_check``, every rank's shard shape is gathered before anything
    reads this rank's shard, and all checks use the gathered shapes: a bad shard raises the
    same error on every rank instead of leaving the others waiting in a collective.
    """
    mode = _mode(sharding_shapes)
    placements = tuple(placements)
    _check_placement_count(placements, mesh)
    shapes = _gathered_shapes(local, mesh) if mode == "infer" or run_check else None
    placements = _checked_placements(placements, mesh, local.ndim)
    if mode == "infer":
        sizes, global_shape = _sizes_from_shapes(shapes, mesh, placements)
    else:
        if mode == "chunk":
            global_shape = (
                list(shape) if shape is not None else _even_global_shape(local, mesh, placements)
            )
            sizes = _chunk_sizes(global_shape, mesh, placements)
        else:
            sizes = explicit_dim_sizes(sharding_shapes, placements, mesh, None)
            global_shape = list(local.shape)
            for dim, dim_sizes in sizes.items():
                global_shape[dim] = sum(dim_sizes)
        if shapes is not None:
            _check_claimed(shapes, mesh, placements, sizes, global_shape)
    if shape is not None and tuple(shape) != tuple(global_shape):
        raise ValueError(
            f"the shards form a tensor of shape {tuple(global_shape)}, but shape={tuple(shape)} "
            f"was given"
        )
    spec = ShardTensorSpec.build(
        mesh,
        placements,
        global_shape,
        local.dtype,
        sizes,
        stride=_global_stride(local, global_shape),
    )
    if shapes is None and tuple(local.shape) != tuple(spec.local_shape()):
        raise ValueError(
            f"this rank's shard has shape {tuple(local.shape)}, but the sharding says it should "
            f"be {tuple(spec.local_shape())} (pass run_check=True to check on every rank)"
        )
    return spec


def _mode(sharding_shapes: str | Mapping) -> str:
    if isinstance(sharding_shapes, str) and sharding_shapes in ("infer", "chunk"):
        return sharding_shapes
    if isinstance(sharding_shapes, Mapping):
        return "explicit"
    raise ValueError(
        f"sharding_shapes must be 'infer', 'chunk' or a dict from mesh axis to the local "
        f"shapes along it, got {sharding_shapes!r}"
    )


def _check_placement_count(placements: tuple[Placement, ...], mesh: DeviceMesh) -> None:
    if len(placements) != mesh.ndim:
        raise ValueError(
            f"got {len(placements)} placements {placements} for a {mesh.ndim}-D mesh; expected "
            f"one placement per mesh axis"
        )


def _checked_placements(
    placements: tuple[Placement, ...], mesh: DeviceMesh, ndim: int
) -> tuple[Placement, ...]:
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            if not -ndim <= p.dim < ndim:
                raise ValueError(
                    f"Shard({p.dim}) on mesh axis {axis} is out of range for a {ndim}-D shard"
                )
        elif not isinstance(p, (Replicate, Partial)):
            raise ValueError(f"unsupported placement {p!r} on mesh axis {axis}")
    return tuple(Shard(p.dim % ndim) if isinstance(p, Shard) else p for p in placements)


def _check_claimed(
    shapes: list[tuple[int, ...]],
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    sizes: Mapping[int, Sequence[int]],
    global_shape: Sequence[int],
) -> None:
    """``run_check``: the claimed sizes and global shape are those of the gathered shards."""
    inferred, inferred_shape = _sizes_from_shapes(shapes, mesh, placements)
    claimed = {dim: list(dim_sizes) for dim, dim_sizes in sizes.items()}
    if inferred != claimed or list(inferred_shape) != list(global_shape):
        raise ValueError(
            f"the shards held by the ranks have sizes {inferred} along their sharded dims "
            f"(global shape {tuple(inferred_shape)}), but the given sharding says {claimed} "
            f"(global shape {tuple(global_shape)})"
        )


def _axes_by_dim(placements: Sequence[Placement]) -> dict[int, tuple[int, ...]]:
    axes: dict[int, list[int]] = {}
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            axes.setdefault(p.dim, []).append(axis)
    return {dim: tuple(a) for dim, a in axes.items()}


# ---------------------------------------------------------------------------- "infer"
def _gathered_shapes(local: torch.Tensor, mesh: DeviceMesh) -> list[tuple[int, ...]]:
    """Every rank's shard shape (by flat mesh index), after checking on every rank alike that
    the shards agree on their number of dims and dtype."""
    header = torch.zeros(2 + MAX_DIMS, dtype=torch.int64, device=local.device)
    header[0] = local.ndim
    header[1] = DTYPES.index(local.dtype) if local.dtype in DTYPES else -1
    kept = min(local.ndim, MAX_DIMS)
    header[2 : 2 + kept] = torch.tensor(local.shape[:kept], dtype=torch.int64)
    group = axis_group(mesh, tuple(range(mesh.ndim)))
    received = exchange(
        group,
        [header] * group.size,
        lambda src, dst: header.shape,
        dtype=torch.int64,
        device=local.device,
        kind="all_gather",
    )
    headers = [r.tolist() for r in received]
    ndims = [h[0] for h in headers]
    if max(ndims) > MAX_DIMS:
        raise ValueError(f"shards with more than {MAX_DIMS} dims are not supported: {ndims}")
    shapes = [tuple(h[2 : 2 + h[0]]) for h in headers]
    if len(set(ndims)) > 1:
        raise ValueError(
            "the shards have different numbers of dims: "
            + ", ".join(f"rank {r}: {shape}" for r, shape in enumerate(shapes))
        )
    if len({h[1] for h in headers}) > 1:
        names = [str(DTYPES[h[1]]) if h[1] >= 0 else "other" for h in headers]
        raise ValueError(f"the shards have different dtypes: {names} (by flat mesh index)")
    return shapes


def _sizes_from_shapes(
    shapes: list[tuple[int, ...]], mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> tuple[dict[int, list[int]], list[int]]:
    axes_by_dim = _axes_by_dim(placements)
    mesh_shape = tuple(mesh.shape)
    sizes: dict[int, list[int]] = {}
    global_shape = list(shapes[0])
    for dim in range(len(global_shape)):
        axes = axes_by_dim.get(dim, ())
        extents = _extent_table(shapes, dim, axes, mesh_shape)
        if axes:
            sizes[dim] = extents
            global_shape[dim] = sum(extents)
    return sizes, global_shape


def _extent_table(
    shapes: list[tuple[int, ...]], dim: int, axes: tuple[int, ...], mesh_shape: tuple[int, ...]
) -> list[int]:
    """Extents along ``dim`` row-major over ``axes``, checking they depend on nothing else."""
    table: dict[tuple[int, ...], int] = {}
    for flat, shard_shape in enumerate(shapes):
        coordinate = coordinate_over_axes(flat, range(len(mesh_shape)), mesh_shape)
        key = tuple(coordinate[a] for a in axes)
        seen = table.setdefault(key, shard_shape[dim])
        if seen != shard_shape[dim]:
            where = "is not sharded" if not axes else f"is sharded over mesh axes {axes}"
            raise ValueError(
                f"tensor dim {dim} {where}, but shards that should agree on its size do not: "
                f"rank at mesh coordinate {tuple(coordinate.values())} has shape {shard_shape}, another has "
                f"size {seen} there; all shapes: {shapes}"
            )
    return [table[key] for key in sorted(table)]


# ---------------------------------------------------------------------------- "chunk"
def _even_global_shape(
    local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> list[int]:
    shape = list(local.shape)
    for dim, axes in _axes_by_dim(placements).items():
        shape[dim] *= math.prod(mesh.shape[a] for a in axes)
    return shape


def _chunk_sizes(
    global_shape: Sequence[int], mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> dict[int, tuple[int, ...]]:
    return {
        dim: nested_chunk_sizes(global_shape[dim], [mesh.shape[a] for a in axes])
        for dim, axes in _axes_by_dim(placements).items()
    }


# ---------------------------------------------------------------------------- explicit
def explicit_dim_sizes(
    sharding_shapes: Mapping[int, Sequence[Sequence[int] | int]],
    placements: Sequence[Placement],
    mesh: DeviceMesh,
    global_shape: Sequence[int] | None,
) -> dict[int, list[int]]:
    """Tensor dim -> sizes, from PhysicsNeMo's mesh axis -> local shapes (or plain sizes).

    Checks everything every rank can check alike: each sharded axis is given, with one entry
    per rank along it, and (when ``global_shape`` is known) sizes that sum to its extent.
    """
    axes_by_dim = _axes_by_dim(placements)
    given = set(sharding_shapes)
    sharded_axes = {a for axes in axes_by_dim.values() for a in axes}
    if given != sharded_axes:
        raise ValueError(
            f"sharding_shapes must give exactly the sharded mesh axes {sorted(sharded_axes)}, "
            f"got {sorted(given)}"
        )
    sizes: dict[int, list[int]] = {}
    for dim, axes in axes_by_dim.items():
        if len(axes) > 1:
            raise ValueError(
                f"tensor dim {dim} is sharded over several mesh axes {axes}; explicit "
                f"sharding_shapes cannot describe nested shards, use sharding_shapes='infer'"
            )
        entries = sharding_shapes[axes[0]]
        if len(entries) != mesh.shape[axes[0]]:
            raise ValueError(
                f"sharding_shapes[{axes[0]}] has {len(entries)} entries, but mesh axis "
                f"{axes[0]} has {mesh.shape[axes[0]]} ranks"
            )
        sizes[dim] = [int(e) if isinstance(e, int) else int(e[dim]) for e in entries]
        if global_shape is not None and sum(sizes[dim]) != global_shape[dim]:
            raise ValueError(
                f"sizes {sizes[dim]} for tensor dim {dim} sum to {sum(sizes[dim])}, but its "
                f"global size is {global_shape[dim]}"
            )
    return sizes


def _global_stride(local: torch.Tensor, global_shape: Sequence[int]) -> tuple[int, ...]:
    """Contiguous strides of ``global_shape`` in the memory order of ``local``'s dims."""
    order = sorted(range(local.ndim), key=lambda d: (-local.stride(d), -d)) if local.ndim else []
    stride = [0] * len(global_shape)
    running = 1
    for dim in reversed(order):
        stride[dim] = running
        running *= max(global_shape[dim], 1)
    return tuple(stride)
