"""GPU-ready by construction, checked without a GPU: a training step of every zoo model creates
its tensors on the device its inputs and its mesh are on.

# NOTE [A step creates its tensors on the mesh's device]
On a GPU every buffer shardsci makes (a collective's send and receive buffers, a statistics
gather, a halo, a gradient bucket) must be on the GPU: NCCL refuses host tensors, and a host
tensor mixed into device code is an error or a silent copy and synchronisation every step.
This machine has no GPU, and fake CUDA tensors abort on the CPU wheel, so the test runs the
step where nothing has a place by accident: the model, its optimiser state, the inputs and the
DeviceMesh are on the ``meta`` device, the world is the dry run's fake process group
(``shardsci.planning`` NOTE [A dry run executes the library on one simulated rank at a time]),
and a ``TorchDispatchMode`` below ShardTensor's dispatch watches every aten op the step runs:
an op that makes a tensor on another device from no tensor there (a factory function, a
``torch.tensor`` of Python data, a copy onto the step's device from elsewhere) is a creation
on the wrong device. Tensors computed from such a tensor are not counted again; shape probes
under a fake mode allocate nothing and are not counted. The only creations allowed are host
scalars torch itself keeps on the host on every device, each listed in ``HOST_SCALARS`` with
why.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Shard

import shardsci.train  # noqa: F401  registers the config schemas and the recipes
from shardsci import ShardTensor, attention_exchange
from shardsci.distributed import LaunchEnv
from shardsci.graph import GraphPartition, PartitionedGraph, partition_nodes
from shardsci.models import MeshGraphNet
from shardsci.parallel import domain_parallel
from shardsci.planning._dry_run import planned_step
from shardsci.planning._world import simulated_rank
from shardsci.tensor._torch_compat import (
    TorchDispatchMode,
    active_fake_mode,
    is_traceable_wrapper_subclass_type,
    tree_leaves,
)
from shardsci.testing import count_traffic
from shardsci.training import (
    ParallelConfig,
    Parallelism,
    ParallelPlan,
    RunContext,
    TrainConfig,
    config_from,
    get_recipe,
    instantiate,
    parallelize,
)
from tests.zoo import ATTENTION_EXCHANGES, MODELS

META = torch.device("meta")
ROOT = Path(__file__).resolve().parents[1]

# (file, function) of a creation torch makes on the host whatever the device -> why it may.
HOST_SCALARS: dict[tuple[str, str], str] = {
    ("torch/optim/adamw.py", "_init_group"): (
        "AdamW's step count: a 0-d host tensor unless capturable or fused, on every device "
        "(read with .item() for the bias correction, so a host value costs no synchronisation)"
    ),
    ("torch/optim/adam.py", "_init_group"): "the same, where AdamW's state is made by Adam's",
}
# Frames that only relay a call: the creation is blamed on the first frame outside them.
_RELAYS = (
    "torch/_ops.py",
    "torch/utils/_python_dispatch.py",
    "torch/_tensor.py",
    "torch/_dynamo/eval_frame.py",
    "torch/_compile.py",
)
_OURS = [ROOT / "shardsci", ROOT / "models", ROOT / "recipes"]
_CREATIONS_FROM_DATA = {"aten::lift_fresh", "aten::lift_fresh_copy"}


@dataclass(frozen=True)
class Creation:
    """A tensor made on the wrong device.

    Attributes
    ----------
    op : str
        The aten op that made it.
    device : str
    shape : tuple of int
    copied : bool
        Made elsewhere and copied onto the step's device here (a host-to-device copy on a
        GPU), rather than made here on another device.
    site : str
        ``file:line (function)`` of the code that asked for it.
    caller : str
        The innermost shardsci or zoo frame on the way there (where a fix would go).
    files : frozenset of str
        Every shardsci or zoo file on the way there.
    """

    op: str
    device: str
    shape: tuple[int, ...]
    copied: bool
    site: str
    caller: str
    files: frozenset[str]

    def __str__(self) -> str:
        where = self.site if self.site == self.caller else f"{self.site}, from {self.caller}"
        what = "copied a" if self.copied else "made a"
        return f"{where}: {self.op} {what} {self.device} tensor of shape {self.shape}"


class DeviceWatch(TorchDispatchMode):
    """Record every tensor created on a device other than ``device`` (NOTE [A step creates
    its tensors on the mesh's device]).

    Attributes
    ----------
    creations : list of Creation
        In order, host scalars in ``HOST_SCALARS`` left out.
    allowed : set of str
        The ``HOST_SCALARS`` entries that were used.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.creations: list[Creation] = []
        self.allowed: set[tuple[str, str]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        # ShardTensor's dispatch runs first; the ops it runs on its shards then come here.
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented
        out = func(*args, **kwargs)
        if active_fake_mode() is not None:
            return out
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        from_elsewhere = any(t.device != self.device for t in inputs)
        if from_elsewhere and func._schema.name not in _CREATIONS_FROM_DATA:
            copied = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            if func._schema.name in ("aten::_to_copy", "aten::copy_") and any(
                t.device == self.device for t in copied
            ):
                self._record(func, next(t for t in inputs if t.device != self.device), True)
            return out
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device != self.device:
                self._record(func, tensor, False)
        return out

    def _record(self, func, tensor: torch.Tensor, copied: bool) -> None:
        frames = [
            (Path(f.filename).resolve(), f.lineno, f.name)
            for f in traceback.extract_stack()[::-1]
            if not f.filename.endswith(_RELAYS)
            and not (f.filename == __file__ and f.name in ("__torch_dispatch__", "_record"))
        ]
        path, line, name = frames[0]
        key = (_short(path), name)
        if key in HOST_SCALARS and tensor.dim() == 0:
            self.allowed.add(key)
            return
        ours = next((f for f in frames if _is_ours(f[0])), frames[0])
        self.creations.append(
            Creation(
                op=func._schema.name,
                device=str(tensor.device),
                shape=tuple(tensor.shape),
                copied=copied,
                site=_where(path, line, name),
                caller=_where(*ours),
                files=frozenset(_short(f[0]) for f in frames if _is_ours(f[0])),
            )
        )


def _is_ours(path: Path) -> bool:
    return any(path.is_relative_to(d) for d in _OURS)


def _short(path: Path) -> str:
    """``torch/optim/adamw.py`` for an installed package's files, the repository path for
    ours."""
    parts = path.parts
    if "site-packages" in parts:
        return "/".join(parts[parts.index("site-packages") + 1 :])
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _where(path: Path, line: int, name: str) -> str:
    return f"{_short(path)}:{line} ({name})"


@contextmanager
def watching(device: torch.device = META) -> Iterator[DeviceWatch]:
    """Watch the block; if it fails after a creation off ``device`` (a host buffer mixed with
    meta tensors fails at its first use), say where that tensor was made."""
    with DeviceWatch(device) as watch:
        try:
            yield watch
        except Exception as error:
            if not watch.creations:
                raise
            sites = "\n".join(sorted({str(c) for c in watch.creations}))
            raise AssertionError(
                f"failed ({type(error).__name__}: {error}) after creating tensors off the "
                f"{device} device, the likely cause:\n{sites}"
            ) from error


# A library file known to create tensors off the step's device -> why, and who fixes it. A
# watched step may still create tensors there (and nowhere else); once it creates none,
# ``test_the_known_site_still_creates_off_the_device`` fails: delete the entry and that test.
KNOWN_SITES: dict[str, str] = {
    "shardsci/tensor/_ops/_interpolate_ops.py": (
        "F.interpolate's taps (index and weight tables) are built on the host on the first "
        "call and copied to the input's device on every call (Resample.apply's .to(device)): a "
        "host-to-device copy each step on a GPU; build and cache them on the input's device "
        "(owned by the ops engineers; found by this test, issue 21)"
    ),
}


def assert_created_on(watch: DeviceWatch, what: str) -> None:
    sites = sorted({str(c) for c in watch.creations if not c.files & KNOWN_SITES.keys()})
    assert not sites, f"{what} created tensors off the meta device:\n" + "\n".join(sites)


# ---------------------------------------------------------------------------- the zoo on fields
@dataclass(frozen=True)
class FieldCase:
    """A global field ``(B, C, *spatial)`` split over a mesh, and the rank simulated."""

    name: str
    mesh: tuple[int, ...]
    shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    sizes: dict[int, tuple[int, ...]]
    """Mesh axis -> shard sizes along it."""
    rank: int


FIELDS = [
    FieldCase("2r-H-7/5", (2,), (2, 2, 12, 8), (Shard(2),), {0: (7, 5)}, rank=1),
    FieldCase("2x2-block", (2, 2), (1, 2, 12, 8), (Shard(2), Shard(3)), {0: (8, 4), 1: (2, 6)}, 3),
]
VOLUMES = [
    FieldCase("2r-D-5/3", (2,), (1, 2, 8, 6, 6), (Shard(2),), {0: (5, 3)}, rank=0),
    FieldCase(
        "2x2-pencil", (2, 2), (1, 2, 8, 6, 6), (Shard(2), Shard(3)), {0: (6, 2), 1: (1, 5)}, 2
    ),
]
COMBINATIONS = [(m, c) for m in MODELS if not m.endswith("3d") for c in FIELDS] + [
    (m, c) for m in MODELS if m.endswith("3d") for c in VOLUMES
]
# Run by default (each a few seconds on an idle machine); the rest are ``slow``: 10 to 50 s each
# at a load average of 30 (the whole file: 580 s there), run with ``-m slow``.
QUICK = {("fno", "2r-H-7/5"), ("vit-ring", "2r-H-7/5"), ("fno-3d", "2r-D-5/3")}


class _MetaDeviceModule:
    """What DeviceMesh asks of ``torch.<device type>`` (as of ``torch.cuda``): whether the
    device is set up (it is: there is nothing to set) and, for the cost model of DTensor's
    sharding propagation, the devices per host."""

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1


@pytest.fixture(autouse=True)
def meta_device_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """A DeviceMesh on ``meta`` needs a device module, as ``cuda`` has ``torch.cuda``."""
    monkeypatch.setattr(torch, META.type, _MetaDeviceModule, raising=False)


def _mesh(shape: tuple[int, ...]) -> tuple[DeviceMesh, list[str]]:
    names = [f"domain{axis}" for axis in range(len(shape))]
    return init_device_mesh(META.type, shape, mesh_dim_names=tuple(names)), names


def _field(case: FieldCase, mesh: DeviceMesh) -> ShardTensor:
    local_shape = list(case.shape)
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    for axis, placement in enumerate(case.placements):
        assert isinstance(placement, Shard)
        local_shape[placement.dim] = case.sizes[axis][coordinate[axis]]
    local = torch.randn(local_shape, device=META)
    return ShardTensor.from_local(local, mesh, case.placements, dict(case.sizes), shape=case.shape)


def _steps(model: nn.Module, loss: Callable[[], torch.Tensor], steps: int = 2) -> None:
    """``steps`` training steps: the first creates the optimiser state, the next is steady."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        value = loss()
        if isinstance(value, ShardTensor):
            value = value.full_tensor()
        value.backward()
        optimizer.step()


@pytest.mark.parametrize(
    ("model", "case"),
    [
        pytest.param(m, c, marks=() if (m, c.name) in QUICK else pytest.mark.slow)
        for m, c in COMBINATIONS
    ],
    ids=[f"{m}-{c.name}" for m, c in COMBINATIONS],
)
def test_a_zoo_step_creates_every_tensor_on_the_mesh_device(model: str, case: FieldCase) -> None:
    with simulated_rank(case.rank, math.prod(case.mesh)):
        mesh, names = _mesh(case.mesh)
        module = domain_parallel(MODELS[model]().to(META), mesh, domain_axes=names)
        x = _field(case, mesh)
        with watching() as watch, attention_exchange(ATTENTION_EXCHANGES.get(model, "auto")):
            _steps(module, lambda: module(x).square().mean())
    assert_created_on(watch, f"{model} on {case.name}, rank {case.rank}")


# ---------------------------------------------------------------------------- MeshGraphNet
def _grid_graph(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Node positions ``(n², 2)`` of an n x n grid and its 4-neighbour edges ``(2, E)``,
    both directions: host data, as a mesh file gives it."""
    ij = torch.cartesian_prod(torch.arange(n), torch.arange(n))
    index = torch.arange(n * n).reshape(n, n)
    right = torch.stack([index[:, :-1].reshape(-1), index[:, 1:].reshape(-1)])
    down = torch.stack([index[:-1].reshape(-1), index[1:].reshape(-1)])
    edges = torch.cat([right, down], 1)
    return ij.double(), torch.cat([edges, edges.flip(0)], 1)


@pytest.mark.parametrize("rank", [0, 2])
def test_a_meshgraphnet_step_creates_every_tensor_on_the_mesh_device(rank: int) -> None:
    """4 parts by coordinate bisection of a 6 x 6 grid, partitioned on the host (as
    ``recipes/mesh_cfd`` does). The partitioned graph's construction makes no collective (its
    halo plans come from the partition, NOTE [A partitioned graph's halo plan comes from its
    partition]) and only uploads the partition's host tables to the mesh's device; the step
    creates nothing off the device."""
    positions, edge_index = _grid_graph(6)
    parts = partition_nodes(edge_index, positions.shape[0], 4, method="rcb", coordinates=positions)
    partition = GraphPartition.build(edge_index, parts, 4)
    assert any(partition.halo_sizes()), "the parts must exchange halos for the test to mean much"
    with simulated_rank(rank, 4):
        mesh, names = _mesh((4,))
        model = MeshGraphNet(node_in=3, edge_in=3, node_out=2, hidden=8, processor_blocks=2)
        model = domain_parallel(model.to(META), mesh, domain_axes=names)
        with count_traffic() as traffic, watching() as built:
            graph = PartitionedGraph(partition, mesh)
            nodes = graph.nodes(torch.randn(positions.shape[0], 3, device=META))
            edges = graph.edges(torch.randn(edge_index.shape[1], 3, device=META))
        assert traffic.collective_calls == 0 and traffic.messages == 0, traffic
        assert_only_uploads(built, "shardsci/graph/_graph.py", "PartitionedGraph on 4 parts")
        assert graph.edge_index.to_local().device == META
        with watching() as watch:
            _steps(model, lambda: model(nodes, edges, graph.edge_index).square().mean())
    assert_created_on(watch, f"MeshGraphNet on 4 parts, rank {rank}")


def assert_only_uploads(watch: DeviceWatch, uploader: str, what: str) -> None:
    """Every creation off the device is a copy of host data onto it made in ``uploader``:
    data that lives on the host (a partition) handed to the device once, when it is set up."""
    others = sorted({str(c) for c in watch.creations if not c.copied or uploader not in c.site})
    assert not others, f"{what} created tensors off the meta device:\n" + "\n".join(others)


# ---------------------------------------------------------------------------- the recipes
CONFIGS = ROOT / "configs"
# The cfd recipe's data-free task (its dry run's), each model it configures, on a 2x2 mesh;
# mesh_cfd registers no dry_run_task (its batches come from a prepared mesh file): its model
# and its partitioned graph are the MeshGraphNet test above.
RECIPE_STEPS = [
    pytest.param("cfd", "unet", "2x2", 3, marks=pytest.mark.slow),
    ("cfd", "fno", "2x2", 3),
    pytest.param("cfd", "vit", "2x2", 0, marks=pytest.mark.slow),
    pytest.param("cfd", "transolver", "2x2", 0, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(
    ("recipe", "model", "mesh", "rank"),
    RECIPE_STEPS,
    ids=[
        "cfd-unet-2x2-rank3",
        "cfd-fno-2x2-rank3",
        "cfd-vit-2x2-rank0",
        "cfd-transolver-2x2-rank0",
    ],
)
def test_a_recipe_step_creates_every_tensor_on_the_mesh_device(
    recipe: str, model: str, mesh: str, rank: int, tmp_path: Path
) -> None:
    """The trainer's ``training_step`` (NOTE [One training step]) as the dry run builds it
    (``shardsci.planning._dry_run._simulate``), but on a DeviceMesh on ``meta``: the run's
    plan, its model parallelised as the trainer does it, its optimiser, two steps watched."""
    overrides = [
        f"+recipe={recipe}",
        f"model={model}",
        f"mesh={mesh}",
        "logger=none",
        "train.global_batch=2",
        "data.dataset.solver.resolution=32",
        f"run_dir={tmp_path}",
    ]
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    chosen = get_recipe(cfg.recipe)
    assert chosen.dry_run_task is not None
    plan = ParallelPlan.of(
        str(cfg.mesh), config_from(ParallelConfig, cfg.parallel), chosen.spatial_dims
    )
    train: TrainConfig = OmegaConf.to_object(cfg.train)
    with simulated_rank(rank, plan.world_size):
        parallelism = Parallelism.build(plan, device_type=META.type)
        assert parallelism.device == META
        env = LaunchEnv(rank, plan.world_size, rank, plan.world_size, "dry-run", 0, "single")
        context = RunContext(env, parallelism, tmp_path, META)
        with torch.device(META):
            module = instantiate(cfg.model)
            task = chosen.load_dry_run_task()(cfg, context)
        module = parallelize(module, parallelism, train.dp_mode)
        optimizer = instantiate(cfg.optim)(module.parameters())
        step = planned_step(module, optimizer, task, train, parallelism.device)
        with watching() as watch:
            step()
            step()
    assert_created_on(watch, f"recipe {recipe} with {model} on {mesh}, rank {rank}")


# ---------------------------------------------------------------------------- the watch itself
def test_the_watch_finds_a_host_tensor_and_where_it_was_made() -> None:
    x = torch.randn(3, device=META)
    with watching() as watch:
        y = x + 1
        torch.zeros(2)  # line A
        torch.tensor([1.0, 2.0])
        y * torch.ones(3).to(META)
        torch.zeros(2, device=META)
    ops = [c.op for c in watch.creations]
    assert ops == ["aten::zeros", "aten::lift_fresh", "aten::ones", "aten::_to_copy"]
    assert [c.copied for c in watch.creations] == [False, False, False, True]
    here = Path(__file__).name
    assert all(here in c.site for c in watch.creations), watch.creations


def test_the_watch_lets_torchs_host_scalars_through_and_names_them() -> None:
    p = nn.Parameter(torch.randn(3, device=META))
    with watching() as watch:
        _steps_on(p)
    assert not watch.creations
    # AdamW's state is made by Adam's _init_group since torch 2.12.
    assert len(watch.allowed) == 1 and watch.allowed <= set(HOST_SCALARS), watch.allowed


def _steps_on(p: nn.Parameter) -> None:
    optimizer = torch.optim.AdamW([p])
    p.grad = torch.ones_like(p)
    optimizer.step()


def test_the_known_sites_still_create_off_the_device() -> None:
    """``KNOWN_SITES`` holds only files that still do: an upsampling of a ShardTensor."""
    assert set(KNOWN_SITES) == {"shardsci/tensor/_ops/_interpolate_ops.py"}
    with simulated_rank(0, 2):
        mesh, _ = _mesh((2,))
        x = _field(FIELDS[0], mesh)
        with watching() as upsampling:
            nn.functional.interpolate(x, scale_factor=2, mode="nearest")
    assert {f for c in upsampling.creations for f in c.files} >= set(KNOWN_SITES)
