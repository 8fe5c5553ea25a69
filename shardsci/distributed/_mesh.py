"""Named device meshes from shape specs such as ``"4x2"``.

NOTE [Mesh errors are raised before any collective]
Every check here is a pure function of the spec, the axis names and the world size, which
are the same on every rank. A bad spec therefore raises the same error on all ranks before
``init_device_mesh`` runs a collective, instead of leaving some ranks waiting for others.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MeshSpec = str | int | Sequence[int]
"""A mesh shape: ``"4x2"``, ``"-1x2"``, ``8`` or ``(4, 2)``; ``-1`` marks one inferred axis."""


def parse_mesh_shape(spec: MeshSpec, world_size: int) -> tuple[int, ...]:
    """Turn a mesh spec into axis sizes whose product is the world size.

    Parameters
    ----------
    spec
        ``"4x2"``, ``"8"``, ``"2x2x2"``, ``8``, ``(4, 2)``, ``[-1, 2]`` or ``"-1x2"``. At most
        one axis may be ``-1``; its size is inferred from the world size. Every other size
        must be a positive integer.
    world_size
        Number of ranks the mesh must cover.

    Returns
    -------
    tuple[int, ...]
        Size of each mesh axis, e.g. ``(4, 2)``.

    Raises
    ------
    TypeError
        If ``spec`` is not a string, an int or a sequence of ints.
    ValueError
        If an axis size is not a positive integer or ``-1``, more than one axis is ``-1``, or
        the sizes do not multiply to ``world_size``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be a positive int, got {world_size!r}")
    sizes = _axis_sizes(spec)
    _check_sizes(sizes, spec)
    if -1 in sizes:
        sizes = _infer_wildcard(sizes, spec, world_size)
    ranks = math.prod(sizes)
    if ranks != world_size:
        raise ValueError(
            f"mesh shape {_show(spec)} has {ranks} ranks but the world size is {world_size}"
        )
    return sizes


def mesh_axis_sizes(spec: MeshSpec) -> tuple[int, ...]:
    """The checked axis sizes of ``spec``, with ``-1`` for an axis to infer.

    Raises
    ------
    TypeError, ValueError
        As ``parse_mesh_shape`` does for a malformed spec.
    """
    sizes = _axis_sizes(spec)
    _check_sizes(sizes, spec)
    return sizes


def _show(spec: MeshSpec) -> str:
    """``spec`` as written in error messages: ``4x2``, ``8`` or ``(4, 2)``."""
    return spec if isinstance(spec, str) else str(spec if isinstance(spec, int) else tuple(spec))


def _axis_sizes(spec: MeshSpec) -> tuple[int, ...]:
    """Axis sizes as written in ``spec``, ``-1`` included, before any check."""
    if isinstance(spec, str):
        return tuple(_parse_size(part, spec) for part in spec.lower().split("x"))
    if isinstance(spec, int) and not isinstance(spec, bool):
        return (spec,)
    if isinstance(spec, Sequence):
        return tuple(_as_int(size, spec) for size in spec)
    raise TypeError(
        f"mesh shape must be a string like '4x2', an int or a sequence of ints; got {spec!r}"
    )


def _parse_size(part: str, spec: str) -> int:
    """One axis size of a string spec."""
    try:
        return int(part.strip())
    except ValueError:
        raise ValueError(
            f"mesh shape {spec}: axis size {part.strip()!r} is not an integer; "
            "expected sizes joined by 'x', like '4x2'"
        ) from None


def _as_int(size: object, spec: Sequence[object]) -> int:
    """One axis size of a sequence spec; any integer type but ``bool``."""
    if isinstance(size, bool):
        raise TypeError(f"mesh shape {tuple(spec)}: axis size {size!r} is not an int")
    try:
        return operator.index(size)
    except TypeError:
        raise TypeError(f"mesh shape {tuple(spec)}: axis size {size!r} is not an int") from None


def _check_sizes(sizes: tuple[int, ...], spec: MeshSpec) -> None:
    """Raise unless ``sizes`` is non-empty, each size positive or ``-1``, with one ``-1`` at most."""
    if not sizes:
        raise ValueError(f"mesh shape {_show(spec)} has no axes; expected at least one")
    for axis, size in enumerate(sizes):
        if size < 1 and size != -1:
            raise ValueError(
                f"mesh shape {_show(spec)}: axis {axis} has size {size}; "
                "expected a positive integer, or -1 to infer it"
            )
    if sizes.count(-1) > 1:
        raise ValueError(
            f"mesh shape {_show(spec)} has {sizes.count(-1)} axes of size -1; "
            "at most one can be inferred"
        )


def _infer_wildcard(sizes: tuple[int, ...], spec: MeshSpec, world_size: int) -> tuple[int, ...]:
    """Replace the one ``-1`` in ``sizes`` by what the world size leaves for it."""
    known = -math.prod(sizes)
    if world_size % known != 0:
        raise ValueError(
            f"mesh shape {_show(spec)} cannot cover world size {world_size}: "
            f"the other axes hold {known} ranks, which does not divide {world_size}"
        )
    return tuple(world_size // known if size == -1 else size for size in sizes)


def resolve_axis_names(axis_names: Sequence[str] | None, shape: tuple[int, ...]) -> tuple[str, ...]:
    """Check axis names against a mesh shape; default to ``axis0, axis1, ...``.

    Parameters
    ----------
    axis_names
        One unique, non-empty Python identifier per axis, or ``None`` for the defaults.
    shape
        Size of each mesh axis.

    Returns
    -------
    tuple[str, ...]
        One name per axis.
    """
    if axis_names is None:
        return tuple(f"axis{axis}" for axis in range(len(shape)))
    if isinstance(axis_names, str):
        raise TypeError(
            f"axis_names must be a sequence of names like ('dp', 'domain'), "
            f"not the string {axis_names!r}"
        )
    names = tuple(axis_names)
    if len(names) != len(shape):
        raise ValueError(
            f"axis_names {names} has {len(names)} name(s) but mesh shape {shape} "
            f"has {len(shape)} axes"
        )
    for name in names:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"axis name {name!r} is not a non-empty Python identifier")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"axis_names {names} repeats {', '.join(repeated)}; names must be unique")
    return names


def build_mesh(
    spec: MeshSpec,
    axis_names: Sequence[str] | None = None,
    device_type: str | None = None,
) -> DeviceMesh:
    """Build a named DeviceMesh over all ranks of the default process group.

    The rank grid is ``arange(world_size).view(shape)``, row-major: in a ``"2x2"`` mesh
    named ``("dp", "domain")``, rank ``r`` sits at ``(r // 2, r % 2)``, so ranks that share
    a ``dp`` coordinate are consecutive and form one ``domain`` group.

    Parameters
    ----------
    spec
        Mesh shape, as accepted by :func:`parse_mesh_shape`.
    axis_names
        One unique identifier per axis; ``axis0, axis1, ...`` when ``None``.
    device_type
        ``"cuda"`` or ``"cpu"``; ``"cuda"`` when the default group uses nccl, else ``"cpu"``.

    Returns
    -------
    DeviceMesh
        The mesh, with ``mesh_dim_names`` set to the axis names.

    Raises
    ------
    RuntimeError
        If the default process group is not initialised.
    ValueError, TypeError
        If the spec or the axis names are invalid; every rank raises the same error before
        any collective (see NOTE [Mesh errors are raised before any collective]).
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "build_mesh needs the default process group: call "
            "shardsci.distributed.init_distributed() first"
        )
    shape = parse_mesh_shape(spec, dist.get_world_size())
    names = resolve_axis_names(axis_names, shape)
    if device_type is None:
        device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    return init_device_mesh(device_type, shape, mesh_dim_names=names)
