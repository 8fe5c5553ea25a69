"""The 3-D Navier–Stokes solver of the cfd3d recipe: against exact solutions (an ABC flow, the
Taylor–Green vortex's initial tendency and Brachet's enstrophy series), its order in dt, its
conservation laws, and on ShardTensors (slab, pencil, 2x2x2 block; uneven and empty shards)
against one process, with no rank ever holding the whole grid; and its HDF5 dataset, generated
in one process or on several ranks."""

from __future__ import annotations

import math
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import Shard
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type
from torch.utils._pytree import tree_flatten

from shardsci import ShardTensorSpec
from shardsci.data import DataError, GenerateMode
from shardsci.recipes.cfd3d.generate import (
    CREATED_BY,
    DatasetConfig,
    ensure_dataset,
    generate_dataset,
)
from shardsci.recipes.cfd3d.navier_stokes import (
    SOLVER_VERSION,
    NavierStokes3d,
    SolverConfig,
    UnstableTimeStepError,
    grid_coordinates,
    kinetic_energy,
    random_velocity,
)
from shardsci.testing import (
    assert_all_ranks,
    assert_close_all_ranks,
    count_traffic,
    get_mesh,
    run_on_ranks,
)

K = 2 * math.pi  # angular wavenumber of the box's first mode


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


def vector_field(u: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One field ``(1, 3, N, N, N)`` from three broadcastable components."""
    return torch.stack(torch.broadcast_tensors(u, v, w))[None]


def abc_flow(n: int, a: float = 1.0, b: float = 0.7, c: float = 0.4) -> torch.Tensor:
    """The Arnold–Beltrami–Childress flow of wavenumber 2π: ∇ × u = 2π u, so u × ω = 0."""
    x, y, z = grid_coordinates(n)
    return vector_field(
        a * torch.sin(K * z) + c * torch.cos(K * y),
        b * torch.sin(K * x) + a * torch.cos(K * z),
        c * torch.sin(K * y) + b * torch.cos(K * x),
    )


def taylor_green(n: int) -> torch.Tensor:
    """u = (sin kx cos ky cos kz, -cos kx sin ky cos kz, 0), k = 2π (unit amplitude)."""
    x, y, z = grid_coordinates(n)
    return vector_field(
        torch.sin(K * x) * torch.cos(K * y) * torch.cos(K * z),
        -torch.cos(K * x) * torch.sin(K * y) * torch.cos(K * z),
        torch.zeros(()),
    )


def enstrophy(solver: NavierStokes3d, velocity: torch.Tensor) -> float:
    """½⟨|ω|²⟩ of one field."""
    return float(kinetic_energy(solver.vorticity(velocity)))


def test_abc_flow_decays_exactly() -> None:
    """curl u = k u makes u × ω vanish: u(t) = e^{-νk²t} u(0), exactly."""
    config = SolverConfig(
        resolution=8, viscosity=0.01, dt=0.01, forcing="none", ic_max_wavenumber=1
    )
    u0 = abc_flow(8)
    u = NavierStokes3d(config).advance(u0, 100)
    # Measured: 8.5e-16 (integrating-factor RK4 integrates the decay exactly).
    assert relative_error(u, math.exp(-config.viscosity * K**2 * 1.0) * u0) < 1e-13


def test_taylor_green_initial_tendency() -> None:
    """∂u/∂t at t = 0, worked out by hand: -(u·∇)u = -(sin 2kx cos²kz, sin 2ky cos²kz, 0)/2,
    the pressure (cos 2kx + cos 2ky)(2 + cos 2kz)/16 (Brachet et al. 1983), so
    ∂u/∂t = (k/8)(-sin 2kx cos 2kz, -sin 2ky cos 2kz, (cos 2kx + cos 2ky) sin 2kz) - 3νk² u."""
    config = SolverConfig(resolution=16, viscosity=0.01, forcing="none")
    u0 = taylor_green(16)
    x, y, z = grid_coordinates(16)
    expected = (K / 8) * vector_field(
        -torch.sin(2 * K * x) * torch.cos(2 * K * z),
        -torch.sin(2 * K * y) * torch.cos(2 * K * z),
        (torch.cos(2 * K * x) + torch.cos(2 * K * y)) * torch.sin(2 * K * z),
    ) - 3 * config.viscosity * K**2 * u0
    # Measured: 2.3e-15.
    assert relative_error(NavierStokes3d(config).tendency(u0), expected) < 1e-13


def test_taylor_green_enstrophy_grows_as_brachet_series() -> None:
    """Inviscid Taylor–Green: Ω(t) = Ω(0) (1 + (5/48) τ² + O(τ⁴)), τ = kUt (Brachet et al.
    1983). The coefficient, from two short runs extrapolated in τ², checks the nonlinear
    term's vortex stretching against a published number."""
    u0 = taylor_green(16)
    coefficients = []
    for tau in (0.2, 0.4):
        config = SolverConfig(
            resolution=16, viscosity=1e-8, dt=tau / K / 16, forcing="none", ic_max_wavenumber=1
        )
        solver = NavierStokes3d(config)
        growth = enstrophy(solver, solver.advance(u0, 16)) / enstrophy(solver, u0) - 1
        coefficients.append(growth / tau**2)
    extrapolated = (4 * coefficients[0] - coefficients[1]) / 3
    # Measured: 8e-7 relative (the τ⁴ term's τ⁶ remainder and ν = 1e-8).
    assert abs(extrapolated / (5 / 48) - 1) < 1e-5
    assert abs(coefficients[0] / (5 / 48) - 1) > 1e-3  # the τ⁴ term is there to extrapolate


def test_fourth_order_in_time() -> None:
    """A forced random flow at T = 0.16 against dt = T/128: halving dt cuts the error 16-fold."""

    def run(dt: float) -> torch.Tensor:
        config = SolverConfig(
            resolution=8, dt=dt, viscosity=4e-3, ic_rms=0.3, ic_max_wavenumber=2,
            forcing_wavenumber=1.5,
        )  # fmt: skip
        u0 = random_velocity(config, 1, torch.Generator().manual_seed(0))
        return NavierStokes3d(config).advance(u0, round(0.16 / dt))

    reference = run(0.16 / 128)
    coarse, fine = (relative_error(run(0.16 / steps), reference) for steps in (16, 32))
    # Measured: 8.6e-8 and 5.2e-9, ratio 16.8.
    assert coarse < 1e-6
    assert 14 < coarse / fine < 19


def test_divergence_free_and_energy_budget() -> None:
    """The initial field and the flow stay divergence-free to round-off, and the energy
    budget closes exactly: d/dt ½⟨|u|²⟩ = ⟨u·∂u/∂t⟩ = ε - 2νΩ (the truncated nonlinear term
    moves energy between modes but adds none, NOTE [Dealiasing in 3-D])."""
    config = SolverConfig(resolution=16, ic_max_wavenumber=4)
    solver = NavierStokes3d(config)
    u0 = random_velocity(config, 2, torch.Generator().manual_seed(1))
    scale = K * (16 // 3) * float(u0.abs().max())  # |∇u| ≤ k_max max|u|
    for u in (u0, solver.advance(u0, 10)):
        assert float(solver.divergence(u).abs().max()) / scale < 1e-14
        power = (u * solver.tendency(u)).sum(1).mean(dim=(-3, -2, -1))
        dissipation = 2 * config.viscosity * kinetic_energy(solver.vorticity(u))
        # Measured: ≤ 2e-16 against terms of ≈ 0.5.
        torch.testing.assert_close(power, config.forcing_power - dissipation, rtol=0, atol=1e-13)
    unforced = NavierStokes3d(SolverConfig(resolution=16, ic_max_wavenumber=4, forcing="none"))
    power = (u0 * unforced.tendency(u0)).sum(1).mean(dim=(-3, -2, -1))
    dissipation = 2 * config.viscosity * kinetic_energy(unforced.vorticity(u0))
    torch.testing.assert_close(power, -dissipation, rtol=0, atol=1e-13)


def test_random_velocity_is_the_same_field_at_every_resolution_and_batching() -> None:
    coarse_config = SolverConfig(resolution=16, ic_rms=0.4)
    fine_config = SolverConfig(resolution=32, ic_rms=0.4)
    coarse = random_velocity(coarse_config, 3, torch.Generator().manual_seed(5))
    fine = random_velocity(fine_config, 3, torch.Generator().manual_seed(5))
    torch.testing.assert_close(fine[..., ::2, ::2, ::2], coarse, rtol=0, atol=1e-13)
    generator = torch.Generator().manual_seed(5)
    one_by_one = [random_velocity(coarse_config, 1, generator) for _ in range(3)]
    torch.testing.assert_close(torch.cat(one_by_one), coarse, rtol=0, atol=0)
    rms = coarse.pow(2).mean(dim=(1, 2, 3, 4)).sqrt()
    torch.testing.assert_close(rms, torch.full((3,), 0.4, dtype=torch.float64), rtol=1e-13, atol=0)
    assert float(coarse.mean(dim=(-3, -2, -1)).abs().max()) < 1e-15  # no mean flow


def test_cfl_guard_refuses_an_unstable_time_step() -> None:
    config = SolverConfig(resolution=8, dt=0.5, forcing="none", ic_max_wavenumber=1)
    solver = NavierStokes3d(config)
    with pytest.raises(UnstableTimeStepError, match=r"dt=0\.5 gives CFL number"):
        solver.advance(abc_flow(8), 1)
    with pytest.raises(UnstableTimeStepError, match="blew up"):
        solver.advance(torch.full((1, 3, 8, 8, 8), float("nan")), 1)
    with pytest.raises(ValueError, match=r"expected a velocity of shape \(B, 3, 8, 8, 8\)"):
        solver.advance(torch.zeros(3, 8, 8, 8), 1)


@pytest.mark.parametrize(
    "make",
    [
        lambda: SolverConfig(viscosity=0.0),
        lambda: SolverConfig(dt=-1.0),
        lambda: SolverConfig(forcing="spiral"),  # type: ignore[arg-type]
        lambda: SolverConfig(resolution=12, ic_max_wavenumber=4),
        lambda: SolverConfig(resolution=8, forcing_wavenumber=3.0),
        lambda: SolverConfig(precision="float16"),  # type: ignore[arg-type]
    ],
)
def test_invalid_configs_raise(make: object) -> None:
    with pytest.raises(ValueError, match="must be"):
        make()  # type: ignore[operator]


def test_default_flow_is_resolved() -> None:
    assert SolverConfig().resolved_scales >= 1.0


# ---------------------------------------------------------------------------- on ShardTensors
class _WholeGridWatcher(TorchDispatchMode):
    """Records every plain tensor with data that an op returns whose last three dims span the
    whole grid ``(N, N, N)`` or its modes ``(N, N, N//2+1)``. ShardTensor ops are left to the
    subclass (their local ops then come back here, as in ``count_traffic``); the meta and fake
    tensors of sharding propagation hold no data."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.whole = {(n, n, n), (n, n, n // 2 + 1)}
        self.seen: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if (
                isinstance(tensor, torch.Tensor)
                and not tensor.is_meta
                and not isinstance(tensor, FakeTensor)
                and tuple(tensor.shape[-3:]) in self.whole
            ):
                self.seen.append((str(func), tuple(tensor.shape)))
        return out


# No rank's block is (..., 8, 8, 5) or (..., 8, 8, 8), which the watcher would take for the whole
# grid (a false alarm, never a miss).
LAYOUTS = {
    "slab-4r-D-3/0/3/2": ((4,), (Shard(2),), {2: (3, 0, 3, 2)}),
    "slab-2r-W-6/2": ((2,), (Shard(4),), {4: (6, 2)}),
    "pencil-2x2-D5/3-H3/5": ((2, 2), (Shard(2), Shard(3)), {2: (5, 3), 3: (3, 5)}),
    "block-2x2x2-D5/3-H8/0-W3/5": (
        (2, 2, 2),
        (Shard(2), Shard(3), Shard(4)),
        {2: (5, 3), 3: (8, 0), 4: (3, 5)},
    ),
}
N_SHARDED = 8


def _sharded_body(name: str) -> None:
    """One forced step of two random fields on ``LAYOUTS[name]`` against one process."""
    mesh_shape, placements, sizes = LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    n = N_SHARDED
    # 2 n_ic + 1 = 3 modes per dim: no intermediate of the initial field is (8, 8, 5) by chance.
    config = SolverConfig(resolution=n, ic_max_wavenumber=1, forcing_wavenumber=1.5, dt=2e-3)
    layout = ShardTensorSpec.build(mesh, placements, (2, 3, n, n, n), torch.float64, sizes)
    solver = NavierStokes3d(config)
    watcher = _WholeGridWatcher(n)
    with count_traffic() as traffic, watcher:
        u0 = random_velocity(config, 2, torch.Generator().manual_seed(3), layout)
        u1 = solver.advance(u0, 1)
    reference0 = random_velocity(config, 2, torch.Generator().manual_seed(3))
    reference1 = solver.advance(reference0, 1)
    for what, field in (("initial field", u0), ("after one step", u1)):
        assert_all_ranks(
            field.spec.same_layout(layout), f"{name}: {what} laid out as {field.spec}, not {layout}"
        )
    assert_close_all_ranks(u0.full_tensor(), reference0, atol=1e-14, rtol=0, what="initial")
    assert_close_all_ranks(u1.full_tensor(), reference1, atol=1e-13, rtol=0, what="one step")
    # No rank holds the whole grid: no plain tensor spans it, nothing is gathered.
    assert_all_ranks(not watcher.seen, f"{name}: whole-grid tensors {watcher.seen[:3]}")
    allowed = {"c10d::alltoall_base_", "c10d::allreduce_"}
    assert_all_ranks(
        set(traffic.collectives) <= allowed, f"{name}: collectives {dict(traffic.collectives)}"
    )


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sharded_run_matches_one_process(name: str) -> None:
    world = math.prod(LAYOUTS[name][0])
    run_on_ranks(world, _sharded_body, name, timeout_s=300)


# ---------------------------------------------------------------------------- the dataset
def tiny_dataset(**overrides: int) -> DatasetConfig:
    """Three 8³ trajectories of three snapshots, integrated in float64."""
    solver = SolverConfig(
        resolution=8, dt=2e-3, ic_max_wavenumber=2, forcing_wavenumber=1.5, seed=3
    )
    fields = {"n_train": 2, "n_test": 1, "n_snapshots": 3, "record_every": 2, "warmup_steps": 1}
    return DatasetConfig(solver=solver, **{**fields, **overrides})


def test_generated_file_layout(tmp_path: Path) -> None:
    config = tiny_dataset(warmup_steps=0)
    path = generate_dataset(tmp_path / "ns3d.h5", config)
    with h5py.File(path, "r") as file:
        velocity = file["velocity"]
        assert velocity.shape == (3, 3, 3, 8, 8, 8) and velocity.dtype == np.float32
        assert velocity.chunks is None and velocity.attrs["complete"]
        attrs = dict(file.attrs)
        first = velocity[:, 0]
    assert attrs["resolution"] == 8 and attrs["forcing"] == "band" and attrs["seed"] == 3
    assert attrs["record_dt"] == 4e-3 and attrs["solver_version"] == SOLVER_VERSION
    assert attrs["created_by"] == CREATED_BY and attrs["n_test"] == 1
    expected = random_velocity(config.solver, 3, torch.Generator().manual_seed(3))
    np.testing.assert_allclose(first, expected.float().numpy(), rtol=0, atol=1e-6)
    assert [p.name for p in tmp_path.iterdir()] == ["ns3d.h5"]  # no temporary file left


def test_batching_does_not_change_the_data(tmp_path: Path) -> None:
    one = generate_dataset(tmp_path / "one.h5", tiny_dataset(batch_size=1))
    all_ = generate_dataset(tmp_path / "all.h5", tiny_dataset(batch_size=3))
    with h5py.File(one, "r") as a, h5py.File(all_, "r") as b:
        np.testing.assert_allclose(a["velocity"][:], b["velocity"][:], rtol=0, atol=1e-6)


def test_ensure_dataset_reuses_regenerates_and_never_overwrites_a_users_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ns3d.h5"
    ensure_dataset(path, tiny_dataset())
    created = path.stat().st_mtime_ns
    assert ensure_dataset(path, tiny_dataset()) == path and path.stat().st_mtime_ns == created
    ensure_dataset(path, tiny_dataset(n_snapshots=4))
    with h5py.File(path, "r") as file:
        assert file["velocity"].shape[1] == 4
    users = tmp_path / "users.h5"
    with h5py.File(users, "w") as file:
        file.create_dataset("velocity", data=np.zeros((1, 2, 3, 8, 8, 8), np.float32))
    before = users.read_bytes()
    with pytest.raises(DataError, match="shardsci did not write"):
        ensure_dataset(users, tiny_dataset(), GenerateMode.force)
    assert users.read_bytes() == before


def _generate_on_ranks_body(directory: str) -> None:
    mesh = get_mesh((2, 2))
    path = Path(directory) / "sharded.h5"
    with count_traffic() as traffic:
        generate_dataset(path, tiny_dataset(), mesh, (Shard(2), Shard(3)))
    allowed = {"c10d::alltoall_base_", "c10d::allreduce_", "c10d::broadcast_"}
    assert_all_ranks(
        set(traffic.collectives) <= allowed, f"collectives {dict(traffic.collectives)}"
    )


def test_generation_on_ranks_writes_the_single_process_data(tmp_path: Path) -> None:
    run_on_ranks(4, _generate_on_ranks_body, str(tmp_path))
    single = generate_dataset(tmp_path / "single.h5", tiny_dataset())
    with h5py.File(tmp_path / "sharded.h5", "r") as a, h5py.File(single, "r") as b:
        assert a["velocity"].attrs["complete"]
        # float64 integration, float32 storage: at most a rounding apart.
        np.testing.assert_allclose(a["velocity"][:], b["velocity"][:], rtol=0, atol=1e-6)
        assert dict(a.attrs).keys() == dict(b.attrs).keys()
