"""Which mesh axes do what: data parallelism on one axis, domain decomposition on others.

A ``ParallelConfig`` names the mesh axes and says what each one does: at most one axis is data
parallel (each of its ranks trains on its own part of the global batch), every other axis
splits one spatial dim of the fields (the domain decomposition: a slab with one such axis, a
block with two or three). ``ParallelLayout`` builds the DeviceMesh and answers the questions
a training loop asks: which part of the batch is mine, which mesh carries the fields, how are
they placed on it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

from shardsci.distributed import build_mesh, mesh_axis_sizes, parse_mesh_shape

__all__ = ["LayoutPlan", "ParallelConfig", "ParallelLayout", "mesh_world_size"]


@dataclass
class ParallelConfig:
    """What the mesh axes do (the ``parallel`` config group).

    Attributes
    ----------
    axis_names : list of str or None
        One name per mesh axis; None: ``[dp]``, ``[dp, domain]`` or ``[dp, domain_h,
        domain_w]`` for 1, 2 or 3 axes.
    data_parallel : str or None
        The data-parallel axis, or None.
    domain : dict or None
        Mesh axis name -> the spatial dim it splits (a dim name of the fields, e.g. "H");
        None: the non-data-parallel axes split H, then W, then D.
    """

    axis_names: list[str] | None = None
    data_parallel: str | None = "dp"
    domain: dict[str, str] | None = None

    def resolved(self, ndim: int) -> ParallelConfig:
        """This config for a mesh of ``ndim`` axes, defaults filled in and checked."""
        names = list(self.axis_names or _DEFAULT_NAMES.get(ndim, []))
        if len(names) != ndim:
            raise ValueError(
                f"the mesh has {ndim} axes but parallel.axis_names is {names or None}; name "
                f"every axis (defaults exist for 1 to 3 axes)"
            )
        dp = self.data_parallel if self.data_parallel in names else None
        if self.data_parallel is not None and dp is None and self.axis_names is not None:
            raise ValueError(
                f"parallel.data_parallel {self.data_parallel!r} is not one of the axes {names}"
            )
        others = [a for a in names if a != dp]
        domain = dict(self.domain) if self.domain is not None else dict(zip(others, "HWD"))
        resolved = ParallelConfig(names, dp, domain)
        resolved._check(names, dp, domain)
        return resolved

    @staticmethod
    def _check(names: list[str], dp: str | None, domain: dict[str, str]) -> None:
        if len(set(names)) != len(names):
            raise ValueError(f"parallel.axis_names repeats a name: {names}")
        for axis in domain:
            if axis not in names or axis == dp:
                raise ValueError(
                    f"parallel.domain maps {axis!r}, which is not a non-data-parallel axis of "
                    f"{names}"
                )
        unused = [a for a in names if a != dp and a not in domain]
        if unused:
            raise ValueError(
                f"mesh axes {unused} are neither data parallel nor mapped to a spatial dim"
            )
        if len(set(domain.values())) != len(domain):
            raise ValueError(f"parallel.domain maps two axes to one spatial dim: {domain}")


_DEFAULT_NAMES = {1: ["dp"], 2: ["dp", "domain"], 3: ["dp", "domain_h", "domain_w"]}


def mesh_world_size(mesh: str | int | Sequence[int]) -> int | None:
    """Ranks in a mesh spec such as ``"4x2"``; None when an axis is ``-1`` (inferred)."""
    sizes = mesh_axis_sizes(mesh)
    return None if -1 in sizes else math.prod(sizes)


@dataclass(frozen=True)
class LayoutPlan:
    """A mesh's axis sizes and roles, known before any process exists.

    Attributes
    ----------
    shape : tuple of int
        Ranks per mesh axis.
    config : ParallelConfig
        The axes' roles, resolved.
    """

    shape: tuple[int, ...]
    config: ParallelConfig

    @classmethod
    def of(
        cls, mesh: str | int | Sequence[int], parallel: ParallelConfig, world_size: int
    ) -> LayoutPlan:
        """The plan of ``mesh`` (e.g. ``"4x2"``, ``"-1x2"``) over ``world_size`` ranks.

        Raises
        ------
        ValueError
            If the mesh does not cover ``world_size`` ranks or ``parallel`` does not fit it;
            the same error on every rank (it depends on the arguments only).
        """
        shape = parse_mesh_shape(mesh, world_size)
        return cls(shape, parallel.resolved(len(shape)))

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: the size of the dp axis (1 without one)."""
        axis = self.config.data_parallel
        return self.shape[self.config.axis_names.index(axis)] if axis else 1

    def ranks_along(self, dim: str) -> int:
        """Ranks that split the spatial dim named ``dim`` (e.g. ``"H"``): 1 when none does."""
        sizes = [
            size
            for name, size in zip(self.config.axis_names, self.shape)
            if self.config.domain.get(name) == dim
        ]
        return math.prod(sizes)

    def describe(self) -> str:
        """``dp=4 (data parallel), domain=2 (splits H)``."""
        roles = []
        for name, size in zip(self.config.axis_names, self.shape):
            role = (
                "data parallel"
                if name == self.config.data_parallel
                else f"splits {self.config.domain[name]}"
                if name in self.config.domain
                else "unused"
            )
            roles.append(f"{name}={size} ({role})")
        return ", ".join(roles)


@dataclass
class ParallelLayout:
    """The mesh of a run and the roles of its axes.

    Attributes
    ----------
    mesh : DeviceMesh
        The whole mesh.
    config : ParallelConfig
        Its axis roles, resolved.
    """

    mesh: DeviceMesh
    config: ParallelConfig

    @classmethod
    def build(
        cls,
        mesh: str | int | Sequence[int],
        parallel: ParallelConfig,
        device_type: str | None = None,
    ) -> ParallelLayout:
        """The mesh ``mesh`` (e.g. ``"4x2"``) over all ranks, with axis roles ``parallel``.

        Raised errors are the same on every rank (they depend on the arguments only).
        """
        plan = LayoutPlan.of(mesh, parallel, dist.get_world_size())
        return cls(build_mesh(plan.shape, plan.config.axis_names, device_type), plan.config)

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
        axis = self.config.data_parallel
        return self.mesh.size(self.config.axis_names.index(axis)) if axis else 1

    @property
    def dp_rank(self) -> int:
        axis = self.config.data_parallel
        return self.mesh.get_local_rank(axis) if axis else 0

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        axis = self.config.data_parallel
        return self.mesh.get_group(axis) if axis and self.dp_size > 1 else None

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        axis = self.config.data_parallel
        return self.mesh[axis] if axis else None

    # ------------------------------------------------------------------ domain decomposition
    @property
    def domain_axes(self) -> list[str]:
        """The axes that split spatial dims, in mesh order."""
        return [a for a in self.config.axis_names if a in self.config.domain]

    @property
    def domain_mesh(self) -> DeviceMesh | None:
        """The sub-mesh the fields are sharded over (None: no domain decomposition)."""
        axes = self.domain_axes
        if not axes or all(self.mesh.size(self.config.axis_names.index(a)) == 1 for a in axes):
            return None
        return self.mesh[tuple(axes)] if len(axes) > 1 else self.mesh[axes[0]]

    def field_placements(self, dims: Sequence[str]) -> list[Placement]:
        """Placements on ``domain_mesh`` of a field whose dims are named ``dims``."""
        placements: list[Placement] = []
        for axis in self.domain_axes:
            name = self.config.domain[axis]
            if name not in dims:
                raise ValueError(
                    f"mesh axis {axis!r} splits dim {name!r}, but the fields have dims {list(dims)}"
                )
            placements.append(Shard(list(dims).index(name)))
        return placements or [Replicate()]

    def describe(self) -> str:
        """``dp=4 (data parallel), domain=2 (splits H)``."""
        return LayoutPlan(tuple(self.mesh.shape), self.config).describe()
