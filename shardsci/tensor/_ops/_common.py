"""Small helpers shared by the op handler families."""

from __future__ import annotations

from collections.abc import Sequence

from shardsci.tensor._collectives import AxisGroup, axis_group
from shardsci.tensor._spec import DimSharding, ShardTensorSpec

__all__ = ["arg", "dim_layout", "normalized_dims", "sharded_among"]


def arg(args: tuple, kwargs: dict, index: int, name: str, default: object = None) -> object:
    """An op argument by position or keyword."""
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def normalized_dims(dims: int | Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    """Reduction dims as sorted non-negative ints; ``None`` or ``[]`` means all dims."""
    if dims is None or (not isinstance(dims, int) and len(dims) == 0):
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = (dims,)
    return tuple(sorted({d % ndim if ndim else d for d in dims}))


def sharded_among(spec: ShardTensorSpec, dims: Sequence[int]) -> list[int]:
    """The dims in ``dims`` that are sharded."""
    return [s.dim for s in spec.shardings if s.dim in dims]


def dim_layout(spec: ShardTensorSpec, dim: int) -> tuple[DimSharding, AxisGroup, list[int]]:
    """How sharded ``dim`` is laid out: its sharding, the ranks along its mesh axes (this
    rank's position among them is ``group.index``) and where each one's shard starts."""
    sharding = spec.sharding_by_dim[dim]
    starts, running = [], 0
    for size in sharding.sizes:
        starts.append(running)
        running += size
    return sharding, axis_group(spec.mesh, sharding.axes), starts
