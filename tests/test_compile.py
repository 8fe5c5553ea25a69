"""torch.compile on ShardTensor models: compiled local regions and plain ``torch.compile``.

Every layout is checked twice. ``check_against_reference`` runs the model under its traffic
count, a TorchDispatchMode, so regions run eagerly there (NOTE [Compiled local regions]): it
checks layouts, traffic and values of the sharded model. ``_compiled_equals_eager`` then runs
it outside any mode, compiled, and compares outputs and every gradient with the single-device
eager model on the same global data, float64 to 1e-10. The rest of the zoo (FNO 2-D, padded
and 3-D, ViT, Transolver 2-D and 3-D; ``tests/zoo.py``) is checked the second way only, its
sharded eager runs being ``tests/test_zoo_sharded.py``'s, on 2 ranks uneven and a 2x2 mesh
(the 3-D variants on 2 ranks), with the modules that run eagerly named and no recompilation
allowed for new shard sizes. Fast checks compile with the ``aot_eager`` backend (AOTAutograd forward and backward graphs
without code generation); ``-m slow`` runs the same bodies with inductor's generated kernels.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
import torch._dynamo.testing
from scipy.spatial import Delaunay
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from shardsci import attention_exchange
from shardsci.compiling import compile_regions, region_summary
from shardsci.graph import GraphPartition, partition_nodes
from shardsci.models import MeshGraphNet, UNet
from shardsci.tensor import ShardTensor
from shardsci.tensor._api import from_local_spec
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    assert_close_all_ranks,
    check_against_reference,
    get_mesh,
    run_on_ranks,
)
from tests.zoo import ATTENTION_EXCHANGES, MODELS

FAST = "aot_eager"


def _unet(coordinates: str = "none") -> UNet:
    torch.manual_seed(0)
    return UNet(
        width=8, depth=2, norm_groups=4, padding_mode="circular", coordinates=coordinates
    ).double()


def _probe_call(model: torch.nn.Module, whole: torch.Tensor, layout: Layout, mesh) -> None:
    """A first call on a layout decides which modules are local (eagerly)."""
    spec = layout.spec(mesh, whole)
    model(from_local_spec(spec.narrow(whole).contiguous(), spec))


def _compiled_equals_eager(
    model: torch.nn.Module,
    inputs: list[torch.Tensor],
    layouts: list[Layout],
    mesh: DeviceMesh,
    what: str,
    out_layout: Layout | None = None,
    reference: torch.nn.Module | None = None,
) -> None:
    """The model of ``compile_regions`` on ShardTensors, outside any dispatch mode (so its
    regions run compiled), against the same model on the whole inputs (where every module
    runs its eager forward; or ``reference``, the model sharing its parameters): output, its
    layout (``out_layout``, by default the first input's), and the gradients of a random
    projection of it for every floating input and every parameter."""
    wholes = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    model.zero_grad(set_to_none=True)
    expected = (reference or model)(*wholes)
    projection = torch.randn(expected.shape, dtype=expected.dtype)
    (expected * projection).sum().backward()
    expected_grads = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    specs = [layout.spec(mesh, x) for x, layout in zip(inputs, layouts)]
    leaves = [
        s.narrow(x).clone().requires_grad_(x.is_floating_point()) for x, s in zip(inputs, specs)
    ]
    out = model(*(from_local_spec(leaf, s) for leaf, s in zip(leaves, specs)))
    out_spec = (out_layout or layouts[0]).spec(mesh, expected)
    assert_all_ranks(
        out._spec.placements == out_spec.placements and out._spec.shardings == out_spec.shardings,
        f"{what}: output layout {out._spec} (expected {out_spec})",
    )
    assert_close_all_ranks(out.full_tensor(), expected, atol=1e-10, rtol=1e-10, what=what)
    (out.full_tensor() * projection).sum().backward()
    for leaf, spec, whole in zip(leaves, specs, wholes):
        if whole.grad is not None:
            assert_close_all_ranks(
                leaf.grad, spec.narrow(whole.grad), atol=1e-10, rtol=1e-10, what=f"{what} input"
            )
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, ShardTensor) else p.grad
        assert_close_all_ranks(
            grad, expected_grads[name], atol=1e-10, rtol=1e-10, what=f"{what} grad of {name}"
        )


def _unet_regions_body(
    backend: str, mesh_shape: tuple[int, ...], coordinates: str = "none"
) -> None:
    mesh = get_mesh(mesh_shape)
    model = _unet(coordinates)
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compile_regions(model, backend=counter)
    whole = torch.randn(2, 1, 64, 48, dtype=torch.float64)
    if len(mesh_shape) == 1:
        layouts = [Layout((Shard(2),), {2: [37, 27]}), Layout((Shard(2),), {2: [32, 32]})]
    else:
        layouts = [
            Layout((Shard(2), Shard(3)), {2: [37, 27], 3: [20, 28]}),
            Layout((Shard(2), Shard(3)), {2: [32, 32], 3: [24, 24]}),
        ]
    _probe_call(model, whole, layouts[0], mesh)
    frames = []
    for layout in layouts:
        model.zero_grad(set_to_none=True)
        before = counter.frame_count
        check_against_reference(
            lambda m, x: m(x),
            [whole],
            [layout],
            mesh,
            module=model,
            not_a_gather="the halos of 8-channel features outweigh the 1-channel input",
            what=str(layout.sizes),
        )
        assert_all_ranks(counter.frame_count == before, "regions compiled under a dispatch mode")
        _compiled_equals_eager(model, [whole], [layout], mesh, str(layout.sizes))
        frames.append(counter.frame_count)
    regions = [name for name, status in region_summary(model).items() if status == "region"]
    assert_all_ranks(
        frames[0] > 0 and frames[1] == frames[0],
        f"compiled frames after each layout: {frames} (expected no recompilation)",
    )
    # Position features read the global shape and add a term sliced to each shard: not local.
    # Without them (coordinates="none") the embedding is the identity, a local region.
    local = [n for n, m in model.named_modules() if _is_act(m)] + ["head"]
    local += ["coordinates"] if coordinates == "none" else []
    assert_all_ranks(sorted(regions) == sorted(local), f"UNet regions: {regions}")


def _is_act(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.SiLU)


def test_unet_regions_equal_eager_without_recompiling_for_new_shard_sizes() -> None:
    run_on_ranks(2, _unet_regions_body, FAST, (2,), timeout_s=600)


def test_unet_regions_on_a_2x2_mesh() -> None:
    run_on_ranks(4, _unet_regions_body, FAST, (2, 2), timeout_s=600)


def test_position_features_are_not_a_local_region() -> None:
    run_on_ranks(2, _unet_regions_body, FAST, (2,), "periodic", timeout_s=600)


# Per mesh, a first layout and the same placements with other shard sizes, all at patch
# boundaries of the ViT (2 cells) and no shard under 2 cells (NOTE [Compiled local regions]).
# On the 2x2 block the ViT's H shards hold an even number of patch rows, halved over the W
# axis (NOTE [Tokens of a block decomposition]).
FIELD_LAYOUTS = {
    (2,): [Layout((Shard(2),), {2: (10, 6)}), Layout((Shard(2),), {2: (8, 8)})],
    (2, 2): [
        Layout((Shard(2), Shard(3)), {2: (12, 4), 3: (4, 8)}),
        Layout((Shard(2), Shard(3)), {2: (8, 8), 3: (6, 6)}),
    ],
}
VOLUME_LAYOUTS = {(2,): [Layout((Shard(2),), {2: (5, 3)}), Layout((Shard(2),), {2: (4, 4)})]}


def _blocks_and_attention(blocks: int) -> list[str]:
    return [f"blocks.{i}{part}" for i in range(blocks) for part in ("", ".attention")]


# The modules that communicate (or change the shard extents, as the ViT's patch embedding
# does), so run eagerly: every other module met runs compiled or inside a compiled region.
ZOO_EAGER = {
    "fno": ["", "coordinates", "spectral.0", "spectral.1"],
    "fno-padded": ["", "spectral.0", "spectral.1"],
    "fno-3d": ["", "coordinates", "spectral.0", "spectral.1"],
    "vit": ["", "coordinates", "embed", *_blocks_and_attention(2)],
    "transolver": ["", "coordinates", *_blocks_and_attention(2)],
    "transolver-3d": ["", "coordinates", *_blocks_and_attention(1)],
}


def _zoo_regions_body(backend: str, name: str, mesh_shape: tuple[int, ...]) -> None:
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    model = MODELS[name]().double()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compile_regions(model, backend=counter)
    volume = name.endswith("3d")
    whole = torch.randn((1, 2, 8, 6, 6) if volume else (2, 2, 16, 12), dtype=torch.float64)
    layouts = (VOLUME_LAYOUTS if volume else FIELD_LAYOUTS)[mesh_shape]
    frames = []
    # The ViT's attention asks for its exchange by name, as in test_zoo_sharded: "auto" would
    # gather its tiny keys and values unasked (NOTE [Ring or all-gather]).
    with attention_exchange(ATTENTION_EXCHANGES.get(name, "auto")):
        _probe_call(model, whole, layouts[0], mesh)
        for first, layout in zip((True, False), layouts):
            what = f"{name} {dict(layout.sizes)}"
            # New shard sizes must reuse the compiled code: a guard failing raises, with its
            # reason.
            with torch._dynamo.config.patch(error_on_recompile=not first):
                _compiled_equals_eager(model, [whole], [layout], mesh, what)
            frames.append(counter.frame_count)
    assert_all_ranks(
        frames[0] > 0 and frames[1] == frames[0],
        f"{name}: compiled frames after each layout: {frames} (expected no recompilation)",
    )
    eager = [n for n, status in region_summary(model).items() if status == "eager"]
    assert_all_ranks(sorted(eager) == sorted(ZOO_EAGER[name]), f"{name}: eager modules {eager}")


# The 3-D variants on 2 ranks only: Conv3d regions meet a sharded dim on the slabs, two
# sharded dims are met on the 2-D blocks, and 2x2 pencils would add 23 s to the suite. On
# 2x2 only the UNet runs by default (test_unet_regions_on_a_2x2_mesh); the other models' 2x2
# cases (about 100 s) are slow, and so are the 3-D and padded variants on 2 ranks (about
# 20 s; their 2-D counterparts run the same region rules by default).
ZOO_CASES = [
    pytest.param(
        name,
        mesh,
        marks=[pytest.mark.slow] if mesh == (2, 2) or "3d" in name or "padded" in name else [],
        id=f"{name}-{'x'.join(map(str, mesh))}",
    )
    for name in ZOO_EAGER
    for mesh in ((2,), (2, 2))
    if mesh == (2,) or "3d" not in name
]


@pytest.mark.parametrize(("name", "mesh_shape"), ZOO_CASES)
def test_zoo_regions_equal_eager_without_recompiling(name: str, mesh_shape: tuple) -> None:
    run_on_ranks(math.prod(mesh_shape), _zoo_regions_body, FAST, name, mesh_shape, timeout_s=600)


def _mesh_graph(points: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    positions = torch.rand(points, 2, generator=generator, dtype=torch.float64)
    triangles = torch.as_tensor(Delaunay(positions.numpy()).simplices)
    pairs = torch.cat([triangles[:, [0, 1]], triangles[:, [1, 2]], triangles[:, [2, 0]]])
    pairs = torch.unique(torch.cat([pairs, pairs.flip(1)]), dim=0)
    return positions, pairs.t().contiguous()


def meshgraphnet() -> MeshGraphNet:
    """The compile tests' MeshGraphNet, float64, with seed 0's parameters."""
    torch.manual_seed(0)
    return MeshGraphNet(node_in=3, edge_in=3, node_out=2, hidden=8, processor_blocks=2).double()


def graph_partitions(
    methods: tuple[str, ...],
) -> Iterator[tuple[str, list[torch.Tensor], list[Layout]]]:
    """Per method, 2-part partitions of one 40-node mesh graph (``partition_nodes``):
    ``(method, [nodes (N, 3), edges (E, 3), edge index (2, E)] in the partition's order, their
    layouts)``: node and edge features float64 and split along dim 0, the index along dim 1.
    Each method gives new node and edge shard sizes."""
    positions, edge_index = _mesh_graph()
    generator = torch.Generator().manual_seed(1)
    nodes = torch.randn(positions.shape[0], 3, generator=generator, dtype=torch.float64)
    edges = torch.randn(edge_index.shape[1], 3, generator=generator, dtype=torch.float64)
    for method in methods:
        parts = partition_nodes(
            edge_index, positions.shape[0], 2, method=method, coordinates=positions
        )
        partition = GraphPartition.build(edge_index, parts, 2)
        inputs = [nodes[partition.node_order], edges[partition.edge_order], partition.edge_index]
        layouts = [
            Layout((Shard(0),), {0: partition.node_sizes}),
            Layout((Shard(0),), {0: partition.edge_sizes}),
            Layout((Shard(1),), {1: partition.edge_sizes}),
        ]
        yield method, inputs, layouts


def _meshgraphnet_regions_body(backend: str) -> None:
    mesh = get_mesh((2,))
    model = meshgraphnet()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compile_regions(model, backend=counter)
    frames = []
    for method, inputs, layouts in graph_partitions(("metis", "rcb")):
        model.zero_grad(set_to_none=True)
        if not frames:
            model(
                *(
                    from_local_spec(lay.spec(mesh, t).narrow(t).contiguous(), lay.spec(mesh, t))
                    for t, lay in zip(inputs, layouts)
                )
            )
        check_against_reference(
            lambda m, x, e, i: m(x, e, i),
            inputs,
            layouts,
            mesh,
            module=model,
            out_layouts=[layouts[0]],
            what=method,
        )
        _compiled_equals_eager(model, inputs, layouts, mesh, method)
        frames.append(counter.frame_count)
    assert_all_ranks(frames[0] > 0 and frames[1] == frames[0], f"compiled frames: {frames}")


def test_meshgraphnet_regions_equal_eager_on_two_partitions() -> None:
    run_on_ranks(2, _meshgraphnet_regions_body, FAST, timeout_s=600)


@pytest.mark.slow
def test_regions_with_inductor_kernels() -> None:
    run_on_ranks(2, _unet_regions_body, "inductor", (2,), timeout_s=900)
    run_on_ranks(2, _meshgraphnet_regions_body, "inductor", timeout_s=900)
    for name in ZOO_EAGER:
        run_on_ranks(2, _zoo_regions_body, "inductor", name, (2,), timeout_s=900)
