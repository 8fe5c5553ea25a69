"""Scatters through a replicated index into a destination sharded on any dims, against one
process, float64 (NOTE [Scatters through a replicated index write where they land]).

``scatter``, ``scatter_add``, ``scatter_reduce`` (every reduction, with and without the
destination's own values), ``index_add``, ``index_copy``, ``index_reduce``, ``index_put``
(an integer index, several broadcast together after leading slices, or a boolean mask of
one or two dims, accumulated or not), aten's ``_unsafe_masked_index_put_accumulate`` (an
interpolation's backward) and ``index_fill`` into a
destination sharded along the scatter's dim, along another
dim (with an empty shard, and rows the index does not reach) and both on a 2x2 mesh: values,
the destination's and the source's gradients (at the aten level too, for every reduction and
for ``index_put`` through several indices or a mask), the output's layout (the destination's
placements and shard sizes), no gather in the forward or the backward (the gather guard set to
"error"), no byte received by ``count_traffic`` in the forward, and an out-of-range index
refused on every rank.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.distributed.tensor import Shard
from torch.profiler import ProfilerActivity, profile

from shardsci import gather_policy
from shardsci.handlers import from_local_spec
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    check_against_reference,
    count_traffic,
    get_mesh,
    run_on_ranks,
)

aten = torch.ops.aten

SHAPE = (6, 5, 4)  # the destination; every scatter is along dim 1
LAYOUTS = {
    "2r-scatter-dim": ((2,), Layout((Shard(1),), {1: (4, 1)})),
    "4r-empty-other-dim": ((4,), Layout((Shard(0),), {0: (2, 0, 3, 1)})),
    "2x2-both": ((2, 2), Layout((Shard(0), Shard(1)), {0: (4, 2), 1: (1, 4)})),
}


def _cases() -> dict[str, object]:
    """The calls, aten-level ones among them (a source that needs a gradient there has an aten
    gather or index_select from the gradient for its gradient)."""
    generator = torch.Generator().manual_seed(3)
    # index rows 0..3 of dim 0 only (4 < 6), several entries per target
    index = torch.randint(0, SHAPE[1], (4, 7, 3), generator=generator)
    # one entry per target for assignment, whose result with duplicates is unspecified
    unique = torch.rand(4, SHAPE[1], 3, generator=generator).argsort(1)[:, :3]
    cases = {
        "scatter_add": lambda x, src: x.scatter_add(1, index, src),
        "scatter_add_, in place": lambda x, src: x.clone().scatter_add_(1, index, src),
        "scatter": lambda x, src: torch.scatter(x, 1, unique, src[:, :3]),
        "scatter, a value": lambda x, src: x.scatter(1, unique, 2.5) * src.sum(),
    }
    # the index_* family: a 1-D index along dim 1 names where each row of the source goes
    rows = torch.randint(0, SHAPE[1], (7,), generator=generator)
    distinct = torch.randperm(SHAPE[1], generator=generator)[:3]
    rows0 = torch.randint(0, SHAPE[0], (7,), generator=generator)
    cells = torch.randperm(SHAPE[0] * SHAPE[1], generator=generator)[:3]
    pairs = torch.randperm(SHAPE[1] * SHAPE[2], generator=generator)[:3]
    distinct0 = torch.randperm(SHAPE[0], generator=generator)[:3]
    beyond = torch.where(rows0 % 3 == 0, rows0 + SHAPE[0], rows0)  # some beyond dim 0
    in_range = (beyond < SHAPE[0])[:, None].expand(7, 3)
    cases |= {
        "index_add, alpha=2": lambda x, src: x.index_add(1, rows, _rows(src, 7), alpha=2),
        "index_add_, in place": lambda x, src: x.clone().index_add_(1, rows, _rows(src, 7)),
        "index_copy": lambda x, src: x.index_copy(1, distinct, _rows(src, 3)),
        # index_put takes one index per leading dim: along dim 0
        "index_put, accumulate": lambda x, src: x.index_put(
            (rows0,), _rows(src, 7, dim=0), accumulate=True
        ),
        "index_put_, in place": lambda x, src: x.clone().index_put_(
            (rows0,), _rows(src, 7, dim=0), accumulate=True
        ),
        "index_put": lambda x, src: x.index_put((distinct0,), _rows(src, 3, dim=0)),
        "index_put, negative, a broadcast value": lambda x, src: x.index_put(
            (distinct0 - SHAPE[0],), src.sum().reshape(1)
        ),
        "index_put, a boolean mask": lambda x, src: torch.index_put(
            x, (torch.arange(SHAPE[0]) % 2 == 0,), _rows(src, 3, dim=0)
        ),
        # several indices (x[i, j] = v): cells of dims 0 and 1, distinct for assignment
        "index_put, two indices": lambda x, src: x.index_put(
            (cells // SHAPE[1], cells % SHAPE[1]), _rows(src, 3, dim=0)[:, 0]
        ),
        "index_put_, two broadcast indices, accumulate": lambda x, src: x.clone().index_put_(
            (rows0[:, None], rows[None, :]), src.sum().expand(1, 7, SHAPE[2]), accumulate=True
        ),
        "x[:, i, j] = v": lambda x, src: _assigned(
            x, (slice(None), pairs // SHAPE[2], pairs % SHAPE[2]), _rows(src, 3, dim=1)[:, :, 0]
        ),
        "x[i, j, ...] = v": lambda x, src: _assigned(
            x, (cells // SHAPE[1], cells % SHAPE[1], ...), _rows(src, 3, dim=0)[:, 1]
        ),
        "x[:, mask] = a number": lambda x, src: (
            _assigned(x, (slice(None), torch.arange(SHAPE[1]) % 2 == 0), 2.5) * src.sum()
        ),
        "index_put, a 2-D boolean mask": lambda x, src: x.index_put(
            (torch.arange(SHAPE[0] * SHAPE[1]).reshape(SHAPE[:2]) % 3 == 1,),
            _rows(src, 1, dim=0)[0, 0],
        ),
        "index_fill, a number": lambda x, src: x.index_fill(1, distinct, 2.5) * src.sum(),
        "index_fill, a 0-d tensor, duplicates": lambda x, src: x.index_fill(1, rows, src.sum()),
        # torch's own backward of a tensor value fails on a negative index
        "index_fill, negative": lambda x, src: x.index_fill(-2, distinct - SHAPE[1], -1.5),
        "index_fill_, in place": lambda x, src: x.clone().index_fill_(1, rows, src.sum()),
    }
    # the same ops reached at the aten level only (a backward formula, a decomposition), with
    # a source that needs no gradient
    cases |= {
        "aten scatter_add": lambda x, src: aten.scatter_add.default(x, 1, index, src.detach()),
        "aten scatter.value": lambda x, src: aten.scatter.value(x, 1, unique, 2.5),
        "aten index_add": lambda x, src: aten.index_add.default(x, 1, rows, _rows(src.detach(), 7)),
        "aten index_fill": lambda x, src: aten.index_fill.int_Scalar(x, 1, distinct, 2.5),
        "aten index_put": lambda x, src: aten.index_put.default(
            x, [rows0], _rows(src.detach(), 7, dim=0), True
        ),
        # an interpolation's backward: entries out of range are masked out, then clamped
        "aten scatter_reduce.two amax": lambda x, src: aten.scatter_reduce.two(
            x, 1, index, src.detach(), "amax", include_self=False
        ),
        "aten index_reduce prod": lambda x, src: aten.index_reduce.default(
            x, 1, rows, _rows(src.detach(), 7), "prod"
        ),
        "aten _unsafe_masked_index_put_accumulate": lambda x, src: (
            aten._unsafe_masked_index_put_accumulate.default(
                x, in_range[:, :, None], [beyond[:, None], rows[None, :3]], src.permute(1, 2, 0)
            )
        ),
    }
    cases |= {
        "aten scatter_add, a graded source": lambda x, src: aten.scatter_add.default(
            x, 1, index, src
        ),
        "aten scatter.src, a graded source": lambda x, src: aten.scatter.src(
            x, 1, unique, src[:, :3]
        ),
        "aten index_add, a graded source": lambda x, src: aten.index_add.default(
            x, 1, rows, _rows(src, 7)
        ),
        "aten index_copy, a graded source": lambda x, src: aten.index_copy.default(
            x, 1, distinct, _rows(src, 3)
        ),
        "aten index_put, a graded value": lambda x, src: aten.index_put.default(
            x, [rows0], _rows(src, 7, dim=0), True
        ),
        "aten index_put, a graded value along dim 1": lambda x, src: aten.index_put.default(
            x, [None, distinct], _rows(src, 3)
        ),
        "aten index_fill, a graded value": lambda x, src: aten.index_fill.int_Tensor(
            x, 1, rows, src.sum()
        ),
        # the values' gradient is an aten index through several indices or a mask
        "aten index_put, two indices, a graded value": lambda x, src: aten.index_put.default(
            x, [cells // SHAPE[1], cells % SHAPE[1]], _rows(src, 3, dim=0)[:, 0]
        ),
        "aten index_put, two indices, a graded value, accumulate": lambda x, src: (
            aten.index_put.default(
                x, [rows0[:3, None], rows[None, :3]], _rows(src, 3, dim=0)[:, :1], True
            )
        ),
        "aten index_put, a 2-D mask, a graded value": lambda x, src: aten.index_put.default(
            x, [torch.arange(SHAPE[0] * SHAPE[1]).reshape(SHAPE[:2]) % 3 == 1], src[0, :1, :1]
        ),
    }
    for reduce in ("sum", "prod", "mean", "amax", "amin"):
        # the source's gradient: gathers of the gradient and the result, elementwise masks
        cases[f"aten scatter_reduce.two {reduce}, a graded source"] = lambda x, src, r=reduce: (
            aten.scatter_reduce.two(x, 1, index, src, r)
        )
        if reduce != "sum":
            cases[f"aten index_reduce {reduce}, a graded source"] = lambda x, src, r=reduce: (
                aten.index_reduce.default(x, 1, rows, _rows(src, 7), r, include_self=False)
            )
    for reduce in ("sum", "prod", "mean", "amax", "amin"):
        for include_self in (True, False):
            cases[f"scatter_reduce {reduce}, include_self={include_self}"] = (
                lambda x, src, r=reduce, i=include_self: x.scatter_reduce(
                    1, index, src, r, include_self=i
                )
            )
            if reduce != "sum":
                cases[f"index_reduce {reduce}, include_self={include_self}"] = (
                    lambda x, src, r=reduce, i=include_self: x.index_reduce(
                        1, rows, _rows(src, 7), r, include_self=i
                    )
                )
    return cases


def _assigned(x: torch.Tensor, key: tuple, value: object) -> torch.Tensor:
    """A copy of ``x`` with ``x[key] = value``."""
    y = x.clone()
    y[key] = value
    return y


def _rows(src: torch.Tensor, n: int, dim: int = 1) -> torch.Tensor:
    """A source for an ``index_*`` op: the destination's shape with ``n`` rows along ``dim``."""
    shape = [n if d == dim else size for d, size in enumerate(SHAPE)]
    return (
        src.sum().expand(shape)
        * torch.arange(math.prod(shape), dtype=src.dtype).reshape(shape).cos()
    )


def _body(name: str) -> None:
    mesh_shape, layout = LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(*SHAPE, dtype=torch.float64)
    src = torch.randn(4, 7, 3, dtype=torch.float64)  # the index's shape: torch's backward
    with gather_policy("error"):  # forward and backward
        for what, fn in _cases().items():
            check_against_reference(
                fn, [x, src], [layout, None], mesh, out_layouts=[layout], what=f"{name}: {what}"
            )
    spec = layout.spec(mesh, x)
    shard = from_local_spec(spec.narrow(x).contiguous(), spec)
    for what, fn in _cases().items():
        with count_traffic() as traffic:
            fn(shard, src)
        assert_all_ranks(
            traffic.received == 0,
            f"{name}: {what} received {traffic.received} bytes: {traffic.as_dict()}",
        )
    with pytest.raises(IndexError, match="scatter_add: index 5 is out of bounds for dim 1"):
        shard.scatter_add(1, torch.tensor([[[5]]]), src)
    with pytest.raises(IndexError, match="index_fill: index 5 is out of bounds for dim 1"):
        shard.index_fill(1, torch.tensor([5]), 1.0)
    with pytest.raises(IndexError, match="index_put: index 6 is out of bounds for dim 0"):
        shard.index_put((torch.tensor([6]),), torch.ones(1))
    with pytest.raises(IndexError, match="index_put: index 5 is out of bounds for dim 1"):
        shard.index_put((torch.tensor([0]), torch.tensor([5])), torch.ones(1))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_scatter_through_a_replicated_index_writes_where_it_lands(name: str) -> None:
    run_on_ranks(math.prod(LAYOUTS[name][0]), _body, name)


def _peak_growth(fn) -> int:
    """The most bytes the CPU allocator holds during ``fn()`` beyond those at its start, from
    ``torch.profiler``'s allocation events (not a count the library keeps)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = prof.profiler.kineto_results.events()
    live = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        live += nbytes
        peak = max(peak, live)
    return peak


def _memory_body() -> None:
    mesh = get_mesh((2,))
    layout = Layout((Shard(1),), {1: (100, 156)})
    x = torch.randn(64, 256, 8, dtype=torch.float64)
    spec = layout.spec(mesh, x)
    shard = from_local_spec(spec.narrow(x).contiguous(), spec)
    shard_bytes = shard.to_local().numel() * x.element_size()
    index = torch.tensor([[[3], [120]], [[250], [99]]])
    src = torch.randn(2, 2, 1, dtype=torch.float64)
    rows = torch.randperm(256)[:100]
    rows_source = torch.randn(64, 100, 8, dtype=torch.float64)
    cells = torch.randn(64, 256, 8, dtype=torch.float64)
    calls = {
        "scatter_add": lambda: shard.scatter_add(1, index, src),
        "scatter_reduce_ amax, in place": lambda: shard.scatter_reduce_(1, index, src, "amax"),
        "index_put_ x[i, j], in place": lambda: shard.index_put_(
            (index[:, 0, 0] % 64, index[:, 0, 0]), src[:, 0].expand(2, 8)
        ),
        "index_copy_, in place": lambda: shard.index_copy_(
            1, index[:, 0, 0], src.reshape(1, 4, 1)[:, :2].expand(64, 2, 8)
        ),
        # an index as long as a shard: its positions shifted to the shard, not per source cell
        "index_add_, a shard-sized source": lambda: shard.index_add_(1, rows, rows_source),
        "index_put_ x[i, j] += v, broadcast indices": lambda: shard.index_put_(
            (torch.arange(64)[:, None], torch.arange(256)[None, :]), cells, accumulate=True
        ),
    }
    with torch.no_grad():
        for what, call in calls.items():
            grown = _peak_growth(call)
            assert_all_ranks(
                grown <= 1.25 * shard_bytes,
                f"{what}: held {grown} bytes more while it ran, a shard is {shard_bytes}",
            )


def test_a_scatter_through_a_replicated_index_holds_one_new_shard() -> None:
    """The output and its spare slice, as torch's own scatter: not a copy of the shard with
    the spare slice, then the scatter's output (2 shards), nor a third for in-place calls,
    nor an int64 index of the source's or the entries' size (as large as a shard of float64
    when the source is)."""
    run_on_ranks(2, _memory_body)


def _values_gradient_body() -> None:
    mesh = get_mesh((2,))
    x = torch.randn(6, 50, 4, dtype=torch.float64)
    spec = Layout((Shard(1),), {1: (40, 10)}).spec(mesh, x)
    shard = from_local_spec(spec.narrow(x).contiguous(), spec).requires_grad_()
    values = torch.randn(6, 3, 4, dtype=torch.float64, requires_grad=True)
    out = aten.index_put.default(shard, [None, torch.tensor([3, 45, 7])], values)
    with count_traffic() as traffic:
        out.backward(torch.ones_like(out))
    limit = 2 * values.numel() * values.element_size()
    assert_all_ranks(
        traffic.received <= limit,
        f"the backward received {traffic.received} bytes; the values' rows and their "
        f"gradient's reduction are at most {limit}",
    )


def test_the_gradient_of_aten_index_puts_values_reads_only_their_rows() -> None:
    """Through one index, the values' gradient (an aten ``index`` of the sharded gradient)
    receives the rows the index names, not the gradient field (1920-7680 bytes here)."""
    run_on_ranks(2, _values_gradient_body)


def _source_gradient_body() -> None:
    """``scatter_add`` into x (6, 5, 4) split 4/1 along dim 1 from a plain source (6, 3, 4)
    that needs a gradient: the backward reads the gradient through the index, replicated
    (the source was). Fetching the rows it names took 768 B on one rank (192 B on the
    other), and one all-reduce of what each rank reads of its own rows the read's 576 B on
    each (a ring of 2); each rank now receives the distinct remote cells it reads, 8 B each
    (NOTE [A cell-wise read moves cells])."""
    mesh = get_mesh((2,))
    torch.manual_seed(0)
    x = torch.randn(6, 5, 4, dtype=torch.float64)
    index = torch.randint(0, 5, (6, 3, 4))
    spec = Layout((Shard(1),), {1: (4, 1)}).spec(mesh, x)
    shard = from_local_spec(spec.narrow(x).contiguous(), spec)
    src = torch.randn(6, 3, 4, dtype=torch.float64, requires_grad=True)
    reference = src.detach().clone().requires_grad_()
    x.scatter_add(1, index, reference).pow(2).sum().backward()
    with gather_policy("error"):
        out = aten.scatter_add.default(shard, 1, index, src)
        with count_traffic() as traffic:
            out.pow(2).sum().backward()
    assert_all_ranks(torch.allclose(src.grad, reference.grad), "the source's gradient")
    mine = range(0, 4) if mesh.get_rank() == 0 else range(4, 5)
    cells = {(int(index[i, j, k]), i, k) for i, j, k in itertools.product(*map(range, (6, 3, 4)))}
    remote = 8 * sum(v not in mine for v, _, _ in cells)
    assert_all_ranks(
        traffic.received == remote,
        f"the backward received {traffic.as_dict()}, the remote cells it reads are {remote} B",
    )


def test_a_plain_sources_gradient_reads_only_its_remote_cells() -> None:
    run_on_ranks(2, _source_gradient_body)
