"""Where each rank's shard lies in the global tensor, worked out from a Layout alone.

The redistribution and scatter tests check the library against these boxes, so they follow
the definition of a layout (NOTE [Shard sizes are a global, rank-independent table] in
``shardsci/tensor/_spec.py``) without calling the library's spec or planner: a tensor dim
sharded over mesh axes ``(a_0, ..., a_k)`` is split into a flat table of extents, row-major
over those axes' coordinates, ``torch.chunk`` sizes (each piece chunked again) by default.
Partial axes hold the whole extent, like Replicate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.tensor import Partial, Shard

from shardsci.testing import Layout

Box = tuple[tuple[int, int], ...]


def chunk_sizes(extent: int, parts: Sequence[int]) -> tuple[int, ...]:
    """``torch.chunk`` extents of ``extent`` over ``parts[0]``, each chunked over ``parts[1]``..."""
    pieces = [extent]
    for n in parts:
        split = [[len(c) for c in torch.arange(p).chunk(n)] if p else [] for p in pieces]
        pieces = [s for chunks in split for s in chunks + [0] * (n - len(chunks))]
    return tuple(pieces)


def dim_shardings(
    layout: Layout, shape: Sequence[int], mesh_shape: Sequence[int]
) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Tensor dim -> (mesh axes sharding it outermost first, flat extents)."""
    axes_by_dim: dict[int, list[int]] = {}
    for axis, p in enumerate(layout.placements):
        if isinstance(p, Shard):
            axes_by_dim.setdefault(p.dim % len(shape), []).append(axis)
    result = {}
    for dim, default_axes in axes_by_dim.items():
        axes = tuple(layout.order.get(dim, default_axes))
        sizes = layout.sizes.get(dim) or chunk_sizes(shape[dim], [mesh_shape[a] for a in axes])
        result[dim] = (axes, tuple(sizes))
    return result


def box(
    layout: Layout, shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int]
) -> Box:
    """The half-open interval per tensor dim that the rank at ``coordinate`` holds."""
    bounds = [(0, n) for n in shape]
    for dim, (axes, sizes) in dim_shardings(layout, shape, mesh_shape).items():
        flat = 0
        for axis in axes:
            flat = flat * mesh_shape[axis] + coordinate[axis]
        start = sum(sizes[:flat])
        bounds[dim] = (start, start + sizes[flat])
    return tuple(bounds)


def narrow(tensor: torch.Tensor, region: Box) -> torch.Tensor:
    for dim, (start, stop) in enumerate(region):
        tensor = tensor.narrow(dim, start, stop - start)
    return tensor


def volume(region: Box) -> int:
    return math.prod(max(0, stop - start) for start, stop in region)


def overlap(a: Box, b: Box) -> Box:
    return tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))


def coordinates(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    """Every mesh coordinate, in rank order (the mesh is ``arange(world).view(shape)``)."""
    return [
        tuple(int(c) for c in torch.unravel_index(torch.tensor(r), tuple(mesh_shape)))
        for r in range(math.prod(mesh_shape))
    ]


def partial_index(layout: Layout, mesh_shape: Sequence[int], coordinate: Sequence[int]) -> int:
    """Flat index, row-major over the Partial axes, of the partial value this rank holds."""
    flat = 0
    for axis, p in enumerate(layout.placements):
        if isinstance(p, Partial):
            flat = flat * mesh_shape[axis] + coordinate[axis]
    return flat
