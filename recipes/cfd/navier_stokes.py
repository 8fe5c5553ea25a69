"""Pseudo-spectral solver for 2-D incompressible Navier–Stokes in vorticity form.

On the periodic unit box [0, 1)², nondimensional (lengths in box sides; 1/ν is the Reynolds
number of a unit velocity across the box)::

    ∂ω/∂t + u·∇ω = ν Δω − μ ω + f,    u = ∇⊥ψ = (∂ψ/∂y, −∂ψ/∂x),    Δψ = −ω.

Layout: ``omega[..., i, j]`` is ω(x_i, y_j) with x_i = i/N along dim -2 and y_j = j/N along
dim -1 (``"ij"`` indexing); fields are batched over trajectories as ``(B, N, N)`` and the
state is held as its ``rfft2`` coefficients, ``(B, N, N//2 + 1)`` complex.

NOTE [Dealiasing]
The quadratic term is dealiased with Orszag's 2/3 rule: only integer wavenumbers with
3|n_x| < N and 3|n_y| < N are kept. Every entry point projects its input onto these modes
and the advection term is truncated to them, so the solver integrates the Galerkin-truncated
system and aliasing never reaches a kept mode.

NOTE [Time stepping]
Integrating-factor RK4: the linear part L = −ν|k|² − μ (diagonal in Fourier space) is
integrated exactly through e^{Lt}, advection and forcing by classic fourth-order Runge–Kutta.
Diffusion and drag therefore set no time-step limit, and a flow whose advection vanishes
(Taylor–Green) decays exactly up to round-off. RK4 is stable for imaginary eigenvalues up to
|λ| dt ≤ 2√2; advective eigenvalues are bounded by (max|u| + max|v|) k_c with k_c ≈ 2πN/3,
so the CFL number dt (max|u| + max|v|) N must stay below ≈1.35. ``SolverConfig.max_cfl``
(default 1.0) keeps a margin; :meth:`NavierStokes2d.advance` refuses a step that breaks it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch

SOLVER_VERSION = "shardsci-ns2d-ifrk4-v1"
"""Changes whenever the discretisation changes, so stored data can be told apart."""

DOMAIN_LENGTH = 1.0
"""Side of the periodic box, in box units."""

FNO_FORCING_AMPLITUDE = 0.1
"""Amplitude of the FNO benchmark's forcing, 0.1 (sin(2π(x+y)) + cos(2π(x+y)))."""

Forcing = Literal["fno", "kolmogorov", "none"]
Precision = Literal["float32", "float64"]


class UnstableTimeStepError(ValueError):
    """The time step breaks the advective CFL limit for the current flow."""


@dataclass(frozen=True)
class SolverConfig:
    """Physics, discretisation and random initial condition of one family of trajectories."""

    resolution: int = 128
    """Grid points per side, N; the grid spacing is 1 / N box units."""
    viscosity: float = 1e-3
    """Kinematic viscosity ν, box² per unit time (1/ν is the box Reynolds number)."""
    dt: float = 0.025
    """Time step, in time units. Only advection limits it (see ``max_cfl``); the default suits
    the default FNO flow at N = 128 over ~10 time units and gives a time error of ~1e-10."""
    forcing: Forcing = "fno"
    """``"fno"``: 0.1 (sin 2π(x+y) + cos 2π(x+y)), the FNO benchmark's; ``"kolmogorov"``:
    A sin(2π m y), see ``kolmogorov_*``; ``"none"``: decaying turbulence."""
    kolmogorov_amplitude: float = 1.0
    """A, amplitude of the Kolmogorov vorticity forcing, vorticity per unit time."""
    kolmogorov_wavenumber: int = 4
    """m, integer wavenumber of the Kolmogorov forcing (m periods across the box)."""
    drag: float = 0.0
    """Linear drag coefficient μ ≥ 0 (term -μω), per unit time; applies to every forcing."""
    seed: int = 0
    """Seed of the ``torch.Generator`` that draws the random initial vorticity."""
    ic_alpha: float = 2.5
    """Exponent α of the initial-condition covariance σ² (-Δ + τ²)^(-α); larger is smoother."""
    ic_tau: float = 7.0
    """Inverse length scale τ of the initial-condition covariance, per box unit."""
    ic_rms: float = 0.26
    """Expected root-mean-square initial vorticity, per unit time; it fixes σ. The default is
    what the FNO benchmark's σ = τ^(α-1) gives for α = 2.5, τ = 7."""
    max_cfl: float = 1.0
    """Largest CFL number dt (max|u| + max|v|) N accepted; RK4 is unstable above ≈1.35."""
    precision: Precision = "float64"
    """Floating-point precision of the integration."""

    def __post_init__(self) -> None:
        positive = {
            "viscosity": self.viscosity,
            "dt": self.dt,
            "ic_tau": self.ic_tau,
            "ic_rms": self.ic_rms,
            "max_cfl": self.max_cfl,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"SolverConfig.{name} must be > 0, got {value!r}")
        if self.resolution < 4:
            raise ValueError(f"SolverConfig.resolution must be >= 4, got {self.resolution!r}")
        if self.drag < 0:
            raise ValueError(f"SolverConfig.drag must be >= 0, got {self.drag!r}")
        if self.forcing not in ("fno", "kolmogorov", "none"):
            raise ValueError(
                f"SolverConfig.forcing must be 'fno', 'kolmogorov' or 'none', got {self.forcing!r}"
            )
        if (
            self.forcing == "kolmogorov"
            and not 0 < 3 * self.kolmogorov_wavenumber < self.resolution
        ):
            raise ValueError(
                f"SolverConfig.kolmogorov_wavenumber must be in (0, N/3) = (0, "
                f"{self.resolution / 3:.1f}) to survive dealiasing, got {self.kolmogorov_wavenumber!r}"
            )
        if self.precision not in ("float32", "float64"):
            raise ValueError(
                f"SolverConfig.precision must be 'float32' or 'float64', got {self.precision!r}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        """Real dtype of physical fields."""
        return torch.float64 if self.precision == "float64" else torch.float32


@dataclass(frozen=True)
class SpectralGrid:
    """Fourier multipliers of an N × N grid, shaped to broadcast against ``(B, N, N//2+1)``.

    Attributes
    ----------
    kx, ky : torch.Tensor
        Angular wavenumbers 2π n, shapes ``(N, 1)`` and ``(1, N//2+1)``, per box unit.
    laplacian : torch.Tensor
        Symbol of Δ, ``-(kx² + ky²)``, shape ``(N, N//2+1)``.
    inverse_laplacian : torch.Tensor
        Symbol of Δ⁻¹ on zero-mean fields (0 at k = 0), shape ``(N, N//2+1)``.
    dealias : torch.Tensor
        1 on the modes kept by the 2/3 rule, 0 elsewhere, shape ``(N, N//2+1)``.
    """

    kx: torch.Tensor
    ky: torch.Tensor
    laplacian: torch.Tensor
    inverse_laplacian: torch.Tensor
    dealias: torch.Tensor

    @classmethod
    def build(cls, n: int, dtype: torch.dtype, device: torch.device | str) -> SpectralGrid:
        """Multipliers for an ``n × n`` grid of real ``dtype`` on ``device``."""
        nx = torch.fft.fftfreq(n, 1.0 / n, dtype=dtype, device=device)[:, None]
        ny = torch.fft.rfftfreq(n, 1.0 / n, dtype=dtype, device=device)[None, :]
        kx, ky = 2 * math.pi * nx / DOMAIN_LENGTH, 2 * math.pi * ny / DOMAIN_LENGTH
        laplacian = -(kx**2 + ky**2)
        inverse_laplacian = torch.where(laplacian == 0, 0.0, 1.0 / laplacian)
        dealias = ((3 * nx.abs() < n) & (3 * ny.abs() < n)).to(dtype)
        return cls(kx, ky, laplacian, inverse_laplacian, dealias)


def grid_coordinates(
    n: int, dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical coordinates ``(x, y)`` of an ``n × n`` grid, each ``(n, n)``, in box units."""
    axis = torch.arange(n, dtype=dtype, device=device) * (DOMAIN_LENGTH / n)
    x, y = torch.meshgrid(axis, axis, indexing="ij")
    return x, y


def forcing_field(config: SolverConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """Time-independent vorticity forcing f of ``config``, shape ``(N, N)``, vorticity per time."""
    x, y = grid_coordinates(config.resolution, config.torch_dtype, device)
    if config.forcing == "fno":
        phase = 2 * math.pi * (x + y)
        return FNO_FORCING_AMPLITUDE * (torch.sin(phase) + torch.cos(phase))
    if config.forcing == "kolmogorov":
        m = config.kolmogorov_wavenumber
        return config.kolmogorov_amplitude * torch.sin(2 * math.pi * m * y)
    return torch.zeros_like(x)


def random_vorticity(
    config: SolverConfig, n_fields: int, generator: torch.Generator
) -> torch.Tensor:
    """Draw zero-mean Gaussian random vorticity fields with covariance σ² (-Δ + τ²)^(-α).

    White noise is drawn on the CPU from ``generator`` one field at a time, so field ``i`` is
    the same whatever the batching and device; σ is set so the expected mean square over the
    modes kept by dealiasing is ``config.ic_rms²``, independent of the resolution.

    Parameters
    ----------
    config : SolverConfig
        Supplies N, α, τ, the RMS and the precision.
    n_fields : int
        Number of fields B to draw.
    generator : torch.Generator
        A CPU generator; its state advances by ``B · N²`` normal draws.

    Returns
    -------
    torch.Tensor
        Vorticity ``(B, N, N)`` on the CPU, per unit time.
    """
    n = config.resolution
    grid = SpectralGrid.build(n, config.torch_dtype, "cpu")
    spectrum = (config.ic_tau**2 - grid.laplacian) ** (-config.ic_alpha) * grid.dealias
    spectrum[0, 0] = 0.0
    # rfft2 keeps half the modes: columns 0 < j < N/2 also stand for their conjugates at -j.
    mirrored = torch.ones_like(spectrum)
    mirrored[:, 1 : (n + 1) // 2] = 2.0
    sigma = config.ic_rms / torch.sqrt((mirrored * spectrum).sum())
    noise = torch.stack(
        [torch.randn(n, n, generator=generator, dtype=config.torch_dtype) for _ in range(n_fields)]
    )
    coefficients = n * sigma * torch.sqrt(spectrum) * torch.fft.rfft2(noise)
    return torch.fft.irfft2(coefficients, s=(n, n))


class NavierStokes2d:
    """Integrator of 2-D incompressible Navier–Stokes on the periodic unit box.

    Parameters
    ----------
    config : SolverConfig
        Physics and discretisation.
    device : torch.device or str
        Where the fields live; inputs must be on this device.

    Examples
    --------
    >>> config = SolverConfig(resolution=64)
    >>> solver = NavierStokes2d(config)
    >>> omega0 = random_vorticity(config, 4, torch.Generator().manual_seed(config.seed))
    >>> omega1 = solver.advance(omega0, n_steps=100)  # (4, 64, 64), time 100 * config.dt later
    """

    def __init__(self, config: SolverConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.grid = SpectralGrid.build(config.resolution, config.torch_dtype, device)
        self._forcing_hat = self._to_spectral(forcing_field(config, device))
        linear = config.viscosity * self.grid.laplacian - config.drag
        self._half_step_decay = torch.exp(linear * (config.dt / 2))
        self._step_decay = self._half_step_decay**2
        self._ikx, self._iky = 1j * self.grid.kx, 1j * self.grid.ky
        # u = ∂ψ/∂y and v = -∂ψ/∂x with ψ = -Δ⁻¹ω, as multipliers of ω.
        self._u_from_w = -self._iky * self.grid.inverse_laplacian
        self._v_from_w = self._ikx * self.grid.inverse_laplacian

    def velocity(self, omega: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Velocity ``(u, v)`` of vorticity ``omega`` ``(..., N, N)``, each ``(..., N, N)``."""
        u_hat, v_hat = self._velocity_hat(self._to_spectral(omega))
        return self._to_physical(u_hat), self._to_physical(v_hat)

    def advection(self, omega: torch.Tensor) -> torch.Tensor:
        """Dealiased advection term u·∇ω of ``omega`` ``(..., N, N)``, vorticity per time."""
        return self._to_physical(self._advection_hat(self._to_spectral(omega)))

    def cfl(self, omega: torch.Tensor) -> float:
        """Largest CFL number dt (max|u| + max|v|) N over the batch ``omega`` ``(..., N, N)``."""
        u, v = self.velocity(omega)
        speed = u.abs().amax(dim=(-2, -1)) + v.abs().amax(dim=(-2, -1))
        return float(speed.max()) * self.config.dt * self.config.resolution

    def check_cfl(self, omega: torch.Tensor) -> None:
        """Raise :class:`UnstableTimeStepError` if ``omega`` breaks ``config.max_cfl``."""
        cfl = self.cfl(omega)
        if not math.isfinite(cfl):
            raise UnstableTimeStepError(
                f"the flow is no longer finite with dt={self.config.dt:g} at resolution "
                f"{self.config.resolution}: the integration blew up; lower dt"
            )
        if cfl > self.config.max_cfl:
            safe_dt = self.config.dt * self.config.max_cfl / cfl
            raise UnstableTimeStepError(
                f"dt={self.config.dt:g} gives CFL number {cfl:.3g} > max_cfl="
                f"{self.config.max_cfl:g} at resolution {self.config.resolution}; "
                f"use dt <= {safe_dt:.3g} or a slower flow (ic_rms, forcing)"
            )

    def advance(self, omega: torch.Tensor, n_steps: int) -> torch.Tensor:
        """Integrate ``omega`` ``(..., N, N)`` over ``n_steps`` time steps of ``config.dt``.

        The input is projected onto the dealiased modes (see NOTE [Dealiasing]). The CFL number
        is checked before the first step, so a too-large ``dt`` is refused before any work, and
        after the last, so a flow that sped up (or blew up) in between cannot pass unnoticed.
        """
        if n_steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps!r}")
        self.check_cfl(omega)
        omega_hat = self._to_spectral(omega)
        for _ in range(n_steps):
            omega_hat = self._step(omega_hat)
        omega = self._to_physical(omega_hat)
        self.check_cfl(omega)
        return omega

    def snapshots(
        self, omega: torch.Tensor, n_snapshots: int, record_every: int
    ) -> Iterator[torch.Tensor]:
        """Yield ``n_snapshots`` fields ``(..., N, N)``: ``omega`` itself, then the flow every
        ``record_every`` steps (each interval is one :meth:`advance`)."""
        if n_snapshots < 1 or record_every < 1:
            raise ValueError(
                f"n_snapshots and record_every must be >= 1, got {n_snapshots!r}, {record_every!r}"
            )
        yield omega
        for _ in range(n_snapshots - 1):
            omega = self.advance(omega, record_every)
            yield omega

    def _step(self, w: torch.Tensor) -> torch.Tensor:
        """One integrating-factor RK4 step of the spectral state (NOTE [Time stepping])."""
        dt, e_half, e_full = self.config.dt, self._half_step_decay, self._step_decay
        k1 = self._explicit_rhs(w)
        k2 = self._explicit_rhs(e_half * (w + 0.5 * dt * k1))
        k3 = self._explicit_rhs(e_half * w + 0.5 * dt * k2)
        k4 = self._explicit_rhs(e_full * w + dt * e_half * k3)
        return e_full * w + (dt / 6) * (e_full * k1 + 2 * e_half * (k2 + k3) + k4)

    def _explicit_rhs(self, w_hat: torch.Tensor) -> torch.Tensor:
        """Spectral -u·∇ω + f, the part of the right-hand side stepped explicitly."""
        return self._forcing_hat - self._advection_hat(w_hat)

    def _advection_hat(self, w_hat: torch.Tensor) -> torch.Tensor:
        """Spectral u·∇ω = ∇·(uω) (u is divergence-free) of spectral vorticity
        ``(..., N, N//2+1)``, truncated by the 2/3 rule.

        The flux form needs three inverse transforms and two forward ones, and its mean is
        exactly zero, so mean vorticity is conserved to round-off."""
        u_hat, v_hat = self._velocity_hat(w_hat)
        u, v, w = self._to_physical(torch.stack([u_hat, v_hat, w_hat]))
        flux_x, flux_y = torch.fft.rfft2(torch.stack([u * w, v * w]))
        return self.grid.dealias * (self._ikx * flux_x + self._iky * flux_y)

    def _velocity_hat(self, w_hat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Spectral velocity (∂ψ/∂y, -∂ψ/∂x) with ψ = -Δ⁻¹ω."""
        return self._u_from_w * w_hat, self._v_from_w * w_hat

    def _to_spectral(self, field: torch.Tensor) -> torch.Tensor:
        """Dealiased ``rfft2`` of a physical field ``(..., N, N)``."""
        n = self.config.resolution
        if field.shape[-2:] != (n, n):
            raise ValueError(f"expected a field of shape (..., {n}, {n}), got {tuple(field.shape)}")
        return self.grid.dealias * torch.fft.rfft2(field.to(self.config.torch_dtype))

    def _to_physical(self, field_hat: torch.Tensor) -> torch.Tensor:
        """Inverse of ``rfft2`` for spectral fields ``(..., N, N//2+1)``."""
        n = self.config.resolution
        return torch.fft.irfft2(field_hat, s=(n, n))
