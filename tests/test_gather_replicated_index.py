"""Gathers through a replicated index from a tensor sharded on any dims, against one process,
float64 (NOTE [A gather through a replicated index keeps the input's layout]).

``gather`` (aten and torch, an index of the input's shape and a smaller one, as DTensor's rule
refuses with "different extents"), ``take_along_dim``, ``index_select`` and ``x[idx]`` (a
permutation, fewer rows, a 2-D index, negative positions) along dim 1 of a tensor sharded along
it, along another dim with an empty shard, both on a 2x2 mesh, and along two other dims of a
2x2 mesh, uneven in opposite directions: values, the input's gradient, the output's layout
(stated here from the rule: sharded dims kept, cut at a smaller index's extent; the gathered
dim kept when the output has the input's extent there, split by its entries' owners for a
1-D selection of another extent (NOTE [A selection through a replicated index is split by its
entries' owners]), else replicated) and, per rank, the
bytes received by ``count_traffic``: in the forward exactly what the rank's part of the index
reads of the others' rows, each once: the remote cells for ``gather`` and ``take_along_dim``
(NOTE [A cell-wise read moves cells]), the remote rows for a selection (none when the gathered
dim is not split), or for an output replicated over the gathered dim's axes, a ring
all-reduce of the read where that moves fewer bytes than the fetch; in the backward (a
gradient with other strides) exactly the cells or rows the others read from the rank, or none
when the output is replicated over the gathered dim's axes.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from shardsci import gather_policy, record_gathers
from shardsci.handlers import from_local_spec
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

SHAPE = (6, 5, 4)  # every gather is along dim 1
DIM = 1
LAYOUTS = {
    "2r-gathered-dim": ((2,), Layout((Shard(1),), {1: (4, 1)})),
    "4r-empty-other-dim": ((4,), Layout((Shard(0),), {0: (2, 0, 3, 1)})),
    "2x2-both": ((2, 2), Layout((Shard(0), Shard(1)), {0: (4, 2), 1: (1, 4)})),
    "2x2-other-dims": ((2, 2), Layout((Shard(2), Shard(0)), {2: (3, 1), 0: (1, 5)})),
    "2x2x2-every-dim": (
        (2, 2, 2),
        Layout((Shard(0), Shard(1), Shard(2)), {0: (4, 2), 1: (3, 2), 2: (0, 4)}),
    ),
}


def _cases() -> dict[str, tuple]:
    """``(fn, index, cell_wise)``: the call, its index along dim 1 (negative positions as
    given) and whether it is a ``gather`` (the index has the input's dims) or a selection
    (the index's dims replace dim 1)."""
    generator = torch.Generator().manual_seed(5)
    whole = torch.randint(0, SHAPE[DIM], SHAPE, generator=generator)
    smaller = torch.randint(0, SHAPE[DIM], (4, 3, 2), generator=generator)
    perm = torch.randperm(SHAPE[DIM], generator=generator)
    rows = torch.tensor([4, 0, 4])
    grid = torch.tensor([[1, 3, 3], [0, 4, 2]])
    return {
        "gather, an index of the input's shape": (lambda x: x.gather(DIM, whole), whole, True),
        "aten gather, a smaller index": (
            lambda x: aten.gather.default(x, DIM, smaller),
            smaller,
            True,
        ),
        "take_along_dim": (lambda x: torch.take_along_dim(x, whole, DIM), whole, True),
        "index_select, a permutation": (lambda x: x.index_select(DIM, perm), perm, False),
        "index_select, fewer rows": (lambda x: torch.index_select(x, DIM, rows), rows, False),
        "x[:, perm - 5], negative": (lambda x: x[:, perm - SHAPE[DIM]], perm - SHAPE[DIM], False),
        "x[:, 2-D index]": (lambda x: x[:, grid], grid, False),
    }


def _cut(sizes: tuple[int, ...], extent: int) -> tuple[int, ...]:
    """Shard sizes ``sizes`` of a dim, cut at ``extent``."""
    bounds = [min(sum(sizes[:k]), extent) for k in range(len(sizes) + 1)]
    return tuple(b - a for a, b in itertools.pairwise(bounds))


def _keeps_gathered_dim(index: torch.Tensor, cell_wise: bool) -> bool:
    """Whether the output has the input's extent along the gathered dim."""
    if cell_wise:
        return index.shape[DIM] == SHAPE[DIM]
    return index.ndim == 1 and index.shape[0] == SHAPE[DIM]


def _split_by_owners(index: torch.Tensor, cell_wise: bool) -> bool:
    """Whether the output is split along the gathered dim by its entries' owners: a 1-D
    selection of another extent."""
    return not cell_wise and index.ndim == 1 and index.shape[0] != SHAPE[DIM]


def _owner_counts(sizes: tuple[int, ...], index: torch.Tensor) -> tuple[int, ...]:
    """How many entries of ``index`` (negative positions wrapped) name rows of each shard."""
    rows = [int(v) % SHAPE[DIM] for v in index]
    bounds = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    return tuple(sum(a <= r < b for r in rows) for a, b in itertools.pairwise(bounds))


def _expected(layout: Layout, index: torch.Tensor, cell_wise: bool) -> Layout:
    """The rule, stated independently of the library."""
    placements, sizes = [], {}
    for p in layout.placements:
        d = p.dim
        if d == DIM:
            keep = _keeps_gathered_dim(index, cell_wise)
            by_owners = _split_by_owners(index, cell_wise)
            placements.append(Shard(DIM) if keep or by_owners else Replicate())
            if keep:
                sizes[DIM] = tuple(layout.sizes[DIM])
            elif by_owners:
                sizes[DIM] = _owner_counts(tuple(layout.sizes[DIM]), index)
        elif cell_wise:
            placements.append(p)
            sizes[d] = _cut(tuple(layout.sizes[d]), index.shape[d])
        else:
            out = d if d < DIM else d + index.ndim - 1
            placements.append(Shard(out))
            sizes[out] = tuple(layout.sizes[d])
    return Layout(tuple(placements), sizes)


def _parts(layout: Layout, mesh, index: torch.Tensor, cell_wise: bool) -> list[torch.Tensor]:
    """The part of the index (positions along dim 1) each rank of this rank's dim-1 group
    reads, in group order: narrowed like this rank's block along the other dims (``gather``),
    then to each rank's range along dim 1 when the output keeps it sharded, or to each rank's
    run of entries when it is split by their owners."""
    spec = layout.spec(mesh, torch.empty(SHAPE, dtype=torch.float64))
    starts, local = spec.local_offsets(), spec.local_shape()
    keep = _keeps_gathered_dim(index, cell_wise)
    index = torch.where(index < 0, index + SHAPE[DIM], index)
    if cell_wise:
        for d in spec.sharding_by_dim:
            if d != DIM:
                begin = min(starts[d], index.shape[d])
                index = index.narrow(d, begin, min(starts[d] + local[d], index.shape[d]) - begin)
    sizes = layout.sizes[DIM]
    if _split_by_owners(index, cell_wise):
        sizes = _owner_counts(tuple(sizes), index)
    elif not keep:
        return [index] * len(sizes)
    bounds = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    return [index.narrow(DIM if cell_wise else 0, a, b - a) for a, b in itertools.pairwise(bounds)]


def _read(part: torch.Tensor, cell_wise: bool) -> set[tuple[int, ...]]:
    """What ``part`` of the index reads, each once: for ``gather`` its cells (the row along
    dim 1, then the position along the other dims), for a selection its rows."""
    if not cell_wise:
        return {(int(v),) for v in part.reshape(-1)}
    positions = itertools.product(*map(range, part.shape))
    return {(int(part[p]), *p[:DIM], *p[DIM + 1 :]) for p in positions}


def _bounds(layout: Layout, mesh, index: torch.Tensor, cell_wise: bool) -> tuple[int, int]:
    """Bytes this rank must receive in the forward (what its part of the index reads of the
    others' rows, each once: the distinct remote cells for ``gather``, whole rows of its block
    for a selection; for an output replicated over dim 1's axis, a ring all-reduce of the
    read, ``2 (n - 1) / n`` of its bytes, where that is less than the rank of the group
    receiving most would fetch) and in the backward (what of its own the others read, when
    the output is sharded along dim 1; none when it is replicated there)."""
    spec = layout.spec(mesh, torch.empty(SHAPE, dtype=torch.float64))
    if DIM not in spec.sharding_by_dim:
        return 0, 0
    starts, local = spec.local_offsets(), spec.local_shape()
    row = math.prod(n for d, n in enumerate(local) if d != DIM) * 8
    unit = 8 if cell_wise else row
    mine = range(starts[DIM], starts[DIM] + local[DIM])
    parts = _parts(layout, mesh, index, cell_wise)
    axis = next(a for a, p in enumerate(layout.placements) if p.dim == DIM)
    me = mesh.get_coordinate()[axis]
    read = _read(parts[me], cell_wise)
    forward = sum(u[0] not in mine for u in read) * unit
    if not _keeps_gathered_dim(index, cell_wise) and not _split_by_owners(index, cell_wise):
        sizes, n = layout.sizes[DIM], len(layout.sizes[DIM])
        ranges = [range(sum(sizes[:k]), sum(sizes[: k + 1])) for k in range(n)]
        most = max(sum(u[0] not in r for u in read) for r in ranges) * unit
        summed = parts[me].numel() * (8 if cell_wise else row)
        if 2 * (n - 1) * summed < n * most:
            return 2 * (n - 1) * summed // n, 0
        return forward, 0
    backward = sum(
        u[0] in mine for k, p in enumerate(parts) if k != me for u in _read(p, cell_wise)
    )
    return forward, backward * unit


def _strided_like(out: torch.Tensor) -> torch.Tensor:
    """A gradient of ones laid out like ``out`` with other strides (a transposed copy), as
    backward formulas often give (no random numbers: the ranks' generators stay in step)."""
    ones = from_local_spec(torch.ones_like(out.to_local()), out._spec)
    return ones.transpose(0, -1).contiguous().transpose(0, -1)


def _body(name: str) -> None:
    mesh_shape, layout = LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(*SHAPE, dtype=torch.float64)
    spec = layout.spec(mesh, x)
    shard = from_local_spec(spec.narrow(x).contiguous(), spec)
    for what, (fn, index, cell_wise) in _cases().items():
        expected = _expected(layout, index, cell_wise)
        # a read replicated over dim 1's axes is a gather the guard counts (NOTE [Gathers an
        # op was not asked to make]); every other read runs under "error"
        replicates = DIM in spec.sharding_by_dim and not (
            _keeps_gathered_dim(index, cell_wise) or _split_by_owners(index, cell_wise)
        )
        with gather_policy("allow" if replicates else "error"), record_gathers() as gathers:
            check_against_reference(fn, [x], [layout], mesh, out_layouts=[expected], what=what)
            leaf = shard.detach().requires_grad_()
            with count_traffic() as forward:
                out = fn(leaf)
            with count_traffic() as backward:
                out.backward(_strided_like(out))
        said = {g.what for g in gathers}
        assert_all_ranks(
            said == ({"a read through an index"} if replicates else set()),
            f"{name}: {what} made the gathers {said}",
        )
        bounds = _bounds(layout, mesh, index, cell_wise)
        assert_all_ranks(
            (forward.received, backward.received) == bounds,
            f"{name}: {what} received {forward.received} and {backward.received} bytes forward "
            f"and backward, the rows it reads and the others read from it are {bounds}",
        )
    assert_raises_all_ranks(
        IndexError, "gather: index 5 is out of bounds", shard.gather, DIM, torch.full(SHAPE, 5)
    )
    assert_raises_all_ranks(
        IndexError, "index_select: index -1 is out of bounds", shard.index_select, DIM,
        torch.tensor([-1]),
    )  # fmt: skip


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if "2x2x2" in n else n for n in LAYOUTS],
)
def test_a_gather_through_a_replicated_index_keeps_the_input_layout(name: str) -> None:
    run_on_ranks(math.prod(LAYOUTS[name][0]), _body, name)
