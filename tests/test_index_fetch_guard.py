"""An index read that replicates its output, or a fetch that leaves a rank holding every row of
the indexed dim, at least half of them fetched, is a gather the guard governs (NOTE [Gathers
an op was not asked to make], ``check_replicated_read``, ``check_fetch``), against one
process, float64.

A masked read (aten ``_unsafe_masked_index``) through a 2-D index into dim 0 reaching four of
five rows, which no split of its entries' dims follows, so the read is replicated over dim 0's
axes (a 1-D index is split by its entries' owners instead: NOTE [A selection through a
replicated index is split by its entries' owners]), on 2 uneven ranks, 4 ranks with empty
shards and a 2x2 mesh: under ``"warn"`` one ``GatherWarning`` naming the op and the bytes
(forward and backward), values, gradient and layout as one process; under ``"error"`` a
``GatherError`` on every rank before any byte moves. Halo-sized fetches that keep the layout
(each rank's range of a shifted or reversed index reading a neighbour's rows, a sharded index
naming its neighbours' rows, a permutation on an uneven split whose big shard fetches the row
it lacks) run under ``"error"``. A sharded index whose one rank names every row is refused on
every rank after the plan's exchange of counts, before the rows move. ``gather`` with an
index of the input's shape on a 2x2 mesh, where the ranks of one column of the mesh read every
cell of the other rank's block, fetches only those cells and is not refused.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from shardsci import GatherError, gather_policy, record_gathers
from shardsci.handlers import from_local_spec
from shardsci.tensor import _gather_guard
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    assert_raises_all_ranks,
    check_against_reference,
    count_traffic,
    get_mesh,
    run_on_ranks,
)

aten = torch.ops.aten

SHAPE = (5, 4, 3)
OP = "aten._unsafe_masked_index.default"
LAYOUTS = {
    "2r-uneven": ((2,), Layout((Shard(0),), {0: (2, 3)})),
    "4r-empty": ((4,), Layout((Shard(0),), {0: (2, 0, 3, 0)})),
    "2x2-uneven": ((2, 2), Layout((Shard(0), Shard(1)), {0: (2, 3), 1: (1, 3)})),
}
# x[i], i of shape (2, 3) reaching rows 0, 1, 2 and 4: a replicated read.
ROWS = torch.tensor([[0, 4, 1], [0, 2, 1]])


def _masked_read(x: torch.Tensor) -> torch.Tensor:
    mask = torch.tensor([True, True, False]).repeat(2, 1)[:, :, None, None].expand(2, 3, 4, 3)
    return aten._unsafe_masked_index.default(x, mask, [ROWS], 0.5)


def _read_layout(layout: Layout) -> Layout:
    """The read's layout: the index's dims replicated, ``x``'s dim 1 (now dim 2) kept."""
    if 1 not in layout.sizes:
        return Layout((Replicate(),) * len(layout.placements), {})
    return Layout((Replicate(), Shard(2)), {2: tuple(layout.sizes[1])})


def _bytes(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:.1f} KiB"


def _expected_bytes(layout: Layout) -> tuple[int, int, int]:
    """(bytes of the read ``x[i]``, on the most loaded rank, of ``x`` on the most loaded
    rank before): the message's figures."""
    others = max(layout.sizes.get(1, (SHAPE[1],))) * SHAPE[2] * 8
    read = ROWS.numel() * math.prod(SHAPE[1:]) * 8
    return read, ROWS.numel() * others, max(layout.sizes[0]) * others


def _warn_body(name: str) -> list[str]:
    mesh_shape, layout = LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(SHAPE, dtype=torch.float64)
    _gather_guard.forget_warnings()
    with warnings.catch_warnings(record=True) as caught, gather_policy("warn"):
        warnings.simplefilter("always")
        check_against_reference(
            _masked_read, [x], [layout], mesh, out_layouts=[_read_layout(layout)], what=name,
            not_a_gather="it is one, said",
        )  # fmt: skip
    return [str(w.message) for w in caught if w.category.__name__ == "GatherWarning"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_replicated_read_is_said_once_with_its_bytes(name: str) -> None:
    results = run_on_ranks(math.prod(LAYOUTS[name][0]), _warn_body, name)
    assert all(r == results[0] for r in results), results
    assert len(results[0]) == 1, results[0]  # forward and backward: one warning
    message = results[0][0]
    read, after, before = _expected_bytes(LAYOUTS[name][1])
    assert message.startswith(f"shardsci: {OP} replicated its read through an index"), message
    assert f"of a float64 tensor of shape {SHAPE}" in message, message
    assert f"holds up to {_bytes(after)}, up to {_bytes(before)} before" in message, message
    assert f"({_bytes(read)} in all)" in message, message


def _refused_body(name: str) -> str:
    mesh_shape, layout = LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(SHAPE, dtype=torch.float64)
    spec = layout.spec(mesh, x)
    shard = from_local_spec(spec.narrow(x), spec)
    traffic = []

    def attempt() -> None:
        with count_traffic() as counted:
            traffic.append(counted)
            _masked_read(shard)

    with gather_policy("error"):
        error = assert_raises_all_ranks(GatherError, OP, attempt)
    assert_all_ranks(traffic[0].received == 0, f"received {traffic[0].received} B first")
    # no rank was left in a collective: the read runs now and agrees with one process
    with gather_policy("allow"):
        out = _masked_read(shard).full_tensor()
    assert_all_ranks(torch.equal(out, _masked_read(x)), "the read after the refusal differs")
    return str(error)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_replicated_read_is_refused_on_every_rank(name: str) -> None:
    results = run_on_ranks(math.prod(LAYOUTS[name][0]), _refused_body, name)
    assert all(r == results[0] for r in results), results
    assert results[0].startswith(f"shardsci refused a gather (gather policy 'error'): {OP}")
    assert "would replicate its read through an index" in results[0], results[0]


# ---------------------------------------------------------------------------- not refused
def _halo_cases(layout: Layout) -> dict[str, tuple]:
    """Fetches that keep ``layout`` (dim 0 of extent 5), no rank holding every row at least
    half fetched: each rank reads its own range of the index."""
    shifted = torch.tensor([1, 2, 3, 4, 0])
    reversed_rows = torch.tensor([4, 3, 2, 1, 0])
    return {
        "x[i], rows shifted by one": lambda x: x[shifted],
        "index_select, rows reversed": lambda x: x.index_select(0, reversed_rows),
    }


def _halo_body(name: str) -> None:
    mesh_shape, layout = LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(SHAPE, dtype=torch.float64)
    for what, fn in _halo_cases(layout).items():
        with gather_policy("error"), record_gathers() as seen:
            check_against_reference(fn, [x], [layout], mesh, what=what)
        assert_all_ranks(not seen, f"{name}: {what}: {seen}")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_halo_sized_fetch_is_not_a_gather(name: str) -> None:
    run_on_ranks(math.prod(LAYOUTS[name][0]), _halo_body, name)


def _uneven_permutation_body() -> None:
    """(4, 1) rows: the first rank's range of a permutation reads the last row, the last
    rank's its own; the first rank then holds every row, one of five fetched."""
    mesh = get_mesh((2,))
    torch.manual_seed(0)
    x = torch.randn(SHAPE, dtype=torch.float64)
    layout = Layout((Shard(0),), {0: (4, 1)})
    permutation = torch.tensor([4, 0, 1, 2, 3])
    with gather_policy("error"):
        check_against_reference(lambda t: t[permutation], [x], [layout], mesh)


def test_a_big_shard_fetching_the_rows_it_lacks_is_not_a_gather() -> None:
    run_on_ranks(2, _uneven_permutation_body)


# ---------------------------------------------------------------------------- sharded index
def _sharded_index_body() -> None:
    mesh = get_mesh((2,))
    torch.manual_seed(0)
    x = torch.randn(SHAPE, dtype=torch.float64)
    layout = Layout((Shard(0),), {0: (2, 3)})
    spec = layout.spec(mesh, x)
    shard = from_local_spec(spec.narrow(x), spec)

    def select(values: list[int], sizes: tuple[int, int]) -> torch.Tensor:
        index = torch.tensor(values)
        index_spec = Layout((Shard(0),), {0: sizes}).spec(mesh, index)
        return shard.index_select(0, from_local_spec(index_spec.narrow(index), index_spec))

    # the first rank names rows 1 and 2, the second rows 1 to 3: one row fetched each
    with gather_policy("error"):
        out = select([1, 2, 1, 2, 3], (2, 3))
    assert_all_ranks(torch.equal(out.full_tensor(), x[[1, 2, 1, 2, 3]]), "halo values")
    # the first rank's part names every row it lacks: refused on both ranks, once the plan's
    # exchange of counts told every rank what the first one fetches
    with gather_policy("error"):
        assert_raises_all_ranks(
            GatherError, "index_select", select,
            [2, 4, 3, 0, 1], (3, 2),
        )  # fmt: skip
    with gather_policy("allow"):
        out = select([2, 4, 3, 0, 1], (3, 2))
    assert_all_ranks(torch.equal(out.full_tensor(), x[[2, 4, 3, 0, 1]]), "whole values")


def test_a_sharded_index_naming_every_row_on_one_rank_is_refused_on_every_rank() -> None:
    run_on_ranks(2, _sharded_index_body)


# ---------------------------------------------------------------------------- cells
def _one_column_body() -> None:
    """``gather`` along dim 0 of a (4, 4) block on a 2x2 mesh, an index of the input's shape:
    the ranks of mesh column 0 (columns 0-1) read only cells the other rank of their column
    owns, every cell of its block; those of column 1 read their own. Fetching whole rows,
    column 0's ranks held every row and were refused on all four ranks; now each receives
    the 4 cells it reads (32 B), its output's part, and nothing is refused (NOTE [A cell-wise
    read moves cells])."""
    mesh = get_mesh((2, 2))
    torch.manual_seed(0)
    x = torch.randn(4, 4, dtype=torch.float64)
    layout = Layout((Shard(0), Shard(1)), {0: (2, 2), 1: (2, 2)})
    index = torch.arange(4)[:, None].repeat(1, 4)
    index[:, :2] = torch.tensor([[2, 3], [3, 2], [0, 1], [1, 0]])
    spec = layout.spec(mesh, x)
    shard = from_local_spec(spec.narrow(x), spec)
    with gather_policy("error"):
        check_against_reference(lambda t: t.gather(0, index), [x], [layout], mesh)
        with count_traffic() as traffic:
            shard.gather(0, index)
    expected = 32 if mesh.get_coordinate()[1] == 0 else 0
    assert_all_ranks(traffic.received == expected, f"received {traffic.received} B")


def test_a_gather_reading_every_cell_of_a_block_fetches_only_those_cells() -> None:
    run_on_ranks(4, _one_column_body)


# ---------------------------------------------------------------------------- split mask
def _split_mask_body() -> None:
    """aten ``_unsafe_masked_index`` with its mask split over the ranks: no handler reads
    through it (``_in_owner_order`` takes a mask every rank holds whole), so the call takes
    the gathered fallback, which the guard refuses on every rank under "error" before any
    byte moves, and which agrees with one process under "allow"."""
    mesh = get_mesh((2,))
    torch.manual_seed(0)
    x = torch.randn(SHAPE, dtype=torch.float64)
    rows = torch.tensor([4, 0, 1, 3])
    mask = torch.tensor([True, False, True, True])[:, None, None].expand(4, 4, 3).contiguous()
    layouts = [Layout((Shard(0),), {0: (2, 3)}), Layout((Shard(0),), {0: (1, 3)})]
    shards = []
    for t, layout in zip((x, mask), layouts, strict=True):
        spec = layout.spec(mesh, t)
        shards.append(from_local_spec(spec.narrow(t).contiguous(), spec))

    def read(t: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return aten._unsafe_masked_index.default(t, m, [rows], 0.5)

    traffic = []

    def attempt() -> None:
        with count_traffic() as counted:
            traffic.append(counted)
            read(*shards)

    with gather_policy("error"):
        assert_raises_all_ranks(GatherError, OP, attempt)
    assert_all_ranks(traffic[0].received == 0, f"received {traffic[0].received} B first")
    with gather_policy("allow"):
        check_against_reference(
            read, [x, mask], layouts, mesh, out_layouts=[Layout((Replicate(),))],
            not_a_gather="it is one, said",
        )  # fmt: skip


def test_a_split_mask_takes_the_gathered_fallback_refused_on_every_rank() -> None:
    run_on_ranks(2, _split_mask_body)
