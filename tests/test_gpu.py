"""What needs a GPU (``-m gpu``): ShardTensors, halos, collectives and a training step of every
zoo model on CUDA, in a world of one rank with NCCL, each against plain torch on the same GPU.
A convolution under ``overlap_halos()`` needs a split dim, which one rank cannot have (it is
the local op there: NOTE [A windowed op on unsplit dims is the local op]):
``scripts/gpu_two_ranks.py`` runs it on two ranks sharing the GPU.

Skipped without CUDA (every test here is marked ``gpu``). ``scripts/gpu_check.sh`` runs them on
a GPU machine. ``SHARDSCI_TEST_DEVICE=cpu pytest -m gpu tests/test_gpu.py`` runs the same
bodies on the CPU with gloo, which is what ``scripts/gpu_check.sh --device cpu``
does, so they are kept runnable between GPU runs; a world of one rank cannot show that
buffers are on the right device when the device is the CPU (``tests/test_meta_device.py``
checks that on every zoo model without a GPU).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from scipy.spatial import Delaunay
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardsci import Partial, Replicate, Shard, ShardTensor, distribute_tensor, halo_exchange
from shardsci.graph import GraphPartition, PartitionedGraph, partition_nodes
from shardsci.models import MeshGraphNet
from shardsci.parallel import domain_parallel
from shardsci.tensor import clear_caches
from shardsci.testing import count_traffic
from tests.zoo import MODELS

pytestmark = pytest.mark.gpu

DEVICE = torch.device(os.environ.get("SHARDSCI_TEST_DEVICE", "cuda"))
NO_DEVICE = (
    "no CUDA device here: run `scripts/gpu_check.sh` on a GPU machine (or these bodies on the "
    "CPU with SHARDSCI_TEST_DEVICE=cpu)"
)


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    """A one-rank mesh on ``DEVICE``: NCCL on a GPU, gloo on the CPU."""
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        pytest.skip(NO_DEVICE)
    if dist.is_initialized():
        pytest.fail("tests/test_gpu.py needs a process without a default process group")
    if DEVICE.type == "cuda":
        torch.cuda.set_device(DEVICE.index or 0)
    dist.init_process_group(
        "nccl" if DEVICE.type == "cuda" else "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=120),
    )
    try:
        yield init_device_mesh(DEVICE.type, (1,), mesh_dim_names=("domain",))
    finally:
        dist.destroy_process_group()
        clear_caches()


@pytest.fixture(autouse=True)
def exact_float32() -> Iterator[None]:
    """TF32 off: the comparisons below are in float64 anyway, but a float32 path must not
    differ from plain torch by TF32's 1e-3. Set as ``torch.backends.cudnn.flags()`` sets them:
    once PyTorch's test utilities are imported (tests/test_op_db.py's OpInfos, collected in
    the same session) the backends' flags refuse plain assignment."""
    allow_mutation = torch.backends.__allow_nonbracketed_mutation
    matmul = torch.backends.cuda.matmul.allow_tf32
    cudnn = torch.backends.cudnn.allow_tf32
    with allow_mutation():
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    with allow_mutation():
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def _on_device(t: torch.Tensor) -> bool:
    local = t.to_local() if isinstance(t, ShardTensor) else t
    return local.device.type == DEVICE.type


def _field(*shape: int) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(shape, dtype=torch.float64, device=DEVICE)


def test_a_shardtensor_computes_on_the_device(mesh: DeviceMesh) -> None:
    x = _field(2, 3, 8, 6)
    sharded = distribute_tensor(x, mesh, [Shard(2)])
    y = (sharded * 2 + 1).relu().sum(dim=3).softmax(dim=1)
    assert isinstance(y, ShardTensor) and _on_device(y)
    assert y.placements == (Shard(2),) and y.shape == (2, 3, 8)
    torch.testing.assert_close(y.full_tensor(), (x * 2 + 1).relu().sum(dim=3).softmax(dim=1))


def test_a_halo_exchange_and_a_periodic_convolution(mesh: DeviceMesh) -> None:
    x = _field(2, 3, 8, 6)
    sharded = distribute_tensor(x, mesh, [Shard(2)])
    extended = halo_exchange(sharded, {2: 1, 3: 2}, "periodic")
    assert _on_device(extended)
    torch.testing.assert_close(extended, F.pad(x, (2, 2, 1, 1), mode="circular"))

    torch.manual_seed(1)
    conv = nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular").double().to(DEVICE)
    leaf = sharded.detach().requires_grad_()
    out = conv(leaf)
    out.square().sum().backward()
    assert _on_device(out) and _on_device(leaf.grad)
    plain = x.clone().requires_grad_()
    expected = copy.deepcopy(conv)(plain)
    expected.square().sum().backward()
    torch.testing.assert_close(out.full_tensor(), expected)
    torch.testing.assert_close(leaf.grad.full_tensor(), plain.grad)


def test_the_side_stream_is_ordered_after_the_producer_and_before_the_consumer(
    mesh: DeviceMesh,
) -> None:
    """The stream path of a halo half on real streams, with a message made on the side stream
    (a copy of the shard, as the packing reads it) in place of one from another rank: the
    producer writes the shard after a long kernel, so the side stream reads stale cells unless
    it waits for the producer; the consumer reads the message at once, so it reads unwritten
    cells unless it waits for the side stream (NOTE [Halo overlap on streams])."""
    if DEVICE.type != "cuda":
        pytest.skip("streams: CUDA only")
    from shardsci.tensor._collectives import PendingMessages
    from shardsci.tensor._halo import _posted_aside

    def post(keep):
        message = torch.full_like(source, -1.0)
        torch.cuda._sleep(50_000_000)  # the side stream is slow too: the consumer must wait
        message.copy_(source)
        return PendingMessages(
            [],
            [message.view(torch.uint8).view(-1)],
            [source.shape],
            source.dtype,
            "halo",
            0,
            counted=False,
        )

    for _ in range(3):
        source = torch.zeros(1 << 20, dtype=torch.float64, device=DEVICE)
        torch.cuda._sleep(50_000_000)  # about 25 ms on the consumer stream
        source.fill_(7.0)
        (received,) = _posted_aside(post, source).wait()
        assert bool((received == 7.0).all())
        torch.cuda.synchronize()


def test_collectives_reduce_and_gather_on_the_device(mesh: DeviceMesh) -> None:
    """A Partial sum all-reduced and a shard all-gathered, through the process group."""
    x = _field(4, 5)
    sharded = distribute_tensor(x, mesh, [Shard(0)])
    with count_traffic() as traffic:
        total = sharded.sum()
        assert total.placements == (Partial(),)
        whole = total.full_tensor()
        gathered = sharded.redistribute(mesh, [Replicate()]).to_local()
    assert _on_device(whole) and _on_device(gathered)
    torch.testing.assert_close(whole, x.sum())
    torch.testing.assert_close(gathered, x)
    assert not traffic.unknown


def _zoo_input(name: str) -> torch.Tensor:
    return _field(1, 2, 8, 6, 6) if name.endswith("3d") else _field(2, 2, 12, 8)


@pytest.mark.parametrize("name", list(MODELS))
def test_a_zoo_training_step(mesh: DeviceMesh, name: str) -> None:
    """Forward, backward and an AdamW step on a ShardTensor equal plain torch on the device,
    float64, every gradient on the device."""
    torch.manual_seed(0)
    plain = MODELS[name]().double().to(DEVICE)
    model = domain_parallel(copy.deepcopy(plain), mesh, domain_axes=["domain"])
    x = _zoo_input(name)
    _train_step(plain, lambda: plain(x))
    _train_step(model, lambda: model(distribute_tensor(x, mesh, [Shard(2)])))
    for (path, p), q in zip(model.named_parameters(), plain.parameters()):
        assert _on_device(p.grad), path
        torch.testing.assert_close(p.grad, q.grad, msg=path)
        torch.testing.assert_close(p, q, msg=path)


def _train_step(model: nn.Module, forward) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = forward()
    loss = out.square().mean()
    if isinstance(loss, ShardTensor):
        loss = loss.full_tensor()
    loss.backward()
    optimizer.step()


def test_a_meshgraphnet_step_on_a_partitioned_graph(mesh: DeviceMesh) -> None:
    """A graph of one part (its halo plans still derived and uploaded), node and edge features
    on the device, against the model on the whole graph."""
    generator = torch.Generator().manual_seed(0)
    positions = torch.rand(30, 2, generator=generator, dtype=torch.float64)
    triangles = torch.as_tensor(Delaunay(positions.numpy()).simplices)
    pairs = torch.cat([triangles[:, [0, 1]], triangles[:, [1, 2]], triangles[:, [2, 0]]])
    edge_index = torch.unique(torch.cat([pairs, pairs.flip(1)]), dim=0).t().contiguous()
    parts = partition_nodes(edge_index, 30, 1, method="rcb", coordinates=positions)
    graph = PartitionedGraph(GraphPartition.build(edge_index, parts, 1), mesh)
    nodes = _field(30, 3)
    edges = _field(edge_index.shape[1], 3)
    torch.manual_seed(0)
    plain = MeshGraphNet(node_in=3, edge_in=3, node_out=2, hidden=8).double().to(DEVICE)
    model = domain_parallel(copy.deepcopy(plain), mesh, domain_axes=["domain"])
    out = model(graph.nodes(nodes), graph.edges(edges), graph.edge_index)
    assert _on_device(out)
    out.square().mean().full_tensor().backward()
    plain(nodes, edges, edge_index.to(DEVICE)).square().mean().backward()
    for (path, p), q in zip(model.named_parameters(), plain.parameters()):
        assert _on_device(p.grad), path
        torch.testing.assert_close(p.grad, q.grad, msg=path)
