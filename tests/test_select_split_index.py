"""``index_select`` and ``x[idx]`` through an index that is a ShardTensor split over mesh axes
that split no dim of ``x``, from ``x`` split along the read dim, against one process, float64;
and the one range check of the routes through an index every rank holds whole or in part.

On a 2x2 mesh with ``x`` split along dim 0 over axis 0 and the index split over axis 1, each
mesh column reads through its part of the index as through a replicated index, fetching only
the remote rows that part names (before, ``index_select`` took the gathered fallback, every
rank holding all of ``x`` and the whole output, and ``x[idx]`` gathered ``x`` over axis 0).
Values, the input's gradient and the output's layout (the index's split on the index's dims,
``x``'s other dims kept, replicated over dim 0's axis) as one process; on 2x2 uneven, 2x2 with
empty shards of both ``x`` and the index, a 2-D index with a negative position, and 2x2x2; and
forward bytes per rank by ``count_traffic`` against the gathered fallback's, measured alike.
Aten ``index``'s backward (torch's: an accumulating ``index_put`` through the same split index
into ``grad.new_zeros(x.shape)``, which takes ``x``'s layout from the read's hints, NOTE [New
tensors of a backward take the forward's layout]) adds each rank's part where its rows lie and
reduces the touched rows over the index's axes (NOTE [A write through an index split elsewhere
reduces the rows it touched]), under ``"error"``, through 1-D and 2-D indices, with the
gradient laid out as the read states or replicated (a sum's), and with fewer bytes than the
fallback.
An index split over the axis that splits ``x``'s other dim is not such an index (the output
would be split over one axis on two dims): it takes the default path, as before.

Range: an entry out of range in one part raises the same ``IndexError`` on every rank, naming
the entry a replicated index would name (the first in the whole index), with no collective
left waiting: on 2x2 (``index_select``, ``x[idx]``, ``gather``) and on 2 ranks.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from shardsci import gather_policy
from shardsci.handlers import from_local_spec
from shardsci.tensor._ops._gathered_ops import gathered
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    assert_raises_all_ranks,
    count_traffic,
    get_mesh,
    run_on_ranks,
)

aten = torch.ops.aten

# name: (mesh, x's shape, x's layout, the index, its layout, the output's layout)
CASES = {
    "2x2-uneven": (
        (2, 2),
        (6, 5),
        Layout((Shard(0), Replicate()), {0: (4, 2)}),
        [5, 0, 3, 3, 1],
        Layout((Replicate(), Shard(0)), {0: (2, 3)}),
        Layout((Replicate(), Shard(0)), {0: (2, 3)}),
    ),
    "2x2-empty": (
        (2, 2),
        (6, 5),
        Layout((Shard(0), Replicate()), {0: (0, 6)}),
        [5, 0, 3, 3, 1],
        Layout((Replicate(), Shard(0)), {0: (5, 0)}),
        Layout((Replicate(), Shard(0)), {0: (5, 0)}),
    ),
    "2x2-2d-index": (
        (2, 2),
        (6, 5),
        Layout((Shard(0), Replicate()), {0: (2, 4)}),
        [[5, 0, 3], [3, 1, -1]],
        Layout((Replicate(), Shard(1)), {1: (1, 2)}),
        Layout((Replicate(), Shard(1)), {1: (1, 2)}),
    ),
    "2x2-2d-empty": (
        (2, 2),
        (6, 5),
        Layout((Shard(0), Replicate()), {0: (0, 6)}),
        [[5, 0, 3], [3, 1, -1]],
        Layout((Replicate(), Shard(1)), {1: (3, 0)}),
        Layout((Replicate(), Shard(1)), {1: (3, 0)}),
    ),
    "2x2x2-2d-index": (
        (2, 2, 2),
        (6, 5, 4),
        Layout((Shard(0), Replicate(), Shard(2)), {0: (4, 2), 2: (1, 3)}),
        [[4, 1, 5], [0, 2, -2]],
        Layout((Replicate(), Shard(0), Replicate()), {0: (1, 1)}),
        Layout((Replicate(), Shard(0), Shard(3)), {0: (1, 1), 3: (1, 3)}),
    ),
    "2x2x2-uneven": (
        (2, 2, 2),
        (6, 5, 4),
        Layout((Shard(0), Replicate(), Shard(2)), {0: (2, 4), 2: (3, 1)}),
        [4, 1, 5, 0, 2],
        Layout((Replicate(), Shard(0), Replicate()), {0: (1, 4)}),
        Layout((Replicate(), Shard(0), Shard(2)), {0: (1, 4), 2: (3, 1)}),
    ),
}
READS = {
    "index_select": lambda x, i: x.index_select(0, i),
    "x[idx]": lambda x, i: x[i],
}


def _sharded(mesh, values: torch.Tensor, layout: Layout, *, grad: bool = False):
    spec = layout.spec(mesh, values)
    local = spec.narrow(values).contiguous()
    if grad:
        local.requires_grad_()
    return from_local_spec(local, spec), local, spec


def _matches_one_process(name: str, read: str) -> None:
    mesh_shape, shape, layout, values, index_layout, out_layout = CASES[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64)
    index = torch.tensor(values)
    t, leaf, spec = _sharded(mesh, x, layout, grad=True)
    i, _, _ = _sharded(mesh, index, index_layout)
    reference = x.clone().requires_grad_()
    expected = READS[read](reference, index)
    weight = torch.randn(expected.shape, dtype=torch.float64)
    (expected * weight).sum().backward()
    u, aten_leaf, _ = _sharded(mesh, x, layout, grad=True)
    stated = out_layout.spec(mesh, expected)
    weighted = from_local_spec(stated.narrow(weight), stated)
    v, summed_leaf, _ = _sharded(mesh, x, layout, grad=True)
    with gather_policy("error"):  # as many pieces as x: not a gather
        out = READS[read](t, i)
        # as a backward formula or a trace reads; its backward is torch's: an accumulating
        # index_put through the same split index into zeros laid out like x
        aten_read = aten.index.Tensor(u, [i])
        zeros = []  # the backward's zeros, as torch's formula makes them from the gradient
        aten_read.register_hook(lambda g: zeros.append(g.new_zeros(x.shape)._spec))
        (aten_read * weighted).sum().backward()
        aten.index.Tensor(v, [i]).sum().backward()  # a replicated gradient
    ones = torch.zeros_like(x).index_put_([index], torch.ones(expected.shape).double(), True)
    assert_all_ranks(torch.equal(summed_leaf.grad, spec.narrow(ones)), "summed gradient")
    assert_all_ranks(zeros[0].same_layout(spec), f"the backward's zeros {zeros[0]}, x {spec}")
    assert_all_ranks(out._spec.same_layout(stated), f"layout {out._spec}, stated {stated}")
    assert_all_ranks(torch.equal(out.full_tensor(), expected.detach()), "values")
    (out * weighted).sum().backward()
    assert_all_ranks(torch.allclose(leaf.grad, spec.narrow(reference.grad)), "gradient")
    assert_all_ranks(aten_read._spec.same_layout(stated), f"aten layout {aten_read._spec}")
    assert_all_ranks(torch.equal(aten_read.full_tensor(), expected.detach()), "aten values")
    assert_all_ranks(torch.allclose(aten_leaf.grad, spec.narrow(reference.grad)), "aten gradient")


@pytest.mark.parametrize("read", list(READS))
@pytest.mark.parametrize("name", list(CASES))
def test_select_through_split_index_matches_one_process(name: str, read: str) -> None:
    if "2d" in name and read == "index_select":
        pytest.skip("index_select takes a 1-D index")
    run_on_ranks(math.prod(CASES[name][0]), _matches_one_process, name, read)


def _fewer_bytes_than_the_fallback() -> None:
    """x (64, 64) split 40/24 along dim 0; 16 rows named by an index split 6/10 over axis 1
    (and as (2, 8) split 3/5 on dim 1, for aten ``index``'s backward)."""
    mesh = get_mesh((2, 2))
    torch.manual_seed(0)
    x = torch.randn(64, 64, dtype=torch.float64)
    index = torch.randperm(64)[:16]
    t, _, _ = _sharded(mesh, x, Layout((Shard(0), Replicate()), {0: (40, 24)}))
    i, _, index_spec = _sharded(mesh, index, Layout((Replicate(), Shard(0)), {0: (6, 10)}))
    with gather_policy("allow"):
        with count_traffic() as ours:
            out = t.index_select(0, i)
        with count_traffic() as fallback:
            whole = gathered(aten.index_select.default, (t, 0, i), {})
    assert_all_ranks(torch.equal(out.full_tensor(), whole.full_tensor()), "values")
    # aten index's backward: an accumulating index_put through the index into zeros laid out
    # like the gradient, as torch's formula makes them
    j, _, _ = _sharded(mesh, index.reshape(2, 8), Layout((Replicate(), Shard(1)), {1: (3, 5)}))
    for index_now in (i, j):  # a 1-D index and a 2-D one
        read = out if index_now is i else aten.index.Tensor(t, [j])
        zeros = read.new_zeros(x.shape)  # x's layout, not the index's 6/58 cut
        assert_all_ranks(zeros._spec.same_layout(t._spec), f"zeros laid out {zeros._spec}")
        with gather_policy("allow"):
            with count_traffic() as added:
                back = aten.index_put.default(zeros, [index_now], read, True)
            with count_traffic() as added_fallback:
                whole_back = gathered(aten.index_put.default, (zeros, [index_now], read, True), {})
        assert_all_ranks(torch.equal(back.full_tensor(), whole_back.full_tensor()), "gradient")
        assert_all_ranks(back._spec.same_layout(zeros._spec), f"gradient layout {back._spec}")
        assert_all_ranks(
            added.received < added_fallback.received,
            f"backward received {added.received} B; the fallback {added_fallback.received} B",
        )
    start, size = t._spec.local_offsets()[0], t._spec.local_shape()[0]
    part = index_spec.narrow(index)
    remote = int(((part < start) | (part >= start + size)).sum())
    assert_all_ranks(
        64 * 8 * remote <= ours.received < fallback.received,
        f"received {ours.received} B for {remote} remote rows; the fallback {fallback.received} B",
    )


def test_select_through_split_index_receives_less_than_the_fallback() -> None:
    run_on_ranks(4, _fewer_bytes_than_the_fallback)


def _range_checked_alike_2x2() -> None:
    """The index's part on mesh column 0 holds a bad entry at position 1 (7), the part on
    column 1 another at position 4 (-8, also bad for ``x[idx]``): every rank names 7, as
    through the whole index, and the ranks are still in step afterwards."""
    mesh = get_mesh((2, 2))
    x = torch.arange(30.0, dtype=torch.float64).reshape(6, 5)
    t, _, _ = _sharded(mesh, x, Layout((Shard(0), Replicate()), {0: (4, 2)}))
    bad = torch.tensor([5, 7, 3, 3, -8])
    i, _, _ = _sharded(mesh, bad, Layout((Replicate(), Shard(0)), {0: (2, 3)}))
    message = "index 7 is out of bounds for dim 0 with size 6"
    for read in READS.values():
        assert_raises_all_ranks(IndexError, message, read, t, bad)  # the whole index
        assert_raises_all_ranks(IndexError, message, read, t, i)
    # gather through an index split like x on dim 1 (the split route of ``gather``)
    blocks = Layout((Shard(0), Shard(1)), {0: (4, 2), 1: (2, 3)})
    u, _, _ = _sharded(mesh, x, blocks)
    index = torch.zeros(2, 5, dtype=torch.int64)
    index[1, 3], index[0, 4] = 6, -1  # the first in row-major order, then another
    j, _, _ = _sharded(mesh, index, Layout((Replicate(), Shard(1)), {1: (2, 3)}))
    message = "gather: index -1 is out of bounds for dim 0 with size 6"
    assert_raises_all_ranks(IndexError, message, torch.gather, u, 0, index)
    assert_raises_all_ranks(IndexError, message, torch.gather, u, 0, j)
    good, _, _ = _sharded(mesh, bad.clamp(0, 5), Layout((Replicate(), Shard(0)), {0: (2, 3)}))
    assert_all_ranks(torch.equal(t[good].full_tensor(), x[bad.clamp(0, 5)]), "in step after")


def _range_checked_alike_2r() -> None:
    mesh = get_mesh((2,))
    x = torch.arange(30.0, dtype=torch.float64).reshape(6, 5)
    t, _, _ = _sharded(mesh, x, Layout((Shard(0),), {0: (4, 2)}))
    bad = torch.tensor([5, 0, 3, 9, 1])
    message = "index 9 is out of bounds for dim 0 with size 6"
    for read in READS.values():
        assert_raises_all_ranks(IndexError, message, read, t, bad)
    # an index split over the same axis as the read dim: its plan's exchange checks it
    i, _, _ = _sharded(mesh, bad, Layout((Shard(0),), {0: (2, 3)}))
    assert_raises_all_ranks(IndexError, "index value 9 on rank 1", lambda: t.index_select(0, i))
    with gather_policy("allow"):  # through a plain index: a replicated read, by design
        after = t[bad.clamp(0, 5)].full_tensor()
    assert_all_ranks(torch.equal(after, x[bad.clamp(0, 5)]), "after")


@pytest.mark.parametrize("ranks", [2, 4])
def test_an_index_out_of_range_raises_alike_on_every_rank(ranks: int) -> None:
    run_on_ranks(ranks, _range_checked_alike_2r if ranks == 2 else _range_checked_alike_2x2)


def _added_through_an_index_split_like_x() -> None:
    """``index_put(x, [i], v, accumulate=True)`` with ``x`` split 4/2, ``i`` (a negative entry
    and a repeat) and ``v`` split 2/3 over the same axis: each rank adds its part where its
    rows lie (the route of aten ``index``'s backward above), in ``x``'s layout; an entry out of
    range in one part raises on every rank."""
    mesh = get_mesh((2,))
    torch.manual_seed(0)
    x, v = torch.randn(6, 5, dtype=torch.float64), torch.randn(5, 5, dtype=torch.float64)
    index = torch.tensor([5, 0, -3, 3, 3])
    t, _, spec = _sharded(mesh, x, Layout((Shard(0),), {0: (4, 2)}))
    parts = Layout((Shard(0),), {0: (2, 3)})
    i, _, _ = _sharded(mesh, index, parts)
    w, _, _ = _sharded(mesh, v, parts)
    expected = x.index_put([index], v, accumulate=True)
    with gather_policy("error"):
        for out in (torch.index_put(t, [i], w, True), aten.index_put.default(t, [i], w, True)):
            assert_all_ranks(out._spec.same_layout(spec), f"layout {out._spec}")
            assert_all_ranks(torch.allclose(out.full_tensor(), expected), "values")
    bad, _, _ = _sharded(mesh, torch.tensor([5, 0, 9, 3, 1]), parts)
    message = "index value 9 on rank 1"
    assert_raises_all_ranks(IndexError, message, torch.index_put, t, [bad], w, True)


def test_accumulating_index_put_through_an_index_split_like_x() -> None:
    run_on_ranks(2, _added_through_an_index_split_like_x)
