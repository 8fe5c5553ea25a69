"""The symmetries of a periodic box acting on velocity fields: the recipe's data augmentation.

NOTE [Symmetries of the box act on positions and on components]
Navier–Stokes in a periodic box, with the band forcing (NOTE [Band forcing at constant
power]: isotropic, a function of the state only), commutes with every rotation and reflection
R that maps the box onto itself, the 48 signed permutations of the axes of a cube: if u solves
it, so does ``(g u)(x) = R u(R⁻¹ x)``. On velocity fields ``(..., 3, D, H, W)`` (channel c is
the component along spatial dim c, x along D) this is, for output dim d:

- position: output dim d is input dim ``axes[d]``, reversed where ``signs[d] = -1``;
- component: output channel d is ``signs[d]`` times input channel ``axes[d]``.

A reflection changes the sign of the component along it; permuting positions without
permuting components (or flipping without negating) gives a field that solves no equation.
Reversing ``i -> N - 1 - i`` is the reflection x -> -x followed by a translation of N - 1
cells, so it maps the grid onto itself and is exact. A pair (u(t), u(t + Δt)) mapped by the
same g is again a pair of the solver: ``tests/test_cfd3d_recipe.py`` checks that the solver's
step commutes with every g. A permutation needs the permuted dims to be equally long: on a
box that is not a cube only the symmetries that keep its shape exist (``box_symmetries``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from shardsci import ShardTensor

__all__ = ["BoxSymmetry", "box_symmetries"]


@dataclass(frozen=True)
class BoxSymmetry:
    """One signed permutation of the axes: output dim d is input dim ``axes[d]`` times
    ``signs[d]`` (NOTE [Symmetries of the box act on positions and on components])."""

    axes: tuple[int, int, int]
    signs: tuple[int, int, int]

    @property
    def is_identity(self) -> bool:
        """Whether this symmetry leaves every field as it is."""
        return self.axes == (0, 1, 2) and self.signs == (1, 1, 1)

    def __call__(self, fields: torch.Tensor) -> torch.Tensor:
        """``(N, 3, D, H, W) -> (N, 3, D', H', W')``, ``fields`` mapped by this symmetry.

        A ShardTensor keeps its layout (placements and shard sizes): a permutation moves the
        sharded dims, and the result is redistributed back, which moves every cell across
        ranks once; a reversal of a sharded dim exchanges mirror blocks.
        """
        if fields.ndim != 5 or fields.shape[1] != 3:
            raise ValueError(
                f"a box symmetry acts on velocity fields (N, 3, D, H, W), got {tuple(fields.shape)}"
            )
        if self.is_identity:
            return fields
        moved = fields.permute(0, 1, *(2 + a for a in self.axes))
        reversed_dims = [2 + d for d, s in enumerate(self.signs) if s < 0]
        if reversed_dims:
            moved = moved.flip(reversed_dims)
        components = [s * moved[:, a : a + 1] for a, s in zip(self.axes, self.signs, strict=True)]
        mapped = torch.cat(components, dim=1)
        if isinstance(fields, ShardTensor):
            mapped = mapped.redistribute(
                placements=fields.placements, sharding_shapes=fields.sharding_shapes()
            )
        return mapped


def box_symmetries(spatial_shape: tuple[int, int, int]) -> tuple[BoxSymmetry, ...]:
    """The signed permutations that map a box of ``spatial_shape`` ``(D, H, W)`` onto itself:
    48 for a cube, the identity first."""
    return tuple(
        BoxSymmetry(axes, signs)
        for axes in itertools.permutations(range(3))
        if all(spatial_shape[a] == spatial_shape[d] for d, a in enumerate(axes))
        for signs in itertools.product((1, -1), repeat=3)
    )
