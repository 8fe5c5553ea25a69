"""A linear layer whose ranks each multiply their own rows by the whole weight is one autograd
node (NOTE [A linear layer is one autograd node] in ``shardsci/tensor/_ops/_linear_node.py``).

Against one process in float64 (values, the input's, weight's and bias's gradients, the
output's layout) on 1-D, 2x2 and 2x2x2 meshes with even, uneven and empty shards; plain and
replicated ShardTensor weights; gradients summed eagerly and by ``domain_parallel``'s sink.
Against the composition it replaces: the same bytes and collectives (``count_traffic``) and
the same second derivatives. The node count per call is pinned.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

import shardsci
from shardsci import ShardTensor
from shardsci.parallel import domain_parallel
from shardsci.tensor._ops import _matmul_ops
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    check_against_reference,
    count_traffic,
    get_mesh,
    run_on_ranks,
)


def _linear(features_in: int, features_out: int, bias: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(features_in, features_out, bias=bias, dtype=torch.float64)


def _apply(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def _composed():
    """Run the composition instead of the node (the layouts say no node)."""
    original = _matmul_ops._one_node_plan
    _matmul_ops._one_node_plan = lambda equation, operands: None
    return original


def _three_axes_body() -> None:
    mesh = get_mesh((2, 2, 2))
    x = torch.randn(3, 5, 4, 3, dtype=torch.float64)
    blocks = Layout((Shard(0), Shard(1), Shard(2)), {0: (3, 0), 1: (1, 4), 2: (2, 2)})
    check_against_reference(
        _apply,
        [x],
        [blocks],
        mesh,
        module=_linear(3, 6),
        out_layouts=[blocks],
        what="2x2x2, an empty block",
    )
    # Rows split over two axes, whole along the third.
    nested = Layout((Shard(1), Replicate(), Shard(1)), {1: (2, 0, 1, 2)})
    check_against_reference(
        F.linear,
        [x, torch.randn(2, 3, dtype=torch.float64), torch.randn(2, dtype=torch.float64)],
        [nested, Layout((Replicate(),) * 3), Layout((Replicate(),) * 3)],
        mesh,
        out_layouts=[nested],
        what="2x2x2, a replicated ShardTensor weight and bias",
    )


def test_linear_node_on_a_three_axis_mesh() -> None:
    run_on_ranks(8, _three_axes_body)


def _even_and_one_rank_body() -> None:
    world = torch.distributed.get_world_size()
    mesh = get_mesh((world,))
    rows = Layout((Shard(0),))  # torch.chunk sizes: even on 2 ranks
    x = torch.randn(6, 4, dtype=torch.float64)
    check_against_reference(
        _apply, [x], [rows], mesh, module=_linear(4, 3), out_layouts=[rows], what="2-D input"
    )
    check_against_reference(
        _apply,
        [torch.randn(4, dtype=torch.float64)],
        [Layout((Replicate(),))],
        mesh,
        module=_linear(4, 3),
        out_layouts=[Layout((Replicate(),))],
        what="a replicated 1-D input",
    )


@pytest.mark.parametrize("world", [1, 2], ids=["1r", "2r"])
def test_linear_node_even_shards_and_one_rank(world: int) -> None:
    run_on_ranks(world, _even_and_one_rank_body)


def _graph_nodes(root) -> list[str]:
    seen, names, stack = set(), [], [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def _node_count_body(wrapped: bool) -> list[str]:
    world = torch.distributed.get_world_size()
    module = _linear(4, 3)
    if wrapped:
        mesh = get_mesh((1, world), ("dp", "domain"))
        module = domain_parallel(module, mesh, dp_axis="dp", domain_axes=["domain"])
        mesh = mesh["domain"]
    else:
        mesh = get_mesh((world,))
    local = torch.randn(2, 3, 4, dtype=torch.float64)
    x = ShardTensor.from_local(local, mesh, [Shard(1)]).requires_grad_()
    terms = torch.randn(2, 4, dtype=torch.float64)
    pending = ShardTensor.from_local(terms, mesh, [Partial()]).requires_grad_()
    return [
        [n for n in _graph_nodes(out.grad_fn) if n != "AccumulateGrad"]
        for out in (module(x), F.linear(pending, module.weight))
    ]


@pytest.mark.parametrize("world", [1, 2], ids=["1r", "2r"])
@pytest.mark.parametrize("wrapped", [False, True], ids=["eager-sums", "domain-parallel"])
def test_a_linear_call_is_one_autograd_node(world: int, wrapped: bool) -> None:
    """Was 8 nodes on 2 ranks (4 Python Functions: the input's ``to_local``, the weight's and
    bias's promotions, ``from_local``; torch's views, ``t`` and ``addmm``), 6 on 1 rank; the
    linear of a pending sum 5 on 2 ranks (3 Python Functions, ``t`` and ``mm``)."""
    for nodes in run_on_ranks(world, _node_count_body, wrapped):
        assert nodes == [["_LinearNodeBackward"]] * 2, nodes


def _traffic_body(mesh_shape: tuple[int, ...]) -> list[dict]:
    mesh = get_mesh(mesh_shape)
    placements = (Shard(0),) + (Shard(1),) * (len(mesh_shape) - 1)
    whole = torch.randn(5, 7, 4, dtype=torch.float64)
    counts = []
    for composed in (False, True):
        original = _composed() if composed else None
        try:
            module = _linear(4, 3)
            sizes = {0: (3, 2), 1: (7, 0)}  # uneven, an empty block on 2x2
            x = shardsci.distribute_tensor(
                whole, mesh, placements, dict(list(sizes.items())[: mesh.ndim])
            )
            x.requires_grad_()
            with count_traffic() as traffic:
                out = module(x)
                out.backward(torch.ones_like(out))
            counts.append(
                {
                    **traffic.as_dict(),
                    "grads": [module.weight.grad.clone(), module.bias.grad.clone()],
                    "input grad": x.grad.to_local().clone(),
                }
            )
        finally:
            if original is not None:
                _matmul_ops._one_node_plan = original
    node, composition = counts
    for key in ("sent", "received", "calls", "p2p_rounds"):
        assert_all_ranks(node[key] == composition[key], f"{key}: {node[key]} != {composition}")
    for got, want in zip(
        [*node["grads"], node["input grad"]], [*composition["grads"], composition["input grad"]]
    ):
        assert_all_ranks(torch.equal(got, want), "a gradient differs from the composition's")
    return counts[0]["calls"]


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["2r", "2x2"])
def test_a_linear_node_moves_the_compositions_bytes(mesh_shape) -> None:
    """The weight's and bias's eager sums: the same all-reduces, bytes and gradients."""
    for calls in run_on_ranks(math.prod(mesh_shape), _traffic_body, mesh_shape):
        assert calls.get("all_reduce") == 2, calls


def _sink_body() -> None:
    world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    whole = torch.randn(2, 7, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    reference = _linear(4, 3)
    F.silu(reference(whole)).square().sum().backward()
    mesh = get_mesh((1, world), ("dp", "domain"))
    model = domain_parallel(_linear(4, 3), mesh, dp_axis="dp", domain_axes=["domain"])
    sizes = (4, 0, 3, 0)[:world] if world == 4 else (7,)
    start = sum(sizes[:rank])
    local = whole[:, start : start + sizes[rank]].contiguous()
    x = ShardTensor.from_local(local, mesh["domain"], [Shard(1)], {0: sizes})
    F.silu(model(x)).square().sum().full_tensor().backward()
    for name in ("weight", "bias"):
        got, want = getattr(model, name).grad, getattr(reference, name).grad
        assert_all_ranks(
            got is not None and torch.allclose(got, want, rtol=1e-12, atol=1e-12),
            f"{name}'s gradient through the sink differs from one process",
        )


@pytest.mark.parametrize("world", [1, 4], ids=["1r", "4r-empty"])
def test_a_linear_nodes_gradients_through_the_sink(world: int) -> None:
    run_on_ranks(world, _sink_body)


def _second_derivative_body() -> list[torch.Tensor]:
    mesh = get_mesh((torch.distributed.get_world_size(),))
    whole = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    results = []
    for composed in (False, True):
        original = _composed() if composed else None
        try:
            module = _linear(4, 3)
            x = shardsci.distribute_tensor(whole, mesh, [Shard(0)], {0: (2, 1)})
            x.requires_grad_()
            out = module(x).sum().full_tensor()
            (weight_grad,) = torch.autograd.grad(out, module.weight, create_graph=True)
            (x_grad,) = torch.autograd.grad(weight_grad.square().sum(), x)
            results.append(x_grad.full_tensor())
        finally:
            if original is not None:
                _matmul_ops._one_node_plan = original
    leaf = whole.clone().requires_grad_()
    module = _linear(4, 3)
    (weight_grad,) = torch.autograd.grad(module(leaf).sum(), module.weight, create_graph=True)
    (want,) = torch.autograd.grad(weight_grad.square().sum(), leaf)
    return [*results, want]


def test_a_linear_nodes_second_derivative_is_the_compositions() -> None:
    """``create_graph=True``: the node differentiates the composition (NOTE above)."""
    for node, composition, one_process in run_on_ranks(2, _second_derivative_body):
        assert torch.allclose(node, composition, rtol=1e-12, atol=1e-12)
        assert torch.allclose(node, one_process, rtol=1e-12, atol=1e-12)
