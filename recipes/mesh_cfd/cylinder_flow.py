"""Flow past cylinders: 2-D incompressible Navier–Stokes around Brinkman-penalised obstacles.

Pseudo-spectral on the periodic box [0, L_x) × [0, L_y) (lengths in box heights, velocities
in units of the nominal inflow), in vorticity form with a uniform mean flow U e_x::

    ∂ω/∂t + u·∇ω = ν Δω + ∇×F,    u = U e_x + ∇⊥ψ,   Δψ = −ω,
    F = −(χ/η) u − σ(x) (u − U e_x).

χ is a smoothed indicator of the cylinders (Brinkman penalisation: inside, the velocity decays
to 0 at rate 1/η, a no-slip obstacle up to a boundary layer of width √(νη)); σ is a sponge
rising to ``sponge_rate`` over ``sponge_width`` before x = L_x, which relaxes the wake to
the uniform flow so that nothing re-enters at x = 0. Behind the cylinders vortices shed for
Reynolds numbers 2rU/ν above ≈ 50.

NOTE [Time stepping of the cylinder flow]
Integrating-factor RK4 (as ``recipes/cfd/navier_stokes.py``): viscosity exactly through
e^{−ν|k|²t}; advection, penalisation and sponge explicitly. RK4's imaginary-axis limit bounds
the advective CFL number dt (max|u|/Δx + max|v|/Δy) below ≈ 1.35 with the 2/3 rule, and its
real-axis limit bounds dt/η below ≈ 2.78; :meth:`CylinderFlow.check` refuses states or
settings that break either.

Fields are returned anywhere by their (dealiased, band-limited) Fourier series, which is exact
for the discrete solution: :meth:`CylinderFlow.sample` evaluates it at mesh nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SOLVER_VERSION = "shardsci-cylinders-ifrk4-brinkman-v1"
"""Changes whenever the discretisation changes, so stored data can be told apart."""

Cylinder = tuple[float, float, float]
"""(x, y, radius), in box units."""


@dataclass(frozen=True)
class CylinderFlowConfig:
    """Geometry, physics and discretisation of the flow past cylinders."""

    length: float = 2.0
    """L_x, the periodic box's extent along the flow."""
    height: float = 1.0
    """L_y, its extent across the flow."""
    nx: int = 128
    """Grid points along x."""
    ny: int = 64
    """Grid points along y."""
    viscosity: float = 2e-3
    """ν; with unit inflow and radius 0.1 the Reynolds number 2rU/ν is 100."""
    cylinders: tuple[float, ...] = (0.4, 0.45, 0.1, 0.85, 0.62, 0.08)
    """Obstacles, one (x, y, radius) triple after another."""
    penalty_time: float = 5e-3
    """η: the time over which the velocity inside an obstacle decays to 0."""
    edge_width: float = 1.5
    """Width of the obstacles' smoothed edge, in grid spacings."""
    sponge_width: float = 0.35
    """Extent of the sponge before x = L_x."""
    sponge_rate: float = 20.0
    """σ at the end of the box, per unit time."""
    dt: float = 5e-3
    """Time step."""

    def __post_init__(self) -> None:
        for name in ("length", "height", "viscosity", "penalty_time", "dt", "sponge_width"):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"CylinderFlowConfig.{name} must be > 0, got {getattr(self, name)!r}"
                )
        if self.nx < 8 or self.ny < 8:
            raise ValueError(
                f"need at least 8 grid points per axis, got nx={self.nx}, ny={self.ny}"
            )
        if self.dt / self.penalty_time > 2.5:
            raise ValueError(
                f"dt={self.dt:g} is too large for penalty_time={self.penalty_time:g}: explicit "
                f"RK4 needs dt / penalty_time <= 2.5 (NOTE [Time stepping of the cylinder flow])"
            )
        if len(self.cylinders) % 3:
            raise ValueError(
                f"CylinderFlowConfig.cylinders holds (x, y, radius) triples, got "
                f"{len(self.cylinders)} numbers"
            )
        for x, y, r in self.circles:
            if not (
                r > 0 and r < x < self.length - self.sponge_width - r and r < y < self.height - r
            ):
                raise ValueError(
                    f"cylinder (x={x}, y={y}, r={r}) must lie inside the box, before the sponge "
                    f"(x < {self.length - self.sponge_width:g})"
                )

    @property
    def circles(self) -> tuple[Cylinder, ...]:
        """The obstacles as (x, y, radius) triples."""
        c = self.cylinders
        return tuple((c[k], c[k + 1], c[k + 2]) for k in range(0, len(c), 3))

    @property
    def spacing(self) -> tuple[float, float]:
        """Grid spacings (Δx, Δy)."""
        return self.length / self.nx, self.height / self.ny


class CylinderFlow:
    """Integrator of :class:`CylinderFlowConfig`'s flow for a batch of inflow speeds.

    States are dealiased spectral vorticities ``(B, nx, ny//2 + 1)`` complex; ``inflow`` is
    the speed U of each batch member, ``(B,)``.
    """

    def __init__(self, config: CylinderFlowConfig, dtype: torch.dtype = torch.float64) -> None:
        self.config = config
        c = config
        kx = 2 * math.pi * torch.fft.fftfreq(c.nx, c.length / c.nx, dtype=dtype)[:, None]
        ky = 2 * math.pi * torch.fft.rfftfreq(c.ny, c.height / c.ny, dtype=dtype)[None, :]
        self.ikx, self.iky = 1j * kx, 1j * ky
        k2 = kx**2 + ky**2
        self.inverse_k2 = torch.where(k2 == 0, 0.0, 1.0 / k2)
        n_x = torch.fft.fftfreq(c.nx, 1.0 / c.nx, dtype=dtype)[:, None]
        n_y = torch.fft.rfftfreq(c.ny, 1.0 / c.ny, dtype=dtype)[None, :]
        self.dealias = ((3 * n_x.abs() < c.nx) & (3 * n_y.abs() < c.ny)).to(dtype)
        self.half_decay = torch.exp(-c.viscosity * k2 * c.dt / 2)
        x = torch.arange(c.nx, dtype=dtype)[:, None] * c.spacing[0]
        y = torch.arange(c.ny, dtype=dtype)[None, :] * c.spacing[1]
        self.solid = obstacle_mask(x, y, c)
        ramp = ((x - (c.length - c.sponge_width)) / c.sponge_width).clamp(0, 1)
        self.sponge = c.sponge_rate * ramp**2 * torch.ones_like(y)

    # ------------------------------------------------------------------ transforms
    def spectral(self, field: torch.Tensor) -> torch.Tensor:
        return self.dealias * torch.fft.rfft2(field)

    def physical(self, field_hat: torch.Tensor) -> torch.Tensor:
        return torch.fft.irfft2(field_hat, s=(self.config.nx, self.config.ny))

    def velocity(self, w_hat: torch.Tensor, inflow: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Total velocity (u, v), each ``(B, nx, ny)``."""
        psi = w_hat * self.inverse_k2
        u, v = self.physical(torch.stack([self.iky * psi, -self.ikx * psi]))
        return u + inflow[:, None, None], v

    # ------------------------------------------------------------------ stepping
    def rhs(self, w_hat: torch.Tensor, inflow: torch.Tensor) -> torch.Tensor:
        """Spectral −u·∇ω + ∇×F (the explicit part), dealiased."""
        u, v = self.velocity(w_hat, inflow)
        w = self.physical(w_hat)
        drag = self.solid / self.config.penalty_time
        fx = -drag * u - self.sponge * (u - inflow[:, None, None])
        fy = -(drag + self.sponge) * v
        # ∇×F − ∇·(uω) = ∂x(F_y − uω) − ∂y(F_x + vω), u being divergence-free.
        gx, gy = torch.fft.rfft2(torch.stack([fy - u * w, fx + v * w]))
        return self.dealias * (self.ikx * gx - self.iky * gy)

    def step(self, w_hat: torch.Tensor, inflow: torch.Tensor) -> torch.Tensor:
        """One integrating-factor RK4 step."""
        dt, e = self.config.dt, self.half_decay
        k1 = self.rhs(w_hat, inflow)
        k2 = self.rhs(e * (w_hat + 0.5 * dt * k1), inflow)
        k3 = self.rhs(e * w_hat + 0.5 * dt * k2, inflow)
        k4 = self.rhs(e * e * w_hat + dt * e * k3, inflow)
        return e * e * w_hat + (dt / 6) * (e * e * k1 + 2 * e * (k2 + k3) + k4)

    def advance(self, w_hat: torch.Tensor, inflow: torch.Tensor, steps: int) -> torch.Tensor:
        for _ in range(steps):
            w_hat = self.step(w_hat, inflow)
        self.check(w_hat, inflow)
        return w_hat

    def check(self, w_hat: torch.Tensor, inflow: torch.Tensor) -> None:
        """Raise ValueError when the flow broke the advective CFL limit (or blew up)."""
        u, v = self.velocity(w_hat, inflow)
        dx, dy = self.config.spacing
        cfl = self.config.dt * float(
            (u.abs().amax(dim=(1, 2)) / dx + v.abs().amax(dim=(1, 2)) / dy).max()
        )
        if not math.isfinite(cfl) or cfl > 1.2:
            raise ValueError(
                f"the cylinder flow reached CFL number {cfl:.3g} with dt={self.config.dt:g} "
                f"(limit 1.2): lower dt or the inflow speed"
            )

    # ------------------------------------------------------------------ sampling
    def sample(
        self, w_hat: torch.Tensor, inflow: torch.Tensor, points: torch.Tensor
    ) -> torch.Tensor:
        """u, v and ω at ``points`` ``(P, 2)`` (x, y): ``(B, P, 3)``, by the Fourier series."""
        c = self.config
        psi = w_hat * self.inverse_k2
        fields = torch.stack([self.iky * psi, -self.ikx * psi, w_hat], 1)  # (B, 3, nx, nyh)
        x, y = points[:, 0:1], points[:, 1:2]
        ex = torch.exp(self.ikx.reshape(1, -1) * x)  # (P, nx)
        ey = torch.exp(self.iky.reshape(1, -1) * y)  # (P, nyh)
        weight = torch.full((ey.shape[1],), 2.0, dtype=x.dtype)
        weight[0] = 1.0
        if c.ny % 2 == 0:
            weight[-1] = 1.0
        along_x = torch.einsum("px,bfxk->bfpk", ex, fields)
        values = (along_x * (ey * weight)).sum(-1).real / (c.nx * c.ny)
        values[:, 0] += inflow[:, None]
        return values.transpose(1, 2)


def obstacle_mask(x: torch.Tensor, y: torch.Tensor, config: CylinderFlowConfig) -> torch.Tensor:
    """χ: 1 inside the cylinders, 0 outside, a tanh edge of ``edge_width`` grid spacings."""
    width = config.edge_width * min(config.spacing)
    mask = torch.zeros(torch.broadcast_shapes(x.shape, y.shape), dtype=x.dtype)
    for cx, cy, r in config.circles:
        distance = torch.sqrt((x - cx) ** 2 + (y - cy) ** 2) - r
        mask = torch.maximum(mask, 0.5 * (1 - torch.tanh(2 * distance / width)))
    return mask
