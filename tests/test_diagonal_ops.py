"""``tril``, ``triu`` and ``diagonal`` (with ``diag``, ``diagonal_copy``, ``diag_embed``'s
backward) on sharded matrix dims against one process: values, input gradients, float64,
uneven and empty shards, 1-D meshes of 2 and 4 ranks and 2x2 blocks, and the output's layout.

Triangles keep the input's layout. A diagonal cell belongs to the rank holding the matrix
cell it reads (NOTE [An output cell belongs to the shard it depends on]); the expected
layouts are written out by hand below, from the cells each rank holds.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from shardsci.testing import Layout, check_against_reference, get_mesh, run_on_ranks
from tests.layouts import Sharded

TWO_RANKS = Sharded("2r-rows-2/3", (2,), (3, 5, 4), Layout((Shard(1),), {1: (2, 3)}))
EMPTY = Sharded("4r-rows-0/3/1/2", (4,), (6, 6), Layout((Shard(0),), {0: (0, 3, 1, 2)}))
BLOCKS = Sharded(
    "2x2-rows-2/3-cols-4/2", (2, 2), (2, 5, 6), Layout((Shard(1), Shard(2)), {1: (2, 3), 2: (4, 2)})
)
BATCH_AND_COLS = Sharded(
    "2x2-batch-1/3-cols-2/1",
    (2, 2),
    (4, 5, 3),
    Layout((Shard(0), Shard(2)), {0: (1, 3), 2: (2, 1)}),
)


def _triangles_body(case: Sharded) -> None:
    mesh = get_mesh(case.mesh)
    x = torch.randn(case.shape, dtype=torch.float64)
    for op in (torch.tril, torch.triu):
        for diagonal in (-2, 0, 1, 3):
            check_against_reference(
                lambda a, op=op, k=diagonal: op(a, k),
                [x],
                [case.layout],
                mesh,
                what=f"{op.__name__}({diagonal})",
            )


@pytest.mark.parametrize("case", [TWO_RANKS, EMPTY, BLOCKS, BATCH_AND_COLS], ids=str)
def test_triangles_keep_the_layout(case: Sharded) -> None:
    run_on_ranks(case.world, _triangles_body, case)


# Case -> [(offset, dim1, dim2, the diagonal's layout)], worked out cell by cell: cell k of
# offset o reads row k - min(o, 0) and column k + max(o, 0) of the (dim1, dim2) matrix.
DIAGONALS = {
    # rows 0-1 | 2-4 on the 2 ranks; diagonal dim last, the batch dim first
    TWO_RANKS.name: [
        (1, 1, 2, Layout((Shard(1),), {1: (2, 1)})),  # rows 0, 1 | 2
        (0, 1, 2, Layout((Shard(1),), {1: (2, 2)})),  # rows 0, 1 | 2, 3
        (-2, 1, 2, Layout((Shard(1),), {1: (0, 3)})),  # rows 2, 3, 4
        (0, 2, 1, Layout((Shard(1),), {1: (2, 2)})),  # dim1 = columns: same cells
        (0, 0, 2, Layout((Shard(0),), {0: (2, 3)})),  # rows kept, diagonal of dims 0, 2
    ],
    # rows: none | 0-2 | 3 | 4-5
    EMPTY.name: [
        (-1, 0, 1, Layout((Shard(0),), {0: (0, 2, 1, 2)})),  # rows 1..5
        (2, 0, 1, Layout((Shard(0),), {0: (0, 3, 1, 0)})),  # rows 0..3
        (0, 1, 0, Layout((Shard(0),), {0: (0, 3, 1, 2)})),
    ],
    # rows 0-1 | 2-4 on axis 0, columns 0-3 | 4-5 on axis 1: cells (row, col) owners
    # (0,0) (0,0) (1,0) (1,0) (1,1) for offset 0, flat over (axis 0, axis 1)
    BLOCKS.name: [
        (0, 1, 2, Layout((Shard(1), Shard(1)), {1: (2, 0, 2, 1)})),
        (1, 1, 2, Layout((Shard(1), Shard(1)), {1: (2, 0, 1, 2)})),  # columns 1..5
        (-3, 1, 2, Layout((Shard(1), Shard(1)), {1: (0, 0, 2, 0)})),  # rows 3, 4
        # dim1 = columns: the same cells, over the axes in increasing order
        (0, 2, 1, Layout((Shard(1), Shard(1)), {1: (2, 0, 2, 1)})),
    ],
    # batch 0 | 1-3 on axis 0 (kept, renumbered), columns 0-1 | 2 on axis 1
    BATCH_AND_COLS.name: [
        (0, 1, 2, Layout((Shard(0), Shard(1)), {0: (1, 3), 1: (2, 1)})),
        (-1, 1, 2, Layout((Shard(0), Shard(1)), {0: (1, 3), 1: (2, 1)})),  # columns 0, 1, 2
        (-1, 2, 1, Layout((Shard(0), Shard(1)), {0: (1, 3), 1: (1, 1)})),  # dim1 = cols 1, 2
    ],
}


def _diagonals_body(case: Sharded) -> None:
    mesh = get_mesh(case.mesh)
    x = torch.randn(case.shape, dtype=torch.float64)
    for offset, dim1, dim2, expected in DIAGONALS[case.name]:
        for op in (torch.diagonal, torch.diagonal_copy):
            check_against_reference(
                lambda a, op=op, o=offset, d1=dim1, d2=dim2: op(a, o, d1, d2),
                [x],
                [case.layout],
                mesh,
                out_layouts=[expected],
                what=f"{op.__name__}({offset}, {dim1}, {dim2})",
            )


@pytest.mark.parametrize("case", [TWO_RANKS, EMPTY, BLOCKS, BATCH_AND_COLS], ids=str)
def test_a_diagonal_stays_where_its_cells_are(case: Sharded) -> None:
    run_on_ranks(case.world, _diagonals_body, case)


# diag_embed: the batch dim keeps its layout; a sharded vector dim shards the matrix's rows,
# each rank's elements on its own rows, the |offset| rows without one on the first (offset
# < 0) or last (offset > 0) rank holding elements.
EMBEDDED_VECTOR = Sharded("4r-vector-0/3/1/2", (4,), (3, 6), Layout((Shard(1),), {1: (0, 3, 1, 2)}))
EMBEDDED_BATCH = Sharded("2r-batch-1/3", (2,), (4, 3), Layout((Shard(0),), {0: (1, 3)}))
EMBEDDINGS = {
    EMBEDDED_VECTOR.name: [
        (0, Layout((Shard(1),), {1: (0, 3, 1, 2)})),
        (-1, Layout((Shard(1),), {1: (0, 4, 1, 2)})),
        (2, Layout((Shard(1),), {1: (0, 3, 1, 4)})),
    ],
    EMBEDDED_BATCH.name: [
        (0, Layout((Shard(0),), {0: (1, 3)})),
        (1, Layout((Shard(0),), {0: (1, 3)})),
    ],
}


def _embed_body(case: Sharded) -> None:
    mesh = get_mesh(case.mesh)
    x = torch.randn(case.shape, dtype=torch.float64)
    for offset, expected in EMBEDDINGS[case.name]:
        check_against_reference(
            lambda a, o=offset: torch.diag_embed(a, o),
            [x],
            [case.layout],
            mesh,
            out_layouts=[expected],
            what=f"diag_embed({offset})",
        )


@pytest.mark.parametrize("case", [EMBEDDED_VECTOR, EMBEDDED_BATCH], ids=str)
def test_diag_embed_puts_each_element_on_its_own_rank(case: Sharded) -> None:
    run_on_ranks(case.world, _embed_body, case)


def _scatter_body(case: Sharded) -> None:
    mesh = get_mesh(case.mesh)
    x = torch.randn(case.shape, dtype=torch.float64)
    for offset, dim1, dim2, _ in DIAGONALS[case.name]:
        src = torch.randn(x.diagonal(offset, dim1, dim2).shape, dtype=torch.float64)
        check_against_reference(
            lambda a, s, o=offset, d1=dim1, d2=dim2: torch.diagonal_scatter(a, s, o, d1, d2),
            [x, src],
            [case.layout, None],
            mesh,
            what=f"diagonal_scatter({offset}, {dim1}, {dim2})",
        )


@pytest.mark.parametrize("case", [TWO_RANKS, EMPTY, BLOCKS], ids=str)
def test_diagonal_scatter_keeps_the_layout(case: Sharded) -> None:
    """The plain source's gradient too (the diagonal of the output's gradient)."""
    run_on_ranks(case.world, _scatter_body, case)
