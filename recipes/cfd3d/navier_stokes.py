"""Pseudo-spectral solver for 3-D incompressible Navier–Stokes in velocity form.

On the periodic unit box [0, 1)³, nondimensional (lengths in box sides; 1/ν is the Reynolds
number of a unit velocity across the box)::

    ∂u/∂t = P[u × ω] + ν Δu + f,    ω = ∇ × u,    ∇·u = 0,

where P is the Leray projection onto divergence-free fields: it removes the pressure gradient
together with ∇(|u|²/2), the difference between u × ω and -(u·∇)u.

Layout: ``u[..., c, i, j, k]`` is component c (0, 1, 2 = x, y, z) of the velocity at
(x_i, y_j, z_k) = (i, j, k) / N, with x along dim -3 (D), y along dim -2 (H) and z along dim -1
(W). Fields are batched over trajectories as ``(B, 3, N, N, N)``; the state is held as the
``rfftn`` coefficients of the last three dims, ``(B, 3, N, N, N//2 + 1)`` complex.

NOTE [Dealiasing in 3-D]
As in 2-D (NOTE [Dealiasing] in ``recipes/cfd/navier_stokes.py``), Orszag's 2/3 rule: only
integer wavenumbers with 3|n_x|, 3|n_y|, 3|n_z| < N are kept. Every entry point projects its
input onto these modes (and onto divergence-free fields), and the nonlinear term is truncated
to them, so the solver integrates the Galerkin-truncated system. The nonlinear term is taken in
rotational form, u × ω: on truncated inputs the products alias only onto discarded modes, so
after truncation and projection it equals the divergence form -P[∇·(u ⊗ u)] exactly; it needs
three products instead of six and the same nine transforms (six inverse: u and ω; three
forward: u × ω). The truncated system conserves energy: the nonlinear term adds none.

NOTE [Time stepping in 3-D]
Integrating-factor RK4, as in 2-D (NOTE [Time stepping] there): viscosity is integrated exactly
through e^{-ν|k|²t}, the nonlinear term and the forcing by classic RK4. A flow whose nonlinear
term is a gradient (a Beltrami / ABC flow, curl u = λu) therefore decays exactly as
e^{-ν|k|²t} up to round-off. RK4 is stable for imaginary eigenvalues up to |λ| dt ≤ 2√2, and
advective eigenvalues are bounded by (max|u| + max|v| + max|w|) k_c with k_c ≈ 2πN/3, so the
CFL number dt (max|u| + max|v| + max|w|) N must stay below ≈1.35; ``SolverConfig.max_cfl``
(default 1.0) keeps a margin and :meth:`NavierStokes3d.advance` refuses a step that breaks it.

NOTE [Band forcing at constant power]
``forcing="band"`` drives the modes with 0 < |n| ≤ n_f (``forcing_wavenumber``) along
themselves, f̂ = ε / (2 E_f) û, where E_f is the kinetic energy in those modes: the power
injected is exactly ε (``forcing_power``) at every instant. This is the dataset's flow (forced,
statistically stationary turbulence), chosen over decaying turbulence because
- after a spin-up every recorded pair comes from the same statistics, so a one-step model is
  learnt and judged on one map rather than on a transient that dominates the early pairs (as
  the 2-D recipe's data showed, NOTES.md);
- the mean dissipation equals ε, so the Kolmogorov scale η = (ν³/ε)^{1/4}, and with it the
  resolution a configuration needs (k_max η ≥ 1, :attr:`SolverConfig.resolved_scales`), is
  known before running;
- it is isotropic and local in Fourier space: a few scalars per trajectory (E_f, one sum over
  the sharded modes) are all that crosses ranks.
A flow with no energy in the band is not forced (f = 0 where E_f = 0). ``forcing="none"``:
decaying flow, used by the validation tests.

NOTE [The solver on ShardTensors]
The time stepping is torch operations only, and the same code runs on a plain tensor or on a
ShardTensor sharded along any of D, H, W: ``rfftn`` / ``irfftn`` over the three spatial dims
are shardsci's distributed FFT (all-to-all transposes; the inverse returns the input's
layout), products of components are local, and the CFL maximum and the band energy are
ShardTensor reductions (one all-reduce of a few scalars each). Two things need to know which
block a rank holds, and read it from the layout, never from a whole field: the Fourier
multipliers (``spectral.py``, NOTE [Multipliers have the layout of the modes they multiply]),
and the random initial field (:func:`random_velocity`), evaluated block by block from a few
low Fourier modes drawn identically on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from shardsci import ShardTensor, ShardTensorSpec
from shardsci.recipes.cfd3d.spectral import SPATIAL_DIMS, SpectralGrid, cross, vector_components

SOLVER_VERSION = "shardsci-ns3d-ifrk4-v1"
"""Changes whenever the discretisation changes, so stored data can be told apart."""

DOMAIN_LENGTH = 1.0
"""Side of the periodic box, in box units."""

Forcing = Literal["band", "none"]
Precision = Literal["float32", "float64"]


class UnstableTimeStepError(ValueError):
    """The time step breaks the advective CFL limit for the current flow."""


@dataclass(frozen=True)
class SolverConfig:
    """Physics, discretisation and random initial condition of one family of trajectories."""

    resolution: int = 32
    """Grid points per side, N; the grid spacing is 1 / N box units."""
    viscosity: float = 5e-3
    """Kinematic viscosity ν, box² per unit time. With the default forcing the Kolmogorov scale
    is η = (ν³/ε)^{1/4} = 0.019 and k_max η = 1.2 at N = 32 (:attr:`resolved_scales`)."""
    dt: float = 2.5e-3
    """Time step, in time units. Only advection limits it (see ``max_cfl``): the default flow
    at N = 32 stays below CFL 0.52 (the default dataset); halve dt when N doubles."""
    forcing: Forcing = "band"
    """``"band"``: constant-power forcing of the modes 0 < |n| ≤ ``forcing_wavenumber`` (NOTE
    [Band forcing at constant power]); ``"none"``: decaying flow."""
    forcing_power: float = 1.0
    """ε, the power injected per unit mass (box² per unit time³); the mean dissipation rate."""
    forcing_wavenumber: float = 2.0
    """n_f: modes with integer wavevector n, 0 < |n| ≤ n_f, are forced."""
    seed: int = 0
    """Seed of the ``torch.Generator`` that draws the random initial velocity."""
    ic_peak_wavenumber: float = 2.0
    """n_p: the initial energy spectrum is E(n) ∝ n⁴ exp(-2 (n / n_p)²)."""
    ic_max_wavenumber: int = 4
    """n_ic: the initial field holds only modes with |n| ≤ n_ic, so it is the same field at
    every resolution N > 3 n_ic (and is drawn the same way on any mesh)."""
    ic_rms: float = 0.65
    """Root-mean-square velocity component √(⟨|u|²⟩/3) of the initial field, exactly (box per
    unit time); the default is that of the band-forced flow once statistically stationary."""
    max_cfl: float = 1.0
    """Largest CFL number dt (max|u| + max|v| + max|w|) N accepted; RK4 is unstable above
    ≈1.35."""
    precision: Precision = "float64"
    """Floating-point precision of the integration."""

    def __post_init__(self) -> None:
        positive = {
            "viscosity": self.viscosity,
            "dt": self.dt,
            "forcing_power": self.forcing_power,
            "forcing_wavenumber": self.forcing_wavenumber,
            "ic_peak_wavenumber": self.ic_peak_wavenumber,
            "ic_rms": self.ic_rms,
            "max_cfl": self.max_cfl,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"SolverConfig.{name} must be > 0, got {value!r}")
        if self.resolution < 4:
            raise ValueError(f"SolverConfig.resolution must be >= 4, got {self.resolution!r}")
        if self.forcing not in ("band", "none"):
            raise ValueError(f"SolverConfig.forcing must be 'band' or 'none', got {self.forcing!r}")
        kept = self.resolution / 3
        if not 1 <= self.ic_max_wavenumber < kept:
            raise ValueError(
                f"SolverConfig.ic_max_wavenumber must be in [1, N/3) = [1, {kept:.1f}) to "
                f"survive dealiasing, got {self.ic_max_wavenumber!r}"
            )
        if self.forcing == "band" and not 1 <= self.forcing_wavenumber < kept:
            raise ValueError(
                f"SolverConfig.forcing_wavenumber must be in [1, N/3) = [1, {kept:.1f}) to "
                f"force kept modes, got {self.forcing_wavenumber!r}"
            )
        if self.precision not in ("float32", "float64"):
            raise ValueError(
                f"SolverConfig.precision must be 'float32' or 'float64', got {self.precision!r}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        """Real dtype of physical fields."""
        return torch.float64 if self.precision == "float64" else torch.float32

    @property
    def resolved_scales(self) -> float:
        """k_max η: the largest kept angular wavenumber 2π⌈N/3 - 1⌉ times the Kolmogorov scale
        (ν³/ε)^{1/4} of the band-forced flow; ≳ 1 resolves the dissipation range."""
        k_max = 2 * math.pi * math.ceil(self.resolution / 3 - 1) / DOMAIN_LENGTH
        return k_max * (self.viscosity**3 / self.forcing_power) ** 0.25


def kinetic_energy(velocity: torch.Tensor) -> torch.Tensor:
    """½⟨|u|²⟩, the mean kinetic energy of ``velocity`` ``(B, 3, N, N, N)``, shape ``(B,)``."""
    return 0.5 * (velocity**2).sum(-4).mean(dim=SPATIAL_DIMS)


def grid_coordinates(
    n: int, dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Coordinates ``(x, y, z)`` of an ``n³`` grid in box units, shapes ``(n, 1, 1)``,
    ``(1, n, 1)`` and ``(1, 1, n)`` (they broadcast to the grid)."""
    axis = torch.arange(n, dtype=dtype, device=device) * (DOMAIN_LENGTH / n)
    return axis.reshape(n, 1, 1), axis.reshape(1, n, 1), axis.reshape(1, 1, n)


def random_velocity(
    config: SolverConfig,
    n_fields: int,
    generator: torch.Generator,
    layout: ShardTensorSpec | None = None,
) -> torch.Tensor:
    """Draw random divergence-free velocity fields with energy spectrum ∝ n⁴ e^{-2(n/n_p)²}.

    The field holds only the modes with |n| ≤ n_ic (``config.ic_max_wavenumber``): their
    coefficients, ``(3, 2n_ic+1, 2n_ic+1, 2n_ic+1)`` per field, are drawn on the CPU from
    ``generator`` one field at a time, made Hermitian and divergence-free, and scaled so that
    the root-mean-square velocity component √(⟨|u|²⟩/3) is exactly ``config.ic_rms``. So field
    ``i`` is the same whatever the batching, the device, the resolution (up to the grid it is
    sampled on) and the layout. Each rank evaluates the modes on its own block only (three
    small contractions, one per spatial dim), with no communication: no rank holds more than
    its block.

    Parameters
    ----------
    config : SolverConfig
        Supplies N, the spectrum, n_ic, the RMS and the precision.
    n_fields : int
        Number of fields B to draw.
    generator : torch.Generator
        A CPU generator; its state advances by ``B · 6 (2n_ic+1)³`` normal draws on every rank.
    layout : ShardTensorSpec, optional
        The layout of the result, of shape ``(B, 3, N, N, N)``; a plain tensor if omitted.

    Returns
    -------
    torch.Tensor
        Velocity ``(B, 3, N, N, N)``, a ShardTensor laid out as ``layout`` if given.
    """
    n = config.resolution
    shape = (n_fields, 3, n, n, n)
    if layout is not None and tuple(layout.shape) != shape:
        raise ValueError(f"layout is for shape {tuple(layout.shape)}, expected {shape}")
    modes = torch.stack([_random_modes(config, generator) for _ in range(n_fields)])
    if layout is None:
        return _evaluate_modes(modes, config, (0,) * 5, shape)
    local = _evaluate_modes(modes, config, layout.local_offsets(), layout.local_shape())
    return ShardTensor(local, layout.with_dtype(local.dtype))


def _random_modes(config: SolverConfig, generator: torch.Generator) -> torch.Tensor:
    """Fourier coefficients ``(3, M, M, M)``, M = 2 n_ic + 1, of one random field; entry
    ``[c, a, b, d]`` is mode n = (a, b, d) - n_ic of component c."""
    dtype = config.torch_dtype
    top = config.ic_max_wavenumber
    integers = torch.arange(-top, top + 1, dtype=dtype)
    n = torch.stack(torch.meshgrid(integers, integers, integers, indexing="ij"))
    n2 = (n**2).sum(0)
    parts = torch.randn(2, *n.shape, generator=generator, dtype=dtype)
    modes = torch.complex(parts[0], parts[1])
    modes = (modes + modes.flip(-3, -2, -1).conj()) / 2  # Hermitian: a real field
    modes = modes - n * ((n * modes).sum(0) / torch.where(n2 == 0, 1.0, n2))
    magnitude = n2.sqrt()
    # Per-mode variance E(n) / n²: amplitude n e^{-(n/n_p)²}, inside the sphere n ≤ n_ic.
    amplitude = magnitude * torch.exp(-((magnitude / config.ic_peak_wavenumber) ** 2))
    modes = modes * torch.where(magnitude <= top, amplitude, 0.0)
    # ⟨|u|²⟩ = Σ|û_n|² = 3 ic_rms².
    return modes * (config.ic_rms * math.sqrt(3) / modes.abs().pow(2).sum().sqrt())


def _evaluate_modes(
    modes: torch.Tensor, config: SolverConfig, offsets: Sequence[int], shape: Sequence[int]
) -> torch.Tensor:
    """The block of ``shape`` at ``offsets`` of the fields Σ_n û_n e^{2πi n·x}, ``modes``
    ``(B, 3, M, M, M)``: one contraction per spatial dim, the block's shortest first, so the
    largest intermediate, M times the block's two shortest extents, stays below the block
    wherever its longest extent exceeds M."""
    n, dtype = config.resolution, config.torch_dtype
    top = config.ic_max_wavenumber
    modes = modes[offsets[0] : offsets[0] + shape[0], offsets[1] : offsets[1] + shape[1]]
    integers = torch.arange(-top, top + 1, dtype=dtype)

    def phases(dim: int) -> torch.Tensor:
        """e^{2πi n x} for the block's cells along ``dim``, ``(M, cells)``."""
        cells = torch.arange(offsets[dim], offsets[dim] + shape[dim], dtype=dtype)
        angle = (2 * math.pi / n) * integers[:, None] * cells[None, :]
        return torch.polar(torch.ones_like(angle), angle)

    field, dims = modes, "xyz"
    for dim in sorted((2, 3, 4), key=lambda d: shape[d]):
        mode, cell = "xyz"[dim - 2], "XYZ"[dim - 2]
        contracted = dims.replace(mode, cell)
        field = torch.einsum(f"bc{dims},{mode}{cell}->bc{contracted}", field, phases(dim))
        dims = contracted
    return field.real.contiguous()


class NavierStokes3d:
    """Integrator of 3-D incompressible Navier–Stokes on the periodic unit box.

    Fields may be plain tensors on any device or ShardTensors sharded along their spatial dims
    (NOTE [The solver on ShardTensors]); results have the input's layout.

    Parameters
    ----------
    config : SolverConfig
        Physics and discretisation.

    Examples
    --------
    >>> config = SolverConfig(resolution=32)
    >>> solver = NavierStokes3d(config)
    >>> u0 = random_velocity(config, 2, torch.Generator().manual_seed(config.seed))
    >>> u1 = solver.advance(u0, n_steps=10)  # (2, 3, 32, 32, 32), time 10 * config.dt later
    """

    def __init__(self, config: SolverConfig) -> None:
        self.config = config

    # ------------------------------------------------------------------ diagnostics
    def tendency(self, velocity: torch.Tensor) -> torch.Tensor:
        """∂u/∂t of ``velocity`` ``(B, 3, N, N, N)``: P[u × ω] + νΔu + f, after projecting
        it onto the dealiased, divergence-free fields."""
        u_hat, grid = self._to_spectral(velocity)
        viscous = grid.scale(u_hat, sum(k_i**2 for k_i in grid.wavevector) * -self.config.viscosity)
        return self._to_physical(self._explicit_rhs(u_hat, grid) + viscous)

    def vorticity(self, velocity: torch.Tensor) -> torch.Tensor:
        """ω = ∇ × u of ``velocity`` ``(B, 3, N, N, N)``, same shape."""
        u_hat, grid = self._to_spectral(velocity, project=False)
        return self._to_physical(torch.cat(grid.curl(u_hat), dim=1))

    def divergence(self, velocity: torch.Tensor) -> torch.Tensor:
        """∇·u of ``velocity`` ``(B, 3, N, N, N)`` (spectral derivative), ``(B, N, N, N)``."""
        u_hat, grid = self._to_spectral(velocity, project=False)
        return self._to_physical(grid.divergence(u_hat))[:, 0]

    def cfl(self, velocity: torch.Tensor) -> float:
        """Largest CFL number dt (max|u| + max|v| + max|w|) N over the batch ``velocity``."""
        speed = velocity.abs().amax(dim=SPATIAL_DIMS).sum(-1)
        return float(speed.max()) * self.config.dt * self.config.resolution

    def check_cfl(self, velocity: torch.Tensor) -> None:
        """Raise :class:`UnstableTimeStepError` if ``velocity`` breaks ``config.max_cfl``."""
        cfl = self.cfl(velocity)
        config = self.config
        if not math.isfinite(cfl):
            raise UnstableTimeStepError(
                f"the flow is no longer finite with dt={config.dt:g} at resolution "
                f"{config.resolution}: the integration blew up; lower dt"
            )
        if cfl > config.max_cfl:
            safe_dt = config.dt * config.max_cfl / cfl
            raise UnstableTimeStepError(
                f"dt={config.dt:g} gives CFL number {cfl:.3g} > max_cfl={config.max_cfl:g} at "
                f"resolution {config.resolution}; use dt <= {safe_dt:.3g} or a slower flow "
                f"(ic_rms, forcing_power)"
            )

    # ------------------------------------------------------------------ integration
    def advance(self, velocity: torch.Tensor, n_steps: int) -> torch.Tensor:
        """Integrate ``velocity`` ``(B, 3, N, N, N)`` over ``n_steps`` steps of ``config.dt``.

        The input is projected onto the dealiased, divergence-free fields (NOTE [Dealiasing in
        3-D]). The CFL number is checked before the first step, so a too-large ``dt`` is
        refused before any work, and after the last, so a flow that sped up (or blew up) in
        between cannot pass unnoticed.
        """
        if n_steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps!r}")
        self.check_cfl(velocity)
        u_hat, grid = self._to_spectral(velocity)
        for _ in range(n_steps):
            u_hat = self._step(u_hat, grid)
        velocity = self._to_physical(u_hat)
        self.check_cfl(velocity)
        return velocity

    def snapshots(
        self, velocity: torch.Tensor, n_snapshots: int, record_every: int
    ) -> Iterator[torch.Tensor]:
        """Yield ``n_snapshots`` fields ``(B, 3, N, N, N)``: ``velocity`` projected (NOTE
        [Dealiasing in 3-D]), then the flow every ``record_every`` steps."""
        if n_snapshots < 1 or record_every < 1:
            raise ValueError(
                f"n_snapshots and record_every must be >= 1, got {n_snapshots!r}, {record_every!r}"
            )
        velocity = self.advance(velocity, 0)
        yield velocity
        for _ in range(n_snapshots - 1):
            velocity = self.advance(velocity, record_every)
            yield velocity

    def _step(self, u: torch.Tensor, grid: SpectralGrid) -> torch.Tensor:
        """One integrating-factor RK4 step of the spectral state (NOTE [Time stepping in 3-D]).

        With E = e^{-ν|k|² dt/2}: k1 = N(u), k2 = N(E(u + dt/2 k1)), k3 = N(Eu + dt/2 k2),
        k4 = N(E(Eu + dt k3)), u' = E(E(u + dt/6 k1) + dt/3 (k2 + k3)) + dt/6 k4."""
        dt = self.config.dt

        def decayed(field: torch.Tensor) -> torch.Tensor:
            return grid.scale(field, grid.viscous_decay)

        k1 = self._explicit_rhs(u, grid)
        k2 = self._explicit_rhs(decayed(u + (dt / 2) * k1), grid)
        u_half = decayed(u)
        k3 = self._explicit_rhs(u_half + (dt / 2) * k2, grid)
        k4 = self._explicit_rhs(decayed(u_half + dt * k3), grid)
        return decayed(decayed(u + (dt / 6) * k1) + (dt / 3) * (k2 + k3)) + (dt / 6) * k4

    def _explicit_rhs(self, u_hat: torch.Tensor, grid: SpectralGrid) -> torch.Tensor:
        """Spectral P[u × ω] + f, the part of the right-hand side stepped explicitly."""
        fields = self._to_physical(torch.cat([u_hat, *grid.curl(u_hat)], dim=1))
        u, omega = vector_components(fields[:, :3]), vector_components(fields[:, 3:])
        lamb_hat = torch.fft.rfftn(cross(u, omega), dim=SPATIAL_DIMS)
        rhs = grid.project(grid.scale(lamb_hat, grid.dealias))
        if self.config.forcing == "band":
            rhs = rhs + self._forcing_hat(u_hat, grid)
        return rhs

    def _forcing_hat(self, u_hat: torch.Tensor, grid: SpectralGrid) -> torch.Tensor:
        """ε / (2 E_f) û on the forced modes (NOTE [Band forcing at constant power])."""
        band_energy = grid.energy(u_hat, band=True)
        gain = torch.where(band_energy > 0, self.config.forcing_power / (2 * band_energy), 0.0)
        # One 0-d gain per trajectory: a (B, 1, 1, 1, 1) factor would need a sharding
        # propagation (NOTE [Multipliers have the layout of the modes they multiply]).
        forced = grid.scale(u_hat, grid.forced)
        return torch.cat([forced[b : b + 1] * gain[b] for b in range(forced.shape[0])])

    # ------------------------------------------------------------------ transforms
    @property
    def _grid_shape(self) -> tuple[int, int, int]:
        n = self.config.resolution
        return (n, n, n)

    def _to_spectral(
        self, velocity: torch.Tensor, project: bool = True
    ) -> tuple[torch.Tensor, SpectralGrid]:
        """Dealiased (and projected) ``rfftn`` of ``velocity`` ``(B, 3, N, N, N)``, and the
        multipliers laid out like it."""
        n = self.config.resolution
        if velocity.ndim != 5 or tuple(velocity.shape[1:]) != (3, n, n, n):
            raise ValueError(
                f"expected a velocity of shape (B, 3, {n}, {n}, {n}), got {tuple(velocity.shape)}"
            )
        config = self.config
        u_hat = torch.fft.rfftn(velocity.to(config.torch_dtype), dim=SPATIAL_DIMS)
        grid = SpectralGrid.like(
            u_hat, n, DOMAIN_LENGTH, config.viscosity, config.dt, config.forcing_wavenumber
        )
        u_hat = grid.scale(u_hat, grid.dealias)
        return (grid.project(u_hat) if project else u_hat), grid

    def _to_physical(self, field_hat: torch.Tensor) -> torch.Tensor:
        """Inverse of ``rfftn`` for spectral fields ``(..., N, N, N//2+1)``."""
        return torch.fft.irfftn(field_hat, s=self._grid_shape, dim=SPATIAL_DIMS)
