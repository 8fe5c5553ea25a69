"""Mesh-shape parsing, axis names, and building a mesh on a one-rank group."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch.distributed as dist

from shardsci.distributed import build_mesh, init_distributed, parse_mesh_shape
from shardsci.distributed._mesh import MeshSpec, resolve_axis_names


@pytest.mark.parametrize(
    ("spec", "world_size", "shape"),
    [
        ("4x2", 8, (4, 2)),
        ("8", 8, (8,)),
        ("2x2x2", 8, (2, 2, 2)),
        (" 4 X 2 ", 8, (4, 2)),
        (8, 8, (8,)),
        ((4, 2), 8, (4, 2)),
        ([-1, 2], 8, (4, 2)),
        ("-1x2", 8, (4, 2)),
        ("2x-1x2", 8, (2, 2, 2)),
        (-1, 3, (3,)),
        ("1x1", 1, (1, 1)),
    ],
)
def test_parse_mesh_shape(spec: MeshSpec, world_size: int, shape: tuple[int, ...]) -> None:
    assert parse_mesh_shape(spec, world_size) == shape


@pytest.mark.parametrize(
    ("spec", "world_size", "message"),
    [
        ("4x2", 4, "mesh shape 4x2 has 8 ranks but the world size is 4"),
        ((4, 2), 4, r"mesh shape \(4, 2\) has 8 ranks but the world size is 4"),
        (3, 4, "mesh shape 3 has 3 ranks but the world size is 4"),
        ("4xa", 8, "mesh shape 4xa: axis size 'a' is not an integer"),
        ("4x", 4, "mesh shape 4x: axis size '' is not an integer"),
        ("", 1, "mesh shape : axis size '' is not an integer"),
        ("4*2", 8, "axis size '4\\*2' is not an integer"),
        ("4x0", 4, "mesh shape 4x0: axis 1 has size 0; expected a positive integer, or -1"),
        ((-2, 2), 4, r"axis 0 has size -2"),
        ("-1x-1", 4, "mesh shape -1x-1 has 2 axes of size -1; at most one can be inferred"),
        ("-1x3", 8, "cannot cover world size 8: the other axes hold 3 ranks"),
        ((), 1, r"mesh shape \(\) has no axes"),
        ("2x2", 0, "world size must be a positive int, got 0"),
    ],
)
def test_parse_mesh_shape_errors(spec: MeshSpec, world_size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_mesh_shape(spec, world_size)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ((4, 2.0), r"mesh shape \(4, 2.0\): axis size 2.0 is not an int"),
        ((True, 2), "axis size True is not an int"),
        (True, "mesh shape must be a string like '4x2'"),
        (4.0, "mesh shape must be a string like '4x2'"),
        (None, "mesh shape must be a string like '4x2'"),
    ],
)
def test_parse_mesh_shape_type_errors(spec: object, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        parse_mesh_shape(spec, 8)  # type: ignore[arg-type]


def test_default_axis_names() -> None:
    assert resolve_axis_names(None, (2, 2, 2)) == ("axis0", "axis1", "axis2")


@pytest.mark.parametrize(
    ("names", "error", "message"),
    [
        (("dp",), ValueError, r"axis_names \('dp',\) has 1 name\(s\) but mesh shape \(2, 2\)"),
        (("dp", "dp"), ValueError, "repeats dp; names must be unique"),
        (("dp", ""), ValueError, "axis name '' is not a non-empty Python identifier"),
        (("dp", "2d"), ValueError, "axis name '2d' is not"),
        (("dp", 1), ValueError, "axis name 1 is not"),
        ("dp", TypeError, "not the string 'dp'"),
    ],
)
def test_axis_name_errors(names: Sequence[str], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        resolve_axis_names(names, (2, 2))


@pytest.fixture
def one_rank_group():
    """A 1-rank gloo default group for the duration of a test."""
    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process")
    init_distributed(environ={})
    yield
    dist.destroy_process_group()


def test_build_mesh_needs_a_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process")
    with pytest.raises(RuntimeError, match=r"call shardsci\.distributed\.init_distributed\(\)"):
        build_mesh("1")


def test_build_mesh_on_one_rank(one_rank_group: None) -> None:
    mesh = build_mesh("-1x1", ("dp", "domain"))
    assert (mesh.device_type, tuple(mesh.shape), mesh.mesh_dim_names) == (
        "cpu",
        (1, 1),
        ("dp", "domain"),
    )
    assert build_mesh(1).mesh_dim_names == ("axis0",)


def test_build_mesh_checks_before_building(one_rank_group: None) -> None:
    with pytest.raises(ValueError, match="mesh shape 2x1 has 2 ranks but the world size is 1"):
        build_mesh("2x1")
    with pytest.raises(ValueError, match="repeats dp"):
        build_mesh("1x1", ("dp", "dp"))
