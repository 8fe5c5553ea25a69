"""``index_put`` through a split index with gradients, in place and not, against one process,
float64.

Two routes: an index split over mesh axes that split no dim of ``x`` (NOTE [A write through an
index split elsewhere reduces the rows it touched]; the cases of ``test_put_split_index``), and
an index split over the axes that split ``x`` along the written dim (``_put_through_split``:
the halo rows travel to their owners). For each: ``torch.index_put``, ``x.index_put_`` on a
non-leaf and ``x[i] = v``, ``accumulate`` or not, with ``x`` and the values requiring grad;
the output's values and layout (``x``'s), ``x``'s version counter after an in-place write,
and both gradients as one process, under ``"error"`` (nothing gathered). Without
``accumulate`` the indices are unique: torch leaves the result of duplicates open. Bytes per
rank (``count_traffic``, forward and backward) at or under what the default path moves with
the route off, which gathers.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from shardsci import gather_policy
from shardsci.handlers import from_local_spec
from shardsci.tensor._ops import _gather_scatter_ops
from shardsci.testing import Layout, assert_all_ranks, count_traffic, get_mesh, run_on_ranks
from tests.test_put_split_index import CASES as ELSEWHERE

# name: (mesh, x's shape, x's layout, the unique index, its layout, the values' layout)
ALONG = {
    "2r-uneven": (
        (2,),
        (7, 3),
        Layout((Shard(0),), {0: (5, 2)}),
        [6, 0, 3, 1, -2],
        Layout((Shard(0),), {0: (2, 3)}),
        Layout((Shard(0),), {0: (2, 3)}),
    ),
    "2r-empty": (
        (2,),
        (7, 3),
        Layout((Shard(0),), {0: (0, 7)}),
        [6, 0, 3, 1, 5],
        Layout((Shard(0),), {0: (5, 0)}),
        Layout((Shard(0),), {0: (5, 0)}),
    ),
    "2x2-blocks": (
        (2, 2),
        (7, 4),
        Layout((Shard(0), Shard(1)), {0: (3, 4), 1: (1, 3)}),
        [6, 0, 3, 1, 5],
        Layout((Shard(0), Replicate()), {0: (3, 2)}),
        Layout((Shard(0), Shard(1)), {0: (3, 2), 1: (1, 3)}),
    ),
    "2x2x2": (
        (2, 2, 2),
        (6, 4, 3),
        Layout((Shard(0), Shard(1), Shard(2)), {0: (2, 4), 1: (3, 1), 2: (2, 1)}),
        [5, 0, 2, 4],
        Layout((Shard(0), Replicate(), Replicate()), {0: (1, 3)}),
        Layout((Shard(0), Shard(1), Shard(2)), {0: (1, 3), 1: (3, 1), 2: (2, 1)}),
    ),
}

CASES = {f"elsewhere-{k}": v for k, v in ELSEWHERE.items()} | {
    f"along-{k}": v for k, v in ALONG.items()
}


def _sharded(mesh, values: torch.Tensor, layout: Layout):
    spec = layout.spec(mesh, values)
    return from_local_spec(spec.narrow(values).clone(), spec), spec


def _leaf(mesh, values: torch.Tensor, layout: Layout | None) -> torch.Tensor:
    """A leaf requiring grad: a ShardTensor laid out as ``layout``, or a plain tensor."""
    if layout is None:
        return values.clone().requires_grad_(True)
    spec = layout.spec(mesh, values)
    return from_local_spec(spec.narrow(values).clone(), spec).detach().requires_grad_(True)


@contextmanager
def _route_off():
    """Both split-index routes declined: ``index_put`` takes the default path, which gathers."""
    saved = _gather_scatter_ops._split_elsewhere, _gather_scatter_ops._split_adjoint
    _gather_scatter_ops._split_elsewhere = lambda *args: False
    _gather_scatter_ops._split_adjoint = lambda *args: False
    try:
        yield
    finally:
        _gather_scatter_ops._split_elsewhere, _gather_scatter_ops._split_adjoint = saved


def _inputs(name: str):
    mesh_shape, shape, layout, values, index_layout, values_layout = CASES[name]
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64)
    index = torch.tensor(values)
    v = torch.randn((*index.shape, *shape[1:]), dtype=torch.float64)
    weight = torch.randn(shape, dtype=torch.float64)  # the loss is (out * weight).sum()
    return mesh_shape, x, layout, index, index_layout, v, values_layout, weight


def _unique(index: torch.Tensor, extent: int) -> torch.Tensor:
    """``index`` with each entry naming a cell an earlier one names replaced by the first cell
    no entry names, shape kept (so the index's layout still fits)."""
    wrapped = index.remainder(extent).reshape(-1).tolist()
    free = iter(sorted(set(range(extent)) - set(wrapped)))
    seen: set[int] = set()
    out = []
    for k, cell in zip(index.reshape(-1).tolist(), wrapped):
        out.append(next(free) if cell in seen else k)
        seen.add(cell)
    return torch.tensor(out).reshape(index.shape)


def _run(name: str, how: str, accumulate: bool, *, policy: str = "error"):
    """The output ShardTensor, ``x``'s and the values' gradients (whole), and the reference's."""
    mesh_shape, x, layout, index, index_layout, v, values_layout, weight = _inputs(name)
    mesh = get_mesh(mesh_shape)
    if not accumulate:  # torch leaves the result of duplicates open
        index = _unique(index, x.shape[0])
    x_ref, v_ref = x.clone().requires_grad_(True), v.clone().requires_grad_(True)
    if how == "index_put":
        expected = torch.index_put(x_ref, (index,), v_ref, accumulate)
    else:
        expected = (x_ref * 1).index_put_((index,), v_ref, accumulate=accumulate)
    (expected * weight).sum().backward()
    i, _ = _sharded(mesh, index, index_layout)
    t = _leaf(mesh, x, layout)
    w = _leaf(mesh, v, values_layout)
    wt, _ = _sharded(mesh, weight, layout)
    with gather_policy(policy):
        if how == "index_put":
            out = torch.index_put(t, (i,), w, accumulate)
        else:
            out = t * 1
            version = out._version
            if how == "index_put_":
                returned = out.index_put_((i,), w, accumulate=accumulate)
                assert_all_ranks(returned is out, "in place")
            else:
                out[i] = w
            assert_all_ranks(out._version > version, "the version counter moved")
        (out * wt).sum().backward()
    grads = (t.grad.full_tensor(), w.grad if values_layout is None else w.grad.full_tensor())
    return out, expected.detach(), grads, (x_ref.grad, v_ref.grad)


def _matches_one_process(name: str) -> None:
    layout_of_x = CASES[name][2]
    for accumulate in (True, False):
        for how in ("index_put", "index_put_", "setitem"):
            if how == "setitem" and accumulate:
                continue
            out, expected, (gx, gv), (rx, rv) = _run(name, how, accumulate)
            what = f"{how}, accumulate={accumulate}"
            spec = layout_of_x.spec(out._spec.mesh, expected)
            assert_all_ranks(out._spec.same_layout(spec), f"{what}: layout {out._spec}")
            assert_all_ranks(torch.allclose(out.full_tensor(), expected), f"{what}: values")
            assert_all_ranks(torch.allclose(gx, rx), f"{what}: x's gradient")
            assert_all_ranks(torch.allclose(gv, rv), f"{what}: the values' gradient")


@pytest.mark.parametrize("name", list(CASES))
def test_put_with_gradients_matches_one_process(name: str) -> None:
    run_on_ranks(math.prod(CASES[name][0]), _matches_one_process, name)


# name: (x's layout, the index's layout) for x (64, 16) and 16 unique rows, on 2x2
BYTES = {
    "elsewhere-2x2": (
        Layout((Shard(0), Replicate()), {0: (40, 24)}),
        Layout((Replicate(), Shard(0)), {0: (6, 10)}),
    ),
    "along-2x2": (
        Layout((Shard(0), Replicate()), {0: (40, 24)}),
        Layout((Shard(0), Replicate()), {0: (6, 10)}),
    ),
}


def _step_bytes(name: str, accumulate: bool) -> int:
    """Bytes this rank receives for ``x.index_put_`` and its backward (``count_traffic``)."""
    layout, index_layout = BYTES[name]
    mesh = get_mesh((2, 2))
    torch.manual_seed(0)
    x, weight = torch.randn(64, 16, dtype=torch.float64), torch.randn(64, 16, dtype=torch.float64)
    index = torch.randperm(64)[:16]
    t, w = (
        _leaf(mesh, x, layout),
        _leaf(mesh, torch.randn(16, 16, dtype=torch.float64), index_layout),
    )
    i, _ = _sharded(mesh, index, index_layout)
    wt, _ = _sharded(mesh, weight, layout)
    with gather_policy("allow"), count_traffic() as traffic:
        out = t * 1
        out.index_put_((i,), w, accumulate=accumulate)
        (out * wt).sum().backward()
    return traffic.received


def _fewer_bytes_than_the_default_path(name: str) -> None:
    for accumulate in (True, False):
        ours = _step_bytes(name, accumulate)
        with _route_off():
            default = _step_bytes(name, accumulate)
        assert_all_ranks(
            ours <= default,
            f"accumulate={accumulate}: received {ours} B; with the route off {default} B",
        )


@pytest.mark.parametrize("name", list(BYTES))
def test_put_with_gradients_receives_at_most_the_default_path(name: str) -> None:
    run_on_ranks(4, _fewer_bytes_than_the_default_path, name)
