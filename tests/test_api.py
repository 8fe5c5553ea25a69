"""ShardTensor's public surface: offsets, sharding shapes, DTensor interop, handler registries."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.overrides import TorchFunctionMode

import shardsci
from shardsci.handlers import scoped_handlers
from shardsci.testing import assert_all_ranks, assert_close_all_ranks, get_mesh, run_on_ranks

SIZES = (0, 3, 4, 2)


def _offsets_and_shapes_body() -> None:
    mesh = get_mesh((2, 2))
    x = shardsci.distribute_tensor(
        torch.arange(5 * 6.0).reshape(5, 6), mesh, [Shard(0), Shard(1)], {0: (3, 2), 1: (1, 5)}
    )
    row, col = mesh.get_coordinate()
    expected_offsets = ((0, 3)[row], (0, 1)[col])
    assert_all_ranks(x.offsets() == expected_offsets, f"offsets {x.offsets()}")
    assert_all_ranks(x.offsets(0) == expected_offsets[0] and x.offsets(1) == expected_offsets[1])
    shapes = x.sharding_shapes()
    expected = {
        0: (torch.Size([3, (1, 5)[col]]), torch.Size([2, (1, 5)[col]])),
        1: (torch.Size([(3, 2)[row], 1]), torch.Size([(3, 2)[row], 5])),
    }
    assert_all_ranks(shapes == expected, f"sharding_shapes {shapes}")
    # The PhysicsNeMo form round-trips through from_local without communication.
    again = shardsci.ShardTensor.from_local(x.to_local(), mesh, x.placements, shapes)
    assert_close_all_ranks(again.full_tensor(), x.full_tensor(), atol=0, rtol=0, what="again")


def test_offsets_and_sharding_shapes() -> None:
    run_on_ranks(4, _offsets_and_shapes_body)


def _dtensor_interop_body() -> None:
    mesh = get_mesh((4,))
    whole = torch.randn(10, 3, dtype=torch.float64)
    dtensor = distribute_tensor(whole, mesh, [Shard(0)])
    from_dt = shardsci.ShardTensor.from_dtensor(dtensor)
    assert_close_all_ranks(from_dt.full_tensor(), whole, atol=0, rtol=0, what="from_dtensor")
    uneven = shardsci.distribute_tensor(whole, mesh, [Shard(0)], {0: (1, 6, 0, 3)})
    back = uneven.to_dtensor()
    assert_all_ranks(isinstance(back, DTensor) and not isinstance(back, shardsci.ShardTensor))
    assert_close_all_ranks(back.full_tensor(), whole, atol=0, rtol=0, what="to_dtensor")
    assert_close_all_ranks(back.to_local(), dtensor.to_local(), atol=0, rtol=0, what="chunk shard")
    # Gradients cross the DTensor boundary both ways.
    leaf = dtensor.to_local().clone().requires_grad_(True)
    through = DTensor.from_local(leaf, mesh, [Shard(0)], shape=whole.shape, stride=whole.stride())
    out = shardsci.ShardTensor.from_dtensor(through)
    (out * 3).sum().full_tensor().backward()
    assert_close_all_ranks(leaf.grad, torch.full_like(leaf, 3), atol=0, rtol=0, what="grad")


def test_dtensor_interop() -> None:
    run_on_ranks(4, _dtensor_interop_body)


# ---------------------------------------------------------------------------- registries
_LIB = torch.library.Library("shardsci_test", "DEF")
_LIB.define("twice(Tensor x) -> Tensor")
_LIB.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")
_LIB.impl("twice", lambda x: torch.empty_like(x), "Meta")


def _twice_handler(func, args, kwargs):
    x = args[0]
    return shardsci.ShardTensor(x.local * 2 + 1000, x.spec)


def _tanh_declines_unless_replicated(func, args, kwargs):
    x = args[0]
    if any(isinstance(p, Shard) for p in x.placements):
        return NotImplemented
    return shardsci.ShardTensor(torch.full_like(x.local, 7.0), x.spec)


def _registry_body() -> None:
    mesh = get_mesh((2,))
    x = shardsci.distribute_tensor(torch.ones(5), mesh, [Shard(0)], {0: (5, 0)})
    with scoped_handlers():  # the handlers must not outlive this test in the rank pool
        shardsci.register_aten_handler("shardsci_test::twice")(_twice_handler)
        shardsci.register_function_handler(torch.Tensor.tanh)(_tanh_declines_unless_replicated)
        custom = torch.ops.shardsci_test.twice(x).full_tensor()
        assert_close_all_ranks(custom, torch.full((5,), 1002.0), atol=0, rtol=0, what="by name")
        declined = x.tanh().full_tensor()
        assert_close_all_ranks(declined, torch.ones(5).tanh(), atol=0, rtol=0, what="declined")
        replicated = x.redistribute(placements=[Replicate()])
        handled = replicated.tanh().full_tensor()
        assert_close_all_ranks(handled, torch.full((5,), 7.0), atol=0, rtol=0, what="handled")
    after = replicated.tanh().full_tensor()
    assert_close_all_ranks(after, torch.ones(5).tanh(), atol=0, rtol=0, what="after the scope")


def test_handlers_by_name_and_declining() -> None:
    run_on_ranks(2, _registry_body)


def _autograd_grad_body() -> None:
    mesh = get_mesh((2,))
    sizes = (3, 2)
    x = torch.randn(5, 4, dtype=torch.float64)
    weight = torch.randn(4, dtype=torch.float64, requires_grad=True)
    rank = mesh.get_local_rank()
    offset = (0, 3)[rank]
    local = x[offset : offset + sizes[rank]].clone().requires_grad_()
    sharded = shardsci.ShardTensor.from_local(local, mesh, [Shard(0)], {0: sizes})
    loss = (sharded * weight).sin().sum()
    got_local, got_weight = torch.autograd.grad(loss, [local, weight])
    whole = x.clone().requires_grad_()
    reference = weight.detach().clone().requires_grad_()
    want_x, want_weight = torch.autograd.grad((whole * reference).sin().sum(), [whole, reference])
    exact = dict(atol=1e-12, rtol=1e-12)
    assert_close_all_ranks(got_local, want_x[offset : offset + sizes[rank]], **exact, what="input")
    assert_close_all_ranks(got_weight, want_weight, **exact, what="weight")


def test_autograd_grad_of_a_sharded_loss_reaches_plain_tensor_inputs() -> None:
    """``torch.autograd.grad(loss, [local_shard, weight])``, as a physics-informed loss takes
    derivatives: plain tensors among the inputs are graph nodes, not operands to promote (a
    promoted copy is a node nothing depends on, and autograd.grad raised)."""
    run_on_ranks(2, _autograd_grad_body)


# ---------------------------------------------------------------------------- metadata reads
class _FunctionCalls(TorchFunctionMode):
    """Records every call on a ShardTensor that reaches ``__torch_function__`` while active
    (a mode sees plain tensors' getters too, which without a mode cost no Python)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if any(isinstance(a, shardsci.ShardTensor) for a in args):
            self.calls.append(func)
        return func(*args, **(kwargs or {}))


def _metadata_reads_body() -> None:
    mesh = get_mesh((2,))
    x = shardsci.distribute_tensor(
        torch.arange(60.0, dtype=torch.float64).reshape(5, 6, 2), mesh, [Shard(0)], {0: (5, 0)}
    ).requires_grad_()
    squeezed = x.detach().clone()[:, :1]
    squeezed.squeeze_(1)  # in place: the wrapper and its spec both change
    pending = x.detach().sum(0)  # Partial
    pending.mul_(2.0)  # still pending, made in place
    whole = x.detach().sum(0)
    whole.add_(1.0)  # reduced in place
    (x.float() * 3).sum().full_tensor().backward()
    cases = {
        "uneven, empty shard": x,
        "float32": x.float(),
        "squeezed in place": squeezed,
        "Partial": pending,
        "reduced in place": whole,
        "0-d": x.detach().sum(),
        "gradient": x.grad,
    }
    for name, t in cases.items():
        with _FunctionCalls() as seen:
            read = (t.shape, t.dtype, t.ndim, t.device)
        assert_all_ranks(
            not seen.calls, f"{name}: metadata reads reached __torch_function__: {seen.calls}"
        )
        # torch's own getters (through __torch_function__): the wrapper's metadata
        wrapper = (
            torch.Tensor.shape.__get__(t),
            torch.Tensor.dtype.__get__(t),
            torch.Tensor.ndim.__get__(t),
            torch.Tensor.device.__get__(t),
        )
        assert_all_ranks(
            read == wrapper and type(read[0]) is torch.Size, f"{name}: {read} != {wrapper}"
        )


def test_metadata_reads_skip_torch_function_and_match_the_wrapper() -> None:
    """NOTE [Metadata reads skip __torch_function__]: ``shape``, ``dtype``, ``ndim`` and
    ``device`` of a ShardTensor call no Python dispatch and equal the wrapper's own metadata,
    also after the ops that replace a ShardTensor's layout in place."""
    run_on_ranks(2, _metadata_reads_body)
