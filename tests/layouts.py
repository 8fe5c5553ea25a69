"""Shard layouts the op tests run on: even, uneven and empty shards, 1-D and 2-D meshes."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.tensor import Replicate, Shard

from shardsci.testing import Layout


@dataclass(frozen=True)
class Sharded:
    """A global shape and how it is sharded.

    Attributes
    ----------
    name : str
        Shown in test ids.
    mesh : tuple of int
        Mesh shape; the world size is its product.
    shape : tuple of int
        Global shape of the main input.
    layout : Layout
        Its sharding.
    """

    name: str
    mesh: tuple[int, ...]
    shape: tuple[int, ...]
    layout: Layout

    @property
    def world(self) -> int:
        return math.prod(self.mesh)

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Case(Sharded):
    """A ``Sharded`` input plus ``alternate``: the same placements with other shard sizes (for
    operands sharded with different boundaries)."""

    alternate: Layout

    @property
    def sharded_dim(self) -> int:
        return next(p.dim for p in self.layout.placements if isinstance(p, Shard))


def _shard(dim: int, sizes: tuple[int, ...], other: tuple[int, ...]) -> tuple[Layout, Layout]:
    return Layout((Shard(dim),), {dim: sizes}), Layout((Shard(dim),), {dim: other})


CASES = [
    Case("2r-even-4/4", (2,), (8, 3, 4), *_shard(0, (4, 4), (6, 2))),
    Case("2r-5/2", (2,), (7, 3, 4), *_shard(0, (5, 2), (2, 5))),
    Case("4r-40/33/30/28", (4,), (131, 3, 2), *_shard(0, (40, 33, 30, 28), (28, 30, 33, 40))),
    Case("4r-0/3/4/2", (4,), (9, 3, 4), *_shard(0, (0, 3, 4, 2), (3, 3, 3, 0))),
    Case("4r-dim1-2/0/5/1", (4,), (3, 8, 4), *_shard(1, (2, 0, 5, 1), (1, 2, 2, 3))),
    Case(
        "2x2-block",
        (2, 2),
        (5, 4, 3),
        Layout((Shard(0), Shard(1)), {0: (3, 2), 1: (1, 3)}),
        Layout((Shard(0), Shard(1)), {0: (1, 4), 1: (2, 2)}),
    ),
    Case(
        "2x2-nested",
        (2, 2),
        (6, 3, 4),
        Layout((Shard(0), Shard(0)), {0: (2, 1, 0, 3)}),
        Layout((Shard(0), Shard(0)), {0: (1, 2, 2, 1)}),
    ),
    Case(
        "2x2-replicate-shard",
        (2, 2),
        (3, 5, 4),
        Layout((Replicate(), Shard(1)), {1: (4, 1)}),
        Layout((Replicate(), Shard(1)), {1: (0, 5)}),
    ),
]


# (N, C, H, W) fields split along H or W: 2 ranks uneven, 4 ranks with an empty shard, 4 ranks
# even, and a 2x2 block decomposition.
SPATIAL_2D = [
    Sharded("2r-H-7/4", (2,), (2, 3, 11, 6), Layout((Shard(2),), {2: (7, 4)})),
    Sharded("4r-H-3/0/5/3", (4,), (2, 3, 11, 6), Layout((Shard(2),), {2: (3, 0, 5, 3)})),
    Sharded("4r-W-even", (4,), (1, 2, 5, 12), Layout((Shard(3),), {3: (3, 3, 3, 3)})),
    Sharded(
        "2x2-block", (2, 2), (2, 2, 11, 9), Layout((Shard(2), Shard(3)), {2: (6, 5), 3: (4, 5)})
    ),
]
