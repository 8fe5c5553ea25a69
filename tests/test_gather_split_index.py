"""``gather`` from an input split along the gathered dim through an index split along another
dim, against one process, float64.

``x.gather(0, x.argmax(0, keepdim=True))`` on a 2x2 mesh (the index split along dim 1 like
``x``, whole over dim 0's axis): each mesh column reads through its part of the index as
through a replicated index, fetching only the rows it names from the other rank of its
column (before, DTensor's rule gave a ``_MaskPartial`` whose mask shardsci does not keep, and
then the gathered fallback copied all of ``x`` to every rank). Under ``"allow"`` values,
gradient and layout (the index's) as one process, and fewer bytes received on every rank
(``count_traffic``) than the gathered fallback's; under ``"error"`` a ``GatherError`` on every
rank (the read is replicated over dim 0's axis), also through ``check_against_reference``. An
index of ``x``'s shape split like ``x`` whose one mesh column reads every cell of the other
rank's block fetches only those cells, and is not refused; an entry out of range in one
column raises on all four. On 2 uneven ranks,
``x`` split along dim 0 and the index along dim 1 over the same axis, DTensor reshards ``x``
like the index (no mask, no gather): the output is split like the index, and ``"error"`` does
not refuse it. A ``_MaskPartial`` that reaches shardsci's reduction anyway (no rank has its
mask) is refused with one clear error on every rank, before the all-reduce.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _MaskPartial

from shardsci import GatherError, gather_policy
from shardsci.handlers import from_local_spec
from shardsci.tensor._spec import ShardTensorSpec
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    assert_raises_all_ranks,
    check_against_reference,
    count_traffic,
    get_mesh,
    run_on_ranks,
)

SHAPE = (3, 4)
# (mesh, x's layout, the index's layout: None for x.argmax(0, keepdim=True) of the ShardTensor)
CASES = {
    "2x2-uneven": ((2, 2), Layout((Shard(0), Shard(1)), {0: (2, 1), 1: (1, 3)}), None),
    "2r-uneven": ((2,), Layout((Shard(0),), {0: (2, 1)}), Layout((Shard(1),), {1: (1, 3)})),
}
REPLICATED_READ = ["2x2-uneven"]  # a forward read replicated over dim 0's axis: refused
# under "error"; bytes every rank of the 2x2 mesh received from the gathered fallback (each
# got all of x), measured with count_traffic before each column read through its index
GATHERED_FALLBACK_BYTES = (104, 56, 112, 80)


def _operands(name: str):
    mesh_shape, layout, index_layout = CASES[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(SHAPE, dtype=torch.float64)
    index = x.argmax(0, keepdim=True)
    spec = layout.spec(mesh, x)
    leaf = spec.narrow(x).contiguous().requires_grad_()
    t = from_local_spec(leaf, spec)
    if index_layout is None:
        i = t.argmax(0, keepdim=True)
        assert_all_ranks(i._spec.shardings[0].dim == 1, f"the index is split on dim 1: {i._spec}")
    else:
        index_spec = index_layout.spec(mesh, index)
        i = from_local_spec(index_spec.narrow(index).contiguous(), index_spec)
    return mesh, layout, index_layout, x, index, spec, leaf, t, i


def _allow_matches_one_process(name: str) -> None:
    _, _, _, x, index, spec, leaf, t, i = _operands(name)
    reference = x.clone().requires_grad_()
    expected = reference.gather(0, index)
    (expected * expected).sum().backward()
    with gather_policy("allow"):
        with count_traffic() as traffic:
            out = t.gather(0, i)
        (out * out).sum().backward()
    layout_ok = out._spec.same_layout(i._spec.with_dtype(out.dtype))
    assert_all_ranks(layout_ok, f"layout {out._spec}")
    if name in REPLICATED_READ:
        fallback = GATHERED_FALLBACK_BYTES[torch.distributed.get_rank()]
        assert_all_ranks(
            traffic.received < fallback,
            f"received {traffic.received} B, the gathered fallback {fallback} B",
        )
    assert_all_ranks(tuple(out.shape) == tuple(expected.shape), f"shape {out.shape}")
    assert_all_ranks(torch.equal(out.full_tensor(), expected.detach()), "values")
    assert_all_ranks(torch.equal(leaf.grad, spec.narrow(reference.grad)), "gradient")


def _error_on_every_rank(name: str) -> None:
    mesh, layout, index_layout, x, index, _, _, t, i = _operands(name)
    if index_layout is None:
        args = (lambda x: x.gather(0, x.argmax(0, keepdim=True)), [x], [layout])
    else:
        args = (lambda x, i: x.gather(0, i), [x, index], [layout, index_layout])
    with gather_policy("error"):
        if name not in REPLICATED_READ:
            torch.gather(t, 0, i)
            check_against_reference(*args, mesh, out_layouts=[index_layout])
            return
        refused = "gather would replicate its read through an index"
        assert_raises_all_ranks(GatherError, refused, torch.gather, t, 0, i)
        assert_raises_all_ranks(GatherError, refused, check_against_reference, *args, mesh)


@pytest.mark.parametrize("name", list(CASES))
def test_gather_through_split_index_allowed_matches_one_process(name: str) -> None:
    run_on_ranks(math.prod(CASES[name][0]), _allow_matches_one_process, name)


@pytest.mark.parametrize("name", list(CASES))
def test_gather_through_split_index_refused_or_not_on_every_rank(name: str) -> None:
    run_on_ranks(math.prod(CASES[name][0]), _error_on_every_rank, name)


def _split_index_body() -> None:
    """``gather`` along dim 0 of a (4, 4) block on a 2x2 mesh through an index of its shape
    split like it: mesh column 0 (columns 0-1) reads only cells the other rank of its column
    owns, every cell of that rank's block; column 1 reads its own. Each rank of column 0
    receives those 4 cells (32 B), no more than its output's part, so under ``"error"`` it is
    not refused (NOTE [A cell-wise read moves cells]); every rank receives the range check's
    12 B. Then an entry out of range in column 1 only: every rank raises."""
    mesh = get_mesh((2, 2))
    torch.manual_seed(0)
    x = torch.randn(4, 4, dtype=torch.float64)
    layout = Layout((Shard(0), Shard(1)), {0: (2, 2), 1: (2, 2)})
    index = torch.arange(4)[:, None].repeat(1, 4)
    index[:, :2] = torch.tensor([[2, 3], [3, 2], [0, 1], [1, 0]])
    index_layout = Layout((Replicate(), Shard(1)), {1: (2, 2)})
    spec = layout.spec(mesh, x)
    t = from_local_spec(spec.narrow(x), spec)

    def split(values: torch.Tensor) -> torch.Tensor:
        index_spec = index_layout.spec(mesh, values)
        return from_local_spec(index_spec.narrow(values).contiguous(), index_spec)

    with gather_policy("error"), count_traffic() as traffic:
        out = t.gather(0, split(index))
    assert_all_ranks(out._spec.same_layout(spec), f"layout {out._spec}")
    assert_all_ranks(torch.equal(out.full_tensor(), x.gather(0, index)), "values")
    expected = (32 if mesh.get_coordinate()[1] == 0 else 0) + 12
    assert_all_ranks(traffic.received == expected, f"received {traffic.received} B")
    index[0, 3] = 4
    assert_raises_all_ranks(
        IndexError, "out of bounds for dim 0 with size 4", lambda: t.gather(0, split(index))
    )


def test_a_split_index_is_checked_alike_on_every_rank() -> None:
    run_on_ranks(4, _split_index_body)


def _maskless_reduction_refused() -> None:
    mesh = get_mesh((2,))
    masked = _MaskPartial(offset_shape=torch.Size([4]), offset_dim=0)
    spec = ShardTensorSpec.build(mesh, [masked], (1, 4), torch.float64, {})
    t = from_local_spec(torch.zeros(1, 4, dtype=torch.float64), spec)
    assert_raises_all_ranks(NotImplementedError, "never saved", t.redistribute, mesh, [Replicate()])


def test_maskless_mask_partial_refused_on_every_rank() -> None:
    run_on_ranks(2, _maskless_reduction_refused)


def _cells_fetched_body() -> None:
    """x (64, 64) in 40/24 x 32/32 blocks: each mesh column reads 32 cells of its part of the
    argmax, a (1, 32) read replicated over dim 0's axis. Fetching the rows those cells lie
    in moved 1.8-5.9 KB per rank, and one all-reduce of the cells each rank reads of its own
    rows the read's 256 B (a ring of 2); each rank now receives the remote cells it reads,
    8 B each (NOTE [A cell-wise read moves cells]), beside the range check's 8 B all-reduce
    over the 4 ranks (12 B received), and nothing in the backward."""
    mesh = get_mesh((2, 2))
    torch.manual_seed(0)
    x = torch.randn(64, 64, dtype=torch.float64)
    spec = Layout((Shard(0), Shard(1)), {0: (40, 24), 1: (32, 32)}).spec(mesh, x)
    leaf = spec.narrow(x).contiguous().requires_grad_()
    t = from_local_spec(leaf, spec)
    index = t.argmax(0, keepdim=True)
    with gather_policy("allow"):
        with count_traffic() as forward:
            out = t.gather(0, index)
        with count_traffic() as backward:
            out.sum().backward()
    reference = x.clone().requires_grad_()
    reference.gather(0, x.argmax(0, keepdim=True)).sum().backward()
    assert_all_ranks(torch.equal(out.full_tensor(), x.amax(0, keepdim=True)), "values")
    assert_all_ranks(torch.equal(leaf.grad, spec.narrow(reference.grad)), "gradient")
    received = (forward.received, backward.received)
    row, column = mesh.get_coordinate()
    read = x.argmax(0)[32 * column : 32 * (column + 1)]
    remote = int(((read < 40) if row == 1 else (read >= 40)).sum())
    expected = (8 * remote + 12, 0)
    assert_all_ranks(received == expected, f"received {received} B forward, backward")


def test_gather_through_split_index_fetches_the_cells_read() -> None:
    run_on_ranks(4, _cells_fetched_body)
