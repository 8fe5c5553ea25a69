"""Small helpers shared by the op handler families."""

from __future__ import annotations

from collections.abc import Sequence

from shardsci.tensor._spec import ShardTensorSpec

__all__ = ["arg", "normalized_dims", "sharded_among"]


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
