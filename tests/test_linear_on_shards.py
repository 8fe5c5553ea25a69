"""``F.linear`` on ShardTensors runs torch's linear on the shards, its bias added inside the
kernel where each rank holds whole output rows and afterwards elsewhere (NOTE [A linear layer
runs torch's linear on the shards]); a product's layout is worked out once per value of its
operands (NOTE [A product's layout is worked out once per value]). Against one process in
float64: values, every gradient (input, weight, bias) and the output's layout."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

import shardsci
from shardsci import attention_exchange
from shardsci.tensor._api import from_local_spec
from shardsci.tensor._ops import _matmul_ops
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    check_against_reference,
    count_traffic,
    get_mesh,
    run_on_ranks,
)

TOKENS = (3, 0, 5, 3)  # uneven, one rank empty


def _linear(features_in: int, features_out: int, bias: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(features_in, features_out, bias=bias, dtype=torch.float64)


def _one_axis_body() -> None:
    mesh = get_mesh((4,))
    rows = Layout((Shard(1),), {1: TOKENS})
    x = torch.randn(2, 11, 4, dtype=torch.float64)
    for name, module in {
        "bias folded": _linear(4, 7),
        "no bias": _linear(4, 7, bias=False),
    }.items():
        check_against_reference(
            lambda m, a: m(a), [x], [rows], mesh, module=module, out_layouts=[rows], what=name
        )
    # A bias given as a replicated ShardTensor is folded too, its gradient summed over the mesh.
    w, b = torch.randn(7, 4, dtype=torch.float64), torch.randn(7, dtype=torch.float64)
    check_against_reference(
        F.linear,
        [x, w, b],
        [rows, None, Layout((Replicate(),))],
        mesh,
        out_layouts=[rows],
        what="replicated ShardTensor bias",
    )
    # The input features sharded: a pending sum over the mesh, the bias added afterwards.
    features = Layout((Shard(2),), {2: TOKENS})
    check_against_reference(
        lambda m, a: m(a),
        [torch.randn(2, 3, 11, dtype=torch.float64)],
        [features],
        mesh,
        module=_linear(11, 5),
        out_layouts=[Layout((Partial(),))],
        what="features sharded",
    )
    # A pending sum of whole tensors, no bias: each rank's term through torch's linear, the
    # output pending the same way (NOTE [A linear layer of a pending sum runs on each rank's
    # term]); with a bias, the default path.
    for bias in (False, True):
        check_against_reference(
            lambda m, a: m(a.sum(1)),
            [x],
            [rows],
            mesh,
            module=_linear(4, 7, bias=bias),
            out_layouts=[Layout((Partial(),))],
            what=f"a pending sum, bias {bias}",
        )
    # Rows and output features sharded over one axis (a ring product): the bias afterwards.
    # The ring is asked for ("auto" would all-gather these few rows of the weight), and its
    # forward checked by count_traffic: the weight's rows move one block a hop, so no rank
    # receives more at once than the largest block of another rank (an all-gather: all it
    # lacks).
    tokens = Layout((Shard(0),), {0: TOKENS})
    a, w = torch.randn(11, 4, dtype=torch.float64), torch.randn(11, 4, dtype=torch.float64)
    with attention_exchange("ring"):
        check_against_reference(
            F.linear,
            [a, w, b[:1]],
            [tokens, tokens, None],
            mesh,
            out_layouts=[tokens],
            not_a_gather="the weight's rows are the ring's moving operand",
            what="ring",
        )
        spec = tokens.spec(mesh, a)
        with torch.no_grad(), count_traffic() as traffic:
            F.linear(*(from_local_spec(spec.narrow(t), spec) for t in (a, w)), b[:1])
    me = torch.distributed.get_rank()
    block = max(n for rank, n in enumerate(TOKENS) if rank != me) * w[0].nbytes
    assert_all_ranks(
        traffic.largest_received == block,
        f"ring: largest receive {traffic.largest_received} B, expected one block, {block} B",
    )


def test_linear_on_one_mesh_axis() -> None:
    run_on_ranks(4, _one_axis_body)


def _two_axes_body() -> None:
    mesh = get_mesh((2, 2))
    blocks = Layout((Shard(0), Shard(1)), {0: (1, 3), 1: (6, 0)})
    check_against_reference(
        lambda m, a: m(a),
        [torch.randn(4, 6, 3, dtype=torch.float64)],
        [blocks],
        mesh,
        module=_linear(3, 2),
        out_layouts=[blocks],
        what="2x2, an empty block",
    )
    # Features sharded over one axis, rows over the other: pending over the first only.
    mixed = Layout((Shard(1), Shard(0)), {1: (2, 4), 0: (3, 1)})
    check_against_reference(
        lambda m, a: m(a),
        [torch.randn(4, 6, dtype=torch.float64)],
        [mixed],
        mesh,
        module=_linear(6, 5),
        out_layouts=[Layout((Partial(), Shard(0)), {0: (3, 1)})],
        what="2x2, features and rows sharded",
    )
    # A pending sum over both axes, of a 1-D input.
    check_against_reference(
        lambda m, a: m(a.sum((0, 1))),
        [torch.randn(4, 6, 3, dtype=torch.float64)],
        [blocks],
        mesh,
        module=_linear(3, 2, bias=False),
        out_layouts=[Layout((Partial(), Partial()))],
        what="2x2, a pending sum over both axes",
    )


def test_linear_on_a_two_axis_mesh() -> None:
    run_on_ranks(4, _two_axes_body)


def _pending_sum_paths_body() -> dict[str, dict[str, int]]:
    """The dispatch paths of the linear of a pending sum, forward and backward (the sum
    made before the tally)."""
    from shardsci.tensor._dispatch import tally_paths

    mesh = get_mesh((2, 2))
    x = shardsci.distribute_tensor(
        torch.randn(4, 6, 3, dtype=torch.float64, requires_grad=True),
        mesh,
        [Shard(0), Shard(1)],
        {0: (1, 3), 1: (4, 2)},  # two holders per axis: a pending sum over both
    )
    pending = x.sum((0, 1))
    weight = _linear(3, 2, bias=False).weight
    with tally_paths() as tally:
        out = F.linear(pending, weight)
    assert out.placements == (Partial(), Partial())
    ones = shardsci.distribute_tensor(torch.ones(2, dtype=torch.float64), mesh, [Replicate()] * 2)
    with tally_paths() as backward:
        torch.autograd.grad(out, (pending, weight), ones)
    return {"forward": dict(tally.ops), "backward": dict(backward.ops)}


def test_the_linear_of_a_pending_sum_dispatches_no_planned_op() -> None:
    """Was: a transpose, a view and a matrix product planned on ShardTensors (propagation),
    again in backward."""
    for paths in run_on_ranks(4, _pending_sum_paths_body):
        assert "propagation" not in paths["forward"] | paths["backward"], paths


def _layouts_worked_out_body() -> list[int]:
    """How often each product's output layout is built over three calls of the same layouts."""
    shardsci.clear_caches()
    mesh = get_mesh((2,))
    x = shardsci.distribute_tensor(torch.ones(2, 5, 4), mesh, [Shard(1)], {0: (4, 1)})
    module, w = _linear(4, 3).float(), torch.ones(4, 2)
    built = []
    original = _matmul_ops._output_spec

    def counted(*args, **kwargs):
        built.append(args[0])
        return original(*args, **kwargs)

    _matmul_ops._output_spec = counted
    try:
        counts = []
        for _ in range(3):
            module(x).sum().full_tensor().backward()
            torch.einsum("bli,io->blo", x, w)
            x @ w
            counts.append(len(built))
    finally:
        _matmul_ops._output_spec = original
    return counts


def test_a_product_layout_is_worked_out_once_per_value() -> None:
    """NOTE [A product's layout is worked out once per value]: the second and third calls
    build no output layout (linear, einsum and matmul: 3 layouts on the first)."""
    for counts in run_on_ranks(2, _layouts_worked_out_body):
        assert counts == [3, 3, 3], counts
