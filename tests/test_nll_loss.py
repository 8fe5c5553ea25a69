"""``nll_loss`` and ``cross_entropy`` on split fields, against one process in float64 (NOTE [A
loss over split classes is a pending sum] in ``shardsci/tensor/_ops/_loss_ops.py``): class,
batch and spatial dims split, 2 ranks uneven, 4 with empty shards, 2x2; reductions none, mean
and sum, class weights, an ``ignore_index`` some targets hit; values, the input's gradient and
the loss's layout; and the bytes, counted by ``count_traffic``: a mean moves one scalar.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

from shardsci.tensor._api import from_local_spec
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    check_against_reference,
    count_traffic,
    get_mesh,
    run_on_ranks,
)

# (N, C, H, W) = (3, 5, 7, 2) scores: mesh, layout.
CASES = {
    "2r-C-2/3": ((2,), Layout((Shard(1),), {1: (2, 3)})),
    "2r-N-1/2": ((2,), Layout((Shard(0),), {0: (1, 2)})),
    "4r-C-0/2/3/0": ((4,), Layout((Shard(1),), {1: (0, 2, 3, 0)})),
    "4r-H-3/0/4/0": ((4,), Layout((Shard(2),), {2: (3, 0, 4, 0)})),
    "2x2-N-and-C": ((2, 2), Layout((Shard(0), Shard(1)), {0: (2, 1), 1: (4, 1)})),
    "2x2-H-and-C": ((2, 2), Layout((Shard(2), Shard(1)), {2: (5, 2), 1: (0, 5)})),
}
SHAPE = (3, 5, 7, 2)
IGNORED = 2  # a class index some targets take, ignored where the variant says so
# name -> (loss, keyword arguments)
VARIANTS = {
    "nll-none": (F.nll_loss, {"reduction": "none"}),
    "nll-mean": (F.nll_loss, {}),
    "nll-sum-weighted": (F.nll_loss, {"reduction": "sum", "weight": "w"}),
    "nll-mean-weighted-ignored": (F.nll_loss, {"weight": "w", "ignore_index": IGNORED}),
    "nll-none-ignored": (F.nll_loss, {"reduction": "none", "ignore_index": IGNORED}),
    "cross-entropy-mean-weighted": (F.cross_entropy, {"weight": "w"}),
    "cross-entropy-none-ignored": (F.cross_entropy, {"reduction": "none", "ignore_index": 0}),
}


def _expected(layout: Layout, reduction: str) -> Layout:
    """Per target: the scores' split of N, H and W (renumbered), a pending sum over the class
    axes; a scalar: a pending sum over every axis that splits the scores."""
    if reduction != "none":
        return Layout(tuple(Partial() if isinstance(p, Shard) else p for p in layout.placements))
    placements = tuple(
        Partial() if p == Shard(1) else Shard(p.dim - (p.dim > 1)) if isinstance(p, Shard) else p
        for p in layout.placements
    )
    sizes = {d - (d > 1): s for d, s in layout.sizes.items() if d != 1}
    return Layout(placements, sizes)


def _loss_body(name: str, variant: str) -> None:
    mesh_shape, layout = CASES[name]
    mesh = get_mesh(mesh_shape)
    loss, kwargs = VARIANTS[variant]
    torch.manual_seed(0)
    scores = torch.randn(SHAPE, dtype=torch.float64)
    target = torch.randint(0, SHAPE[1], (SHAPE[0], *SHAPE[2:]))
    weight = torch.rand(SHAPE[1], dtype=torch.float64) + 0.5
    kwargs = {k: weight if v == "w" else v for k, v in kwargs.items()}
    check_against_reference(
        lambda x, t: loss(x, t, **kwargs),
        [scores, target],
        [layout, None],
        mesh,
        out_layouts=[_expected(layout, kwargs.get("reduction", "mean"))],
        what=f"{name} {variant}",
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name", list(CASES))
def test_loss_equals_one_process(name: str, variant: str) -> None:
    run_on_ranks(math.prod(CASES[name][0]), _loss_body, name, variant)


def _bytes_body(name: str) -> None:
    """A weighted mean of ``nll_loss``: the forward all-reduces the total weight (one scalar)
    over the axes splitting the targets, reading the loss all-reduces one scalar, and the
    backward moves nothing."""
    mesh_shape, layout = CASES[name]
    mesh = get_mesh(mesh_shape)
    scores = torch.randn(SHAPE, dtype=torch.float64)
    target = torch.randint(0, SHAPE[1], (SHAPE[0], *SHAPE[2:]))
    weight = torch.rand(SHAPE[1], dtype=torch.float64)
    spec = layout.spec(mesh, scores)
    x = from_local_spec(spec.narrow(scores).requires_grad_(True), spec)
    with count_traffic() as forward:
        loss = F.nll_loss(x, target, weight=weight)
    with count_traffic() as read:
        value = loss.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
    with count_traffic() as backward:
        value.backward()
    splits_targets = any(p != Shard(1) for p in layout.placements)
    scalar = lambda n: 2 * (n - 1) * 8 // n  # noqa: E731  an all-reduce of one float64, n ranks
    got = {
        step: (dict(t.received_by_kind), t.collective_calls)
        for step, t in {"forward": forward, "read": read, "backward": backward}.items()
    }
    target_ranks = math.prod(n for n, p in zip(mesh_shape, layout.placements) if p != Shard(1))
    expected = {
        "forward": ({"all_reduce": scalar(target_ranks)}, 1) if splits_targets else ({}, 0),
        "read": ({"all_reduce": scalar(math.prod(mesh_shape))}, 1),
        "backward": ({}, 0),
    }
    assert_all_ranks(got == expected, f"{name}: received, collectives {got}; expected {expected}")


@pytest.mark.parametrize("name", ["2r-C-2/3", "4r-H-3/0/4/0"])
def test_a_mean_moves_scalars(name: str) -> None:
    run_on_ranks(math.prod(CASES[name][0]), _bytes_body, name)
