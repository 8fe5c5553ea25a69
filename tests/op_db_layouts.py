"""The rules by which the op-database sweep (``tests/op_db_sweep.py``) shards any sample's
first tensor argument: uneven, empty and random shards on 1-D and 2x2 meshes
(``SWEEP_LAYOUTS``)."""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Shard

from shardsci.testing import Layout


def two_uneven(extent: int) -> tuple[int, int]:
    """Two non-empty shards of different sizes that are not ``torch.chunk``'s, where
    possible: 5 -> (2, 3), 4 -> (1, 3), 2 -> (1, 1)."""
    first = extent // 2 if extent % 2 else max(extent // 2 - 1, 1)
    return first, extent - first


def four_with_empty_first(extent: int) -> tuple[int, int, int, int]:
    """Rank 0 empty, the rest split unevenly: 5 -> (0, 3, 1, 1), 2 -> (0, 2, 0, 0)."""
    third = extent // 3
    return 0, extent - 2 * third, third, third


def random_with_empty(extent: int, parts: int, generator: random.Random) -> tuple[int, ...]:
    """``extent`` split into ``parts`` random sizes, at least one of them empty."""
    empty = generator.randrange(parts)
    cuts = sorted(generator.randint(0, extent) for _ in range(parts - 2))
    others = [b - a for a, b in zip([0, *cuts], [*cuts, extent])]
    return (*others[:empty], 0, *others[empty:])


@dataclass(frozen=True)
class SweepLayout:
    """How the op-database sweep shards a sample's first tensor argument.

    Attributes
    ----------
    name : str
        Shown in reports.
    mesh : tuple of int
        Mesh shape; the world size is its product.
    description : str
        What ``layout_for`` does, for the report.
    """

    name: str
    mesh: tuple[int, ...]
    description: str

    @property
    def world(self) -> int:
        return math.prod(self.mesh)

    def layout_for(self, shape: Sequence[int], salt: str = "") -> Layout | None:
        """The layout of a tensor of ``shape``, or None when it has no dims to shard so.
        ``salt`` (the case's name) seeds the random layouts, so each case has its own and
        every rank and every run draws the same."""
        if self.name == "2r-uneven":
            dim = next((d for d, n in enumerate(shape) if n >= 2), None)
            return None if dim is None else Layout((Shard(dim),), {dim: two_uneven(shape[dim])})
        if self.name == "4r-empty":
            dims = [d for d, n in enumerate(shape) if n >= 3] or [
                d for d, n in enumerate(shape) if n >= 1
            ]
            if not dims:
                return None
            dim = dims[-1]
            return Layout((Shard(dim),), {dim: four_with_empty_first(shape[dim])})
        if self.name == "4r-random":
            dims = [d for d, n in enumerate(shape) if n >= 1]
            if not dims:
                return None
            generator = random.Random(zlib.crc32(salt.encode()))
            dim = generator.choice(dims)
            return Layout((Shard(dim),), {dim: random_with_empty(shape[dim], 4, generator)})
        if self.name == "2x2-last":
            if len(shape) < 2 or min(shape[-2:]) < 2:
                return None
            rows, cols = len(shape) - 2, len(shape) - 1
            sizes = {rows: two_uneven(shape[rows]), cols: two_uneven(shape[cols])[::-1]}
            return Layout((Shard(rows), Shard(cols)), sizes)
        dims = [d for d, n in enumerate(shape) if n >= 2][:2]
        if len(dims) < 2:
            return None
        sizes = {d: two_uneven(shape[d]) for d in dims}
        return Layout((Shard(dims[0]), Shard(dims[1])), sizes)


SWEEP_LAYOUTS = {
    layout.name: layout
    for layout in (
        SweepLayout("2r-uneven", (2,), "2 ranks, the first dim of extent >= 2 split unevenly"),
        SweepLayout(
            "4r-empty", (4,), "4 ranks, the last dim of extent >= 3 split with rank 0 empty"
        ),
        SweepLayout(
            "4r-random",
            (4,),
            "4 ranks, a random dim (batch and channels too) split into random sizes, one "
            "or more empty (drawn per case)",
        ),
        SweepLayout(
            "2x2-uneven", (2, 2), "a 2x2 mesh, the first two dims of extent >= 2, each uneven"
        ),
        SweepLayout(
            "2x2-last",
            (2, 2),
            "a 2x2 mesh, 2-D blocks on the last two dims, uneven in opposite directions",
        ),
    )
}
