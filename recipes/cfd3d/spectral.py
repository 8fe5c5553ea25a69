"""Fourier multipliers of a periodic N³ grid, laid out like the spectrum they act on.

A spectrum is the ``rfftn`` of fields ``(..., N, N, N)`` over their last three dims: its modes
are ``(N, N, M)``, M = N//2 + 1, with integer wavenumbers ``fftfreq`` along the first two dims
and ``rfftfreq`` along the last. On a ShardTensor the modes are sharded as the distributed FFT
leaves them (NOTE [Where a distributed FFT leaves the spectrum] in
``shardsci/tensor/_ops/_fft_ops.py``).

NOTE [Multipliers have the layout of the modes they multiply]
Each multiplier is an ``(N, N, M)`` tensor laid out exactly like the modes of the spectrum it
was built from: a plain tensor for a plain spectrum, else a ShardTensor sharded along the same
dims, over the same mesh axes, with the same shard sizes (:func:`mode_numbers` builds each
rank's block from its offsets; nothing is built whole), and every multiplier is derived from
those by pointwise ops. Before it multiplies a field it is expanded (a view) to the field's
shape (:meth:`SpectralGrid.scale`), so the product is one pointwise op between operands of one
layout: shardsci's fast path runs it on the local shards with no sharding propagation and no
communication. (Broadcasting an ``(N, N, M)`` operand against a ``(B, 3, N, N, M)`` one, or a
``.to(dtype)``, instead costs a sharding propagation per new pattern the first time it is seen:
1.3-3.8 s each on a 2x2x2 mesh, measured on this 2-core machine under a load of ~13.)

The field is the first operand of every such product: the fast path gives the result the
first operand's spec, hints included, and the multipliers carry no hints, while the inverse
FFT needs the spectrum's hints to return the layout the forward transform came from (NOTE
[Shard-size hints] in ``shardsci/tensor/_spec.py``). With the multiplier first, the 2x2x2
velocity came back from a time step laid out ``D/(0, 2), H/1``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Replicate, Shard

from shardsci import ShardTensor, ShardTensorSpec

__all__ = ["SPATIAL_DIMS", "SpectralGrid", "cross", "mode_numbers", "vector_components"]

SPATIAL_DIMS = (-3, -2, -1)
"""The dims (D, H, W) = (x, y, z) of a field, and of its spectrum's modes."""


def mode_numbers(spectrum: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """Integer wavenumbers ``(n_x, n_y, n_z)`` of the modes of ``spectrum`` ``(..., N, N, M)``,
    each ``(N, N, M)`` real, laid out like the modes (NOTE [Multipliers have the layout of the
    modes they multiply]).

    Axes that shard the leading dims of ``spectrum`` (none in the solver) replicate the modes.
    """
    dtype, device = spectrum.real.dtype, spectrum.device
    tables = [
        torch.fft.fftfreq(n, 1.0 / n, dtype=dtype, device=device),
        torch.fft.fftfreq(n, 1.0 / n, dtype=dtype, device=device),
        torch.fft.rfftfreq(n, 1.0 / n, dtype=dtype, device=device),
    ]
    modes_shape = tuple(spectrum.shape[-3:])
    if modes_shape != (n, n, n // 2 + 1):
        raise ValueError(f"expected modes ({n}, {n}, {n // 2 + 1}), got {modes_shape}")
    if not isinstance(spectrum, ShardTensor):
        return tuple(
            _along(table, dim).expand(modes_shape) for table, dim in zip(tables, SPATIAL_DIMS)
        )
    spec = _modes_spec(spectrum.spec, dtype)
    offsets, shape = spec.local_offsets(), spec.local_shape()
    local_tables = [t[o : o + s] for t, o, s in zip(tables, offsets, shape)]
    return tuple(
        ShardTensor(_along(table, dim).expand(shape).contiguous(), spec)
        for table, dim in zip(local_tables, SPATIAL_DIMS)
    )


def _modes_spec(spec: ShardTensorSpec, dtype: torch.dtype) -> ShardTensorSpec:
    """The layout of the last three dims of ``spec``, as an ``(N, N, M)`` tensor's."""
    lead = spec.ndim - 3
    placements = [
        Shard(p.dim - lead) if isinstance(p, Shard) and p.dim >= lead else Replicate()
        for p in spec.placements
    ]
    mode_shardings = [s for s in spec.shardings if s.dim >= lead]
    return ShardTensorSpec.build(
        spec.mesh,
        placements,
        spec.shape[lead:],
        dtype,
        {s.dim - lead: s.sizes for s in mode_shardings},
        order={s.dim - lead: s.axes for s in mode_shardings},
    )


def _along(table: torch.Tensor, dim: int) -> torch.Tensor:
    """A 1-D ``table`` shaped to broadcast along spatial ``dim`` (-3, -2 or -1)."""
    shape = [1, 1, 1]
    shape[dim] = -1
    return table.reshape(shape)


@dataclass(frozen=True)
class SpectralGrid:
    """The solver's Fourier multipliers, each ``(N, N, M)`` and laid out like the modes of the
    spectrum they were built from (NOTE [Multipliers have the layout of the modes they
    multiply]).

    The multipliers of complex fields have the spectrum's complex dtype (with zero imaginary
    parts): a real operand would be copied to a complex one at every product.

    Attributes
    ----------
    wavevector : tuple of torch.Tensor
        Angular wavenumbers (k_x, k_y, k_z) = 2π n / L, per box unit.
    inverse_k2 : torch.Tensor
        1 / |k|², and 0 at k = 0.
    viscous_decay : torch.Tensor
        e^{-ν|k|² dt / 2}, the integrating factor over half a time step.
    dealias : torch.Tensor
        1 on the modes kept by the 2/3 rule (3|n_i| < N for each i), 0 elsewhere.
    forced : torch.Tensor
        1 on the modes 0 < |n| ≤ n_f, 0 elsewhere.
    multiplicity : torch.Tensor
        How many modes of the full spectrum each stored one stands for: 1 at n_z = 0 and at
        n_z = N/2, else 2 (its conjugate at -n is not stored). Real: it weighs energies.
    """

    wavevector: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    inverse_k2: torch.Tensor
    viscous_decay: torch.Tensor
    dealias: torch.Tensor
    forced: torch.Tensor
    multiplicity: torch.Tensor

    @classmethod
    def like(
        cls,
        spectrum: torch.Tensor,
        n: int,
        length: float,
        viscosity: float,
        dt: float,
        forcing_wavenumber: float,
    ) -> SpectralGrid:
        """The multipliers of an ``n``³ grid on a box of side ``length``, laid out like the
        modes of ``spectrum`` ``(..., n, n, n//2+1)``."""
        n_x, n_y, n_z = mode_numbers(spectrum, n)
        scale = 2 * math.pi / length
        wavevector = (scale * n_x, scale * n_y, scale * n_z)
        k2 = wavevector[0] ** 2 + wavevector[1] ** 2 + wavevector[2] ** 2
        n2 = n_x**2 + n_y**2 + n_z**2
        kept = (3 * n_x.abs() < n) & (3 * n_y.abs() < n) & (3 * n_z.abs() < n)
        band = (n2 > 0) & (n2 <= forcing_wavenumber**2)
        unpaired = (n_z == 0) | (2 * n_z == n)
        mean = n2 == 0
        return cls(
            wavevector=tuple(_complex(k_i) for k_i in wavevector),
            inverse_k2=_complex(_indicator(~mean, k2) / (k2 + mean)),
            viscous_decay=_complex(torch.exp(k2 * (-viscosity * dt / 2))),
            dealias=_complex(_indicator(kept, k2)),
            forced=_complex(_indicator(band, k2)),
            multiplicity=2 - _indicator(unpaired, k2),
        )

    @staticmethod
    def scale(field: torch.Tensor, multiplier: torch.Tensor) -> torch.Tensor:
        """``field`` ``(..., N, N, M)`` times ``multiplier`` ``(N, N, M)``, expanded (a view) to
        ``field``'s shape. The field comes first: see NOTE [Multipliers have the layout of
        the modes they multiply]."""
        return field * multiplier.expand(field.shape)

    def project(self, field_hat: torch.Tensor) -> torch.Tensor:
        """Leray projection P û = û - k (k·û) / |k|² of spectral vectors ``(B, 3, N, N, M)``."""
        components = vector_components(field_hat)
        k_dot = sum(self.scale(c, k_i) for c, k_i in zip(components, self.wavevector))
        along_k = self.scale(k_dot, self.inverse_k2)
        return torch.cat(
            [c - self.scale(along_k, k_i) for c, k_i in zip(components, self.wavevector)], dim=1
        )

    def curl(self, field_hat: torch.Tensor) -> list[torch.Tensor]:
        """Components ``(B, 1, N, N, M)`` of the spectral curl i k × û of ``(B, 3, N, N, M)``
        (concatenate them on dim 1 for the vector)."""
        c_x, c_y, c_z = vector_components(field_hat)
        ik_x, ik_y, ik_z = (1j * k_i for k_i in self.wavevector)
        return [
            self.scale(c_z, ik_y) - self.scale(c_y, ik_z),
            self.scale(c_x, ik_z) - self.scale(c_z, ik_x),
            self.scale(c_y, ik_x) - self.scale(c_x, ik_y),
        ]

    def divergence(self, field_hat: torch.Tensor) -> torch.Tensor:
        """Spectral divergence i k·û of ``(B, 3, N, N, M)``, ``(B, 1, N, N, M)``."""
        components = vector_components(field_hat)
        return sum(self.scale(c, 1j * k_i) for c, k_i in zip(components, self.wavevector))

    def energy(self, field_hat: torch.Tensor, band: bool = False) -> torch.Tensor:
        """Kinetic energy ½⟨|u|²⟩ of ``rfftn`` coefficients ``(B, 3, N, N, M)`` (of the
        forced modes only if ``band``), by Parseval, shape ``(B,)``."""
        weight = self.multiplicity * self.forced.real if band else self.multiplicity
        density = field_hat.real**2 + field_hat.imag**2
        cells = self.inverse_k2.shape[0] ** 3
        total = self.scale(density, weight).sum(dim=(-4, *SPATIAL_DIMS))
        return total * (0.5 / cells**2)


def _indicator(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """1 where ``mask``, else 0, in ``like``'s dtype and layout (pointwise ops only)."""
    return like * 0 + mask


def _complex(field: torch.Tensor) -> torch.Tensor:
    """A real ``field`` in the matching complex dtype (a pointwise op, no propagation)."""
    return field * (1 + 0j)


def vector_components(field: torch.Tensor) -> list[torch.Tensor]:
    """The three components ``(B, 1, N, N, N')`` of a vector field ``(B, 3, N, N, N')``.

    Slices that keep the component dim, put back together with ``torch.cat``, rather than
    ``unbind`` and ``stack``: shardsci re-indexes neither the shard-size hints of the dim that
    ``unbind`` removes nor those of the dim that ``stack`` inserts, and a spectrum whose hints
    name the wrong dims comes back from the inverse FFT in another layout (a 2x2x2 velocity
    as ``D/(0, 2), H/1``; the sharded tests' layout check fails with ``unbind``/``stack``)."""
    return [field[:, i : i + 1] for i in range(3)]


def cross(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> torch.Tensor:
    """a × b of two vectors given by their components ``(B, 1, ...)``, as ``(B, 3, ...)``."""
    a0, a1, a2 = a
    b0, b1, b2 = b
    return torch.cat([a1 * b2 - a2 * b1, a2 * b0 - a0 * b2, a0 * b1 - a1 * b0], dim=1)
