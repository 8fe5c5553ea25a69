"""What the axes of a run's DeviceMesh do, decided once: data parallelism on at most one axis,
the domain decomposition on the others.

NOTE [A run is planned once]
The ``mesh`` value (``"4x2"``, the shape of the run's DeviceMesh) and the ``parallel`` group
(``ParallelConfig``: what each axis does) become one ``ParallelPlan`` once per launch, in the
process that checks the config (``check_run``), before any rank starts: the shape is parsed and
the axis roles resolved and checked there, and nowhere else. The plan is plain data (no process
group, no device), so ``run_local_ranks`` hands it to the ranks it forks as it is; under
torchrun or srun every rank is such a checking process and builds it once from its config. In a
rank, ``start_run(cfg, plan)`` turns it into the run's one ``DeviceMesh``, held by the one
``Parallelism`` that the data (which part of the batch, which slab of a field), the gradient
reducer (``parallelize``) and the training step use; its sub-meshes are made once and shared.
``tests/test_planned_once.py`` counts constructions, parses and meshes per process through the
real command with forked ranks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

from shardsci.distributed import (
    MeshSpec,
    build_mesh,
    mesh_axis_sizes,
    parse_mesh_shape,
    resolve_axis_names,
)
from shardsci.tensor import ShardTensor, ShardTensorSpec
from shardsci.tensor._api import from_local_spec

__all__ = ["ParallelConfig", "ParallelPlan", "Parallelism", "mesh_world_size"]


@dataclass
class ParallelConfig:
    """What the mesh axes do (the ``parallel`` config group), as the user wrote it.

    Attributes
    ----------
    axis_names : list of str or None
        One name per mesh axis; None: ``dp`` for the data-parallel axis, ``domain`` for a single
        domain axis, ``domain_d``, ``domain_h``, ``domain_w`` (after the dim each splits) for
        several.
    data_parallel : str or None
        The name of the data-parallel axis (the first axis when ``axis_names`` is None), or None
        for no data parallelism.
    domain : dict
        Mesh axis name -> the spatial dim of the fields it splits (e.g. ``"H"``); empty: the
        other axes split the fields' spatial dims in order, outermost first (H, then W of a 2-D
        field; D, H, W of a 3-D one).
    choose : bool
        Choose the decomposition of a one-number mesh (``mesh=N``, or torchrun's or srun's
        world with ``mesh=-1``) by planning every candidate (``shardsci.planning``, NOTE
        [How parallel=auto chooses]); a mesh of several axes keeps the roles above.
        ``parallel=auto`` sets it.
    memory_gib : float or None
        The memory budget of one device when choosing; None: ``device_memory_gib`` if set,
        else the machine's (an H100's 80 GiB on a GPU; on a CPU this host's memory over the
        ranks it runs).
    machine : str or None
        What the candidates' step times are projected on: ``"h100"`` (a cluster of H100
        nodes), ``"cpu"`` (ranks sharing this host's cores, gloo); None: ``"h100"`` where CUDA
        is available, else ``"cpu"``.
    machine_overrides : list of str
        ``name=value`` settings of the machine's parameters (``Machine``), e.g.
        ``'parallel.machine_overrides=["ib_bytes_per_s=25e9","gpus_per_node=4"]'`` on the
        command line for another cluster.
    """

    axis_names: list[str] | None = None
    data_parallel: str | None = "dp"
    domain: dict[str, str] = field(default_factory=dict)
    choose: bool = False
    memory_gib: float | None = None
    machine: str | None = None
    machine_overrides: list[str] = field(default_factory=list)


def mesh_world_size(shape: MeshSpec) -> int | None:
    """Ranks of a mesh shape such as ``"4x2"``; None when an axis is ``-1`` (inferred)."""
    sizes = mesh_axis_sizes(shape)
    return None if -1 in sizes else math.prod(sizes)


@dataclass(frozen=True)
class ParallelPlan:
    """The shape of a run's DeviceMesh and the role of every axis, checked, before any process
    group exists (NOTE [A run is planned once]). Rank-independent plain data.

    Attributes
    ----------
    shape : tuple of int
        Ranks per mesh axis.
    axis_names : tuple of str
        One name per axis.
    dp_axis : str or None
        The data-parallel axis.
    domain : mapping
        Domain axis -> the spatial dim it splits, in mesh order.
    spatial_dims : tuple of str
        The fields' spatial dims, outermost first (``Recipe.spatial_dims``).
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    dp_axis: str | None
    domain: Mapping[str, str] = field(hash=False)
    spatial_dims: tuple[str, ...]

    @classmethod
    def of(
        cls,
        mesh_shape: MeshSpec,
        parallel: ParallelConfig,
        spatial_dims: Sequence[str],
        world_size: int | None = None,
    ) -> ParallelPlan:
        """The plan of the mesh shape ``mesh_shape`` (``cfg.mesh``: ``"4x2"``, ``"-1x2"``) with
        axis roles ``parallel``, for fields with ``spatial_dims``.

        Parameters
        ----------
        world_size : int or None
            The ranks the mesh must cover (torchrun's or srun's); None: the mesh's own size,
            every axis given.

        Raises
        ------
        ValueError
            If the shape does not cover ``world_size`` ranks, leaves a size to infer without
            one, or ``parallel`` does not fit it; the same error on every rank (it depends on
            the arguments only).
        """
        if world_size is None:
            shape = mesh_axis_sizes(mesh_shape)
            if -1 in shape:
                raise ValueError(
                    f"mesh={mesh_shape} infers an axis from the world size, which only torchrun "
                    f"or srun set; give every axis size (e.g. mesh=4x2)"
                )
        else:
            shape = parse_mesh_shape(mesh_shape, world_size)
        names, dp_axis, domain = _resolve_roles(parallel, len(shape), tuple(spatial_dims))
        return cls(shape, names, dp_axis, domain, tuple(spatial_dims))

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def size(self, axis: str) -> int:
        """Ranks along the mesh axis named ``axis``."""
        return self.shape[self.axis_names.index(axis)]

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: the size of the dp axis (1 without one)."""
        return self.size(self.dp_axis) if self.dp_axis else 1

    @property
    def domain_axes(self) -> tuple[str, ...]:
        """The axes that split spatial dims, in mesh order."""
        return tuple(self.domain)

    def ranks_along(self, dim: str) -> int:
        """Ranks that split the spatial dim ``dim`` (e.g. ``"H"``): 1 when none does."""
        return math.prod(self.size(axis) for axis, split in self.domain.items() if split == dim)

    def check_fits(self, sizes: Mapping[str, int], what: str) -> None:
        """Raise ``ValueError`` if the plan splits a spatial dim over more ranks than it has
        cells: ``sizes`` maps each spatial dim to its cells, ``what`` names the fields."""
        for dim, cells in sizes.items():
            ranks = self.ranks_along(dim)
            if ranks > cells:
                raise ValueError(
                    f"the mesh ({self.describe()}) splits {dim} over {ranks} ranks, but the "
                    f"fields have {cells} cells along {dim} ({what}); expected at most {cells} "
                    f"ranks along {dim}"
                )

    def describe(self) -> str:
        """``dp=4 (data parallel), domain=2 (splits H)``."""
        roles = []
        for name, size in zip(self.axis_names, self.shape):
            role = "data parallel" if name == self.dp_axis else f"splits {self.domain[name]}"
            roles.append(f"{name}={size} ({role})")
        return ", ".join(roles)


def _resolve_roles(
    parallel: ParallelConfig, ndim: int, spatial_dims: tuple[str, ...]
) -> tuple[tuple[str, ...], str | None, dict[str, str]]:
    """Axis names, the dp axis and the domain map of a mesh of ``ndim`` axes, checked."""
    dp = parallel.data_parallel
    if parallel.axis_names is None:
        splits = ndim - (dp is not None)
        if splits > len(spatial_dims):
            raise ValueError(
                f"the mesh has {splits} axes besides data parallelism but the fields have "
                f"{len(spatial_dims)} spatial dims {list(spatial_dims)}; use fewer axes"
            )
        names = [dp] if dp is not None else []
        names += (
            ["domain"] if splits == 1 else [f"domain_{d.lower()}" for d in spatial_dims[:splits]]
        )
    else:
        names = list(parallel.axis_names)
    if len(names) != ndim:
        raise ValueError(
            f"the mesh has {ndim} axes but parallel.axis_names is {names}; name every axis"
        )
    try:
        resolve_axis_names(names, (1,) * ndim)
    except (TypeError, ValueError) as error:
        raise ValueError(f"parallel.axis_names: {error}") from None
    if dp is not None and dp not in names:
        raise ValueError(f"parallel.data_parallel {dp!r} is not one of the axes {names}")
    others = [a for a in names if a != dp]
    if not parallel.domain:
        if len(others) > len(spatial_dims):
            raise ValueError(
                f"the mesh has {len(others)} axes besides data parallelism but the fields have "
                f"{len(spatial_dims)} spatial dims {list(spatial_dims)}; say which dim each "
                f"splits with parallel.domain, or use fewer axes"
            )
        return tuple(names), dp, dict(zip(others, spatial_dims))
    _check_domain(parallel.domain, names, dp, spatial_dims)
    return tuple(names), dp, {axis: parallel.domain[axis] for axis in others}


def _check_domain(
    domain: Mapping[str, str], names: list[str], dp: str | None, spatial_dims: tuple[str, ...]
) -> None:
    for axis, dim in domain.items():
        if axis not in names or axis == dp:
            raise ValueError(
                f"parallel.domain maps {axis!r}, which is not a non-data-parallel axis of {names}"
            )
        if dim not in spatial_dims:
            raise ValueError(
                f"parallel.domain maps mesh axis {axis!r} to {dim!r}, but the fields have "
                f"spatial dims {list(spatial_dims)}"
            )
    unused = [a for a in names if a != dp and a not in domain]
    if unused:
        raise ValueError(
            f"mesh axes {unused} are neither data parallel nor mapped to a spatial dim"
        )
    if len(set(domain.values())) != len(domain):
        raise ValueError(f"parallel.domain maps two axes to one spatial dim: {dict(domain)}")


@dataclass(frozen=True, eq=False)
class Parallelism:
    """A run's one DeviceMesh and what its axes do, on this rank (NOTE [A run is planned
    once]): which part of the batch is mine, which mesh carries the fields, how they are placed
    on it.

    Attributes
    ----------
    plan : ParallelPlan
    mesh : DeviceMesh
        The whole mesh, its axes named as in the plan.
    """

    plan: ParallelPlan
    mesh: DeviceMesh

    @classmethod
    def build(cls, plan: ParallelPlan, device_type: str | None = None) -> Parallelism:
        """The mesh of ``plan`` over every rank of the default process group.

        Raises
        ------
        ValueError
            If the process group does not have the plan's ranks (the same on every rank).
        """
        if dist.get_world_size() != plan.world_size:
            raise ValueError(
                f"the run was planned for {plan.world_size} ranks ({plan.describe()}), but the "
                f"process group has {dist.get_world_size()}"
            )
        return cls(plan, build_mesh(plan.shape, plan.axis_names, device_type))

    @property
    def device(self) -> torch.device:
        """The device of this rank's collectives (and of its model): ``cuda:<current>`` on a
        CUDA mesh, else the CPU."""
        if self.mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.mesh.device_type)

    # ------------------------------------------------------------------ data parallelism
    @property
    def dp_size(self) -> int:
        return self.plan.dp_size

    @property
    def dp_rank(self) -> int:
        axis = self.plan.dp_axis
        return self.mesh.get_local_rank(axis) if axis else 0

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        axis = self.plan.dp_axis
        return self.mesh.get_group(axis) if axis and self.dp_size > 1 else None

    @cached_property
    def dp_mesh(self) -> DeviceMesh | None:
        axis = self.plan.dp_axis
        return self.mesh[axis] if axis else None

    # ------------------------------------------------------------------ domain decomposition
    @property
    def domain_axes(self) -> tuple[str, ...]:
        return self.plan.domain_axes

    @cached_property
    def domain_mesh(self) -> DeviceMesh | None:
        """The sub-mesh the fields are sharded over (None: no domain decomposition)."""
        axes = self.domain_axes
        if all(self.plan.size(axis) == 1 for axis in axes):
            return None
        return self.mesh[axes] if len(axes) > 1 else self.mesh[axes[0]]

    def split_dims(self, dims: Sequence[str]) -> dict[str, int]:
        """Domain axis -> the index in ``dims`` (a field's dim names) of the dim it splits."""
        for axis in self.domain_axes:
            if self.plan.domain[axis] not in dims:
                raise ValueError(
                    f"mesh axis {axis!r} splits dim {self.plan.domain[axis]!r}, but the fields "
                    f"have dims {list(dims)}"
                )
        return {axis: list(dims).index(self.plan.domain[axis]) for axis in self.domain_axes}

    def field_placements(self, dims: Sequence[str]) -> list[Placement]:
        """Placements on ``domain_mesh`` of a field whose dims are named ``dims``."""
        return [Shard(d) for d in self.split_dims(dims).values()] or [Replicate()]

    def mesh_placements(self, dims: Sequence[str]) -> list[Placement]:
        """Placements on the whole ``mesh`` of a field whose dims are named ``dims``: the domain
        axes split their dims, the data-parallel axis replicates (every replica holds it)."""
        split = self.split_dims(dims)
        return [
            Shard(split[axis]) if axis in split else Replicate() for axis in self.plan.axis_names
        ]

    def on_whole_mesh(self, fields: torch.Tensor, batch_sizes: Sequence[int]) -> ShardTensor:
        """This replica's part of a batch, ``(b, ...)`` (a ShardTensor on ``domain_mesh``, or a
        plain tensor when nothing is split), as one ShardTensor over the whole ``mesh``: dim 0
        split over the data-parallel axis into ``batch_sizes`` (one per replica, in order, this
        replica's ``b``), the other dims as they were. The local block itself, no
        communication: what a writer of the whole batch takes (``ShardedHDF5Writer``).
        """
        if len(batch_sizes) != self.dp_size or batch_sizes[self.dp_rank] != fields.shape[0]:
            raise ValueError(
                f"batch sizes {tuple(batch_sizes)} of {self.dp_size} replicas: replica "
                f"{self.dp_rank} holds {fields.shape[0]} samples"
            )
        shape = (sum(batch_sizes), *fields.shape[1:])
        placements: list[Placement] = [Replicate()] * self.mesh.ndim
        sizes: dict[int, tuple[int, ...]] = {}
        if self.plan.dp_axis is not None:
            placements[self.plan.axis_names.index(self.plan.dp_axis)] = Shard(0)
            sizes[0] = tuple(batch_sizes)
        if isinstance(fields, ShardTensor):
            spec = fields.spec
            for axis, placement in zip(self.domain_axes, spec.placements):
                placements[self.plan.axis_names.index(axis)] = placement
            sizes.update({s.dim: s.sizes for s in spec.shardings})
            fields = fields.to_local()
        spec = ShardTensorSpec.build(self.mesh, placements, shape, fields.dtype, sizes)
        return from_local_spec(fields, spec)

    def describe(self) -> str:
        """``dp=4 (data parallel), domain=2 (splits H)``."""
        return self.plan.describe()
