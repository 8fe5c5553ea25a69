"""An unstructured triangle mesh of a rectangle with circular holes (flow past cylinders).

Nodes: points on every cylinder's wall and a second ring just outside it (finer spacing near
the walls, where the flow has its boundary layers), points along the rectangle's sides, and
a jittered grid inside; Delaunay triangulation (``scipy``), then the triangles inside a
cylinder are dropped, leaving the holes. Each node gets a type: fluid, wall, inflow or outer
boundary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from shardsci.recipes.mesh_cfd.cylinder_flow import Cylinder

NODE_TYPES = ("fluid", "wall", "inflow", "boundary")
"""Node type names, by type id."""


@dataclass(frozen=True)
class MeshConfig:
    """Where the mesh lies and how fine it is."""

    length: float = 1.6
    """The mesh covers x in [0, length] (the flow's box is longer: its sponge is not meshed)."""
    height: float = 1.0
    """And y in [0, height]."""
    spacing: float = 0.04
    """Node spacing away from the cylinders."""
    wall_spacing: float = 0.02
    """Node spacing on the cylinders' walls."""
    jitter: float = 0.3
    """Interior nodes move by up to this fraction of ``spacing`` off their grid."""
    seed: int = 0
    """Seed of the jitter."""


@dataclass(frozen=True)
class TriangleMesh:
    """Nodes, triangles and edges of a mesh.

    Attributes
    ----------
    positions : Tensor
        ``(N, 2)`` float64 node coordinates (x, y).
    triangles : Tensor
        ``(T, 3)`` int64 node ids, counter-clockwise.
    node_type : Tensor
        ``(N,)`` int64 index into :data:`NODE_TYPES`.
    """

    positions: torch.Tensor
    triangles: torch.Tensor
    node_type: torch.Tensor

    @property
    def edge_index(self) -> torch.Tensor:
        """``(2, E)`` every triangle side, in both directions, sorted by (source, destination)."""
        t = self.triangles
        sides = torch.cat([t[:, [0, 1]], t[:, [1, 2]], t[:, [2, 0]]])
        both = torch.cat([sides, sides.flip(1)])
        return torch.unique(both, dim=0).t().contiguous()


def cylinder_mesh(cylinders: tuple[Cylinder, ...], config: MeshConfig) -> TriangleMesh:
    """Triangulate ``[0, length] × [0, height]`` minus the ``cylinders``."""
    from scipy.spatial import Delaunay  # half a second of import, paid where a mesh is made

    rng = np.random.default_rng(config.seed)
    walls, rings = [], []
    for x, y, r in cylinders:
        count = math.ceil(2 * math.pi * r / config.wall_spacing)
        angles = 2 * math.pi * np.arange(count) / count
        walls.append(np.stack([x + r * np.cos(angles), y + r * np.sin(angles)], 1))
        outer = r + config.wall_spacing
        shifted = angles + math.pi / count
        rings.append(np.stack([x + outer * np.cos(shifted), y + outer * np.sin(shifted)], 1))
    sides = _rectangle_sides(config)
    interior = _jittered_grid(config, rng)
    keep = _clearance(interior, cylinders) > config.wall_spacing + 0.5 * config.spacing
    keep &= _inside_rectangle(interior, config, margin=0.5 * config.spacing)
    points = np.concatenate([*walls, *rings, sides, interior[keep]])
    types = np.concatenate(
        [
            np.full(sum(len(w) for w in walls), 1),
            np.zeros(sum(len(r) for r in rings), dtype=np.int64),
            np.where(sides[:, 0] == 0.0, 2, 3),
            np.zeros(int(keep.sum()), dtype=np.int64),
        ]
    )
    triangles = Delaunay(points).simplices
    centroids = points[triangles].mean(1)
    triangles = triangles[_clearance(centroids, cylinders) > 0]
    triangles = _counter_clockwise(points, triangles)
    return TriangleMesh(
        positions=torch.as_tensor(points, dtype=torch.float64),
        triangles=torch.as_tensor(triangles, dtype=torch.int64),
        node_type=torch.as_tensor(types, dtype=torch.int64),
    )


def _rectangle_sides(config: MeshConfig) -> np.ndarray:
    nx = math.ceil(config.length / config.spacing)
    ny = math.ceil(config.height / config.spacing)
    xs = np.linspace(0.0, config.length, nx + 1)
    ys = np.linspace(0.0, config.height, ny + 1)[1:-1]
    return np.concatenate(
        [
            np.stack([xs, np.zeros_like(xs)], 1),
            np.stack([xs, np.full_like(xs, config.height)], 1),
            np.stack([np.zeros_like(ys), ys], 1),
            np.stack([np.full_like(ys, config.length), ys], 1),
        ]
    )


def _jittered_grid(config: MeshConfig, rng: np.random.Generator) -> np.ndarray:
    xs = np.arange(config.spacing, config.length, config.spacing)
    ys = np.arange(config.spacing, config.height, config.spacing)
    grid = np.stack(np.meshgrid(xs, ys, indexing="ij"), -1).reshape(-1, 2)
    return grid + rng.uniform(-1, 1, grid.shape) * config.jitter * config.spacing


def _clearance(points: np.ndarray, cylinders: tuple[Cylinder, ...]) -> np.ndarray:
    """Distance from each point to the nearest cylinder wall, negative inside."""
    distances = [np.hypot(points[:, 0] - x, points[:, 1] - y) - r for x, y, r in cylinders]
    return np.min(distances, axis=0)


def _inside_rectangle(points: np.ndarray, config: MeshConfig, margin: float) -> np.ndarray:
    x, y = points[:, 0], points[:, 1]
    return (x > margin) & (x < config.length - margin) & (y > margin) & (y < config.height - margin)


def _counter_clockwise(points: np.ndarray, triangles: np.ndarray) -> np.ndarray:
    a, b, c = (points[triangles[:, k]] for k in range(3))
    signed = (b[:, 0] - a[:, 0]) * (c[:, 1] - a[:, 1]) - (b[:, 1] - a[:, 1]) * (c[:, 0] - a[:, 0])
    flipped = triangles.copy()
    flipped[signed < 0] = triangles[signed < 0][:, [0, 2, 1]]
    return flipped
