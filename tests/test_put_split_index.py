"""``index_put`` through an index split over mesh axes that split no dim of ``x``, against one
process, float64 (NOTE [A write through an index split elsewhere reduces the rows it touched]).

``x.index_put_((i,), v, accumulate=...)``, ``torch.index_put`` and ``x[i] = v`` with the index
split over one axis and ``x`` split along the written dim over another (or replicated), the
values split like the index (or whole): values and ``x``'s layout as one process, on 2x2
uneven, 2x2 with empty shards of ``x`` and the index, a 2-D index, ``x`` replicated on two
ranks, and 2x2x2; and bytes per rank by ``count_traffic`` below the gathered fallback's. Under
``"error"``: nothing is gathered. Duplicate entries are summed across ranks (``accumulate``);
without it, duplicates carry equal values, since torch leaves the choice among them open.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from shardsci import gather_policy
from shardsci.handlers import from_local_spec
from shardsci.tensor._ops._gathered_ops import gathered
from shardsci.testing import Layout, assert_all_ranks, count_traffic, get_mesh, run_on_ranks

aten = torch.ops.aten

# name: (mesh, x's shape, x's layout, the index, its layout, the values' layout)
CASES = {
    "2x2-uneven": (
        (2, 2),
        (6, 5),
        Layout((Shard(0), Replicate()), {0: (4, 2)}),
        [3, 0, 3, 5, -3],
        Layout((Replicate(), Shard(0)), {0: (2, 3)}),
        Layout((Replicate(), Shard(0)), {0: (2, 3)}),
    ),
    "2x2-empty": (
        (2, 2),
        (6, 5),
        Layout((Shard(0), Replicate()), {0: (0, 6)}),
        [3, 0, 3, 5, -3],
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
    "2x2-whole-values": (
        (2, 2),
        (6, 5),
        Layout((Replicate(), Shard(1)), {1: (2, 3)}),  # written along its unsplit dim 0
        [[5, 0, 3], [3, 1, -1]],
        Layout((Shard(1), Replicate()), {1: (2, 1)}),
        None,  # a plain tensor
    ),
    "2r-replicated-x": (
        (2,),
        (6, 5),
        Layout((Replicate(),), {}),
        [3, 0, 3, 5, -3],
        Layout((Shard(0),), {0: (3, 2)}),
        Layout((Shard(0),), {0: (3, 2)}),
    ),
    "2x2x2-uneven": (
        (2, 2, 2),
        (6, 5, 4),
        Layout((Shard(0), Replicate(), Shard(2)), {0: (4, 2), 2: (1, 3)}),
        [4, 1, 5, 1, 2],
        Layout((Replicate(), Shard(0), Replicate()), {0: (1, 4)}),
        Layout((Replicate(), Shard(0), Shard(2)), {0: (1, 4), 2: (1, 3)}),
    ),
}


def _sharded(mesh, values: torch.Tensor, layout: Layout):
    spec = layout.spec(mesh, values)
    return from_local_spec(spec.narrow(values).clone(), spec), spec  # not a view of values


def _distinct(index: torch.Tensor, extent: int) -> torch.Tensor:
    """Entries of equal cells get equal numbers: without ``accumulate`` every duplicate writes
    the same value, whichever one wins."""
    return index.remainder(extent).to(torch.float64)


def _matches_one_process(name: str) -> None:
    mesh_shape, shape, layout, values, index_layout, values_layout = CASES[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64)
    index = torch.tensor(values)
    read_shape = (*index.shape, *shape[1:])
    v = torch.randn(read_shape, dtype=torch.float64)
    same = _distinct(index, shape[0]).reshape(*index.shape, *(1,) * (len(shape) - 1))
    v_set = same.expand(read_shape) + torch.arange(math.prod(shape[1:])).reshape(shape[1:])
    i, _ = _sharded(mesh, index, index_layout)
    for accumulate, written in ((True, v), (False, v_set)):
        expected = x.index_put((index,), written, accumulate=accumulate)
        w = written if values_layout is None else _sharded(mesh, written, values_layout)[0]
        for how in ("index_put_", "index_put", "setitem"):
            if how == "setitem" and accumulate:
                continue
            t, spec = _sharded(mesh, x, layout)
            with gather_policy("error"):
                if how == "index_put_":
                    out = t.index_put_((i,), w, accumulate=accumulate)
                    assert_all_ranks(out is t, "in place")
                elif how == "index_put":
                    out = torch.index_put(t, (i,), w, accumulate)
                else:
                    t[i] = w
                    out = t
            what = f"{how}, accumulate={accumulate}"
            assert_all_ranks(out._spec.same_layout(spec), f"{what}: layout {out._spec}")
            assert_all_ranks(torch.allclose(out.full_tensor(), expected), f"{what}: values")


@pytest.mark.parametrize("name", list(CASES))
def test_put_through_split_index_matches_one_process(name: str) -> None:
    run_on_ranks(math.prod(CASES[name][0]), _matches_one_process, name)


def _fewer_bytes_than_the_fallback() -> None:
    """x (64, 64) split 40/24 along dim 0; 16 rows written through an index split 6/10 over
    axis 1, values split alike: bytes per rank below the gathered fallback's."""
    mesh = get_mesh((2, 2))
    torch.manual_seed(0)
    x = torch.randn(64, 64, dtype=torch.float64)
    index = torch.randperm(64)[:16]
    v = torch.randn(16, 64, dtype=torch.float64)
    parts = Layout((Replicate(), Shard(0)), {0: (6, 10)})
    i, _ = _sharded(mesh, index, parts)
    w, _ = _sharded(mesh, v, parts)
    for accumulate in (True, False):
        t, spec = _sharded(mesh, x, Layout((Shard(0), Replicate()), {0: (40, 24)}))
        with gather_policy("allow"):
            with count_traffic() as ours:
                out = torch.index_put(t, (i,), w, accumulate)
            with count_traffic() as fallback:
                whole = gathered(aten.index_put.default, (t, [i], w, accumulate), {})
        expected = x.index_put((index,), v, accumulate=accumulate)
        assert_all_ranks(torch.allclose(out.full_tensor(), expected), "values")
        assert_all_ranks(out._spec.same_layout(spec), f"layout {out._spec}")
        assert_all_ranks(torch.allclose(whole.full_tensor(), expected), "fallback values")
        assert_all_ranks(
            ours.received < fallback.received,
            f"received {ours.received} B; the fallback {fallback.received} B",
        )


def test_put_through_split_index_receives_less_than_the_fallback() -> None:
    run_on_ranks(4, _fewer_bytes_than_the_fallback)
