"""Ranks that do the same work: one simulated rank stands for each class.

A rank's collectives, bytes and memory depend on the global layouts of the step's tensors
(the same on every rank) and on where the rank sits in them: its own shard extents and those
of its near neighbours along each group of mesh axes that shards a dim, and whether it is at
an edge of that group. Two ranks whose view is the same for every layout of the step are in
one class. The view spans one neighbour each side, or two when some shard is narrower than
four cells (a halo may then reach past the nearest neighbour); the data-parallel axis, which
shards no field, does not split classes. ``tests/test_dry_run.py`` checks the classes on
real ranks: every rank's measured figures equal its class's prediction.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from torch.distributed.device_mesh import DeviceMesh

from shardsci.tensor import ShardTensorSpec
from shardsci.tensor._spec import index_over_axes

__all__ = ["rank_classes"]

_EDGE = -1


def rank_classes(root: DeviceMesh, specs: Iterable[ShardTensorSpec]) -> list[list[int]]:
    """Global ranks of ``root`` grouped into classes, each sorted, classes by first rank.

    Parameters
    ----------
    root : DeviceMesh
        The run's whole mesh; specs may live on sub-meshes of it with named axes.
    specs : iterable of ShardTensorSpec
        Every layout the step produced.
    """
    tables = _shard_tables(root, specs)
    grid = root.mesh
    classes: dict[tuple, list[int]] = {}
    for coordinate in itertools.product(*(range(n) for n in grid.shape)):
        key = tuple(
            _view(index_over_axes(coordinate, axes, root.mesh.shape), sizes)
            for axes, sizes in tables
        )
        classes.setdefault(key, []).append(int(grid[coordinate]))
    return sorted((sorted(ranks) for ranks in classes.values()), key=lambda ranks: ranks[0])


def _shard_tables(
    root: DeviceMesh, specs: Iterable[ShardTensorSpec]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Distinct (root mesh axes, shard extents) of every sharded dim of ``specs``."""
    root_names = root.mesh_dim_names
    tables = set()
    for spec in specs:
        names = spec.mesh.mesh_dim_names
        for sharding in spec.shardings:
            if spec.mesh is root or names is None or root_names is None:
                axes = sharding.axes
            else:
                axes = tuple(root_names.index(names[a]) for a in sharding.axes)
            tables.add((axes, sharding.sizes))
    return sorted(tables)


def _view(index: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
    reach = 1 if min(sizes) >= 4 else 2
    return tuple(
        sizes[j] if 0 <= j < len(sizes) else _EDGE for j in range(index - reach, index + reach + 1)
    )
