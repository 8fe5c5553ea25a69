"""The CFD recipe's data: the Navier–Stokes solver against exact solutions, and its HDF5 files."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from shardsci.data import DataError, GenerateMode
from shardsci.recipes.cfd import generate
from shardsci.recipes.cfd.data import TRAJECTORIES
from shardsci.recipes.cfd.generate import (
    DatasetConfig,
    ensure_dataset,
    generate_dataset,
    main,
)
from shardsci.recipes.cfd.navier_stokes import (
    SOLVER_VERSION,
    NavierStokes2d,
    SolverConfig,
    UnstableTimeStepError,
    forcing_field,
    grid_coordinates,
    random_vorticity,
)
from shardsci.training import Trajectories


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


def taylor_green(n: int, wavenumber: int) -> torch.Tensor:
    """Taylor–Green vorticity 2k cos(kx) cos(ky), k = 2π m: a steady solution of Euler."""
    x, y = grid_coordinates(n)
    k = 2 * math.pi * wavenumber
    return 2 * k * torch.cos(k * x) * torch.cos(k * y)


def tiny_dataset(viscosity: float = 1e-3, **overrides: int) -> DatasetConfig:
    """Three 16² trajectories of three snapshots: generates in milliseconds."""
    solver = SolverConfig(resolution=16, viscosity=viscosity, dt=0.05, seed=3)
    fields = {"n_train": 2, "n_test": 1, "n_snapshots": 3, "record_every": 2, **overrides}
    return DatasetConfig(solver=solver, **fields)


def test_taylor_green_decays_at_the_analytic_rate() -> None:
    config = SolverConfig(resolution=32, viscosity=1e-3, dt=0.01, forcing="none")
    omega0 = taylor_green(32, wavenumber=2)
    n_steps = 400
    omega = NavierStokes2d(config).advance(omega0[None], n_steps)[0]
    k = 2 * math.pi * 2
    decay = math.exp(-2 * config.viscosity * k**2 * n_steps * config.dt)  # ≈ 0.28
    # Measured: 1.3e-14. Integrating-factor RK4 makes the decay exact up to round-off.
    assert relative_error(omega, decay * omega0) < 1e-12


def test_taylor_green_advection_vanishes() -> None:
    omega = taylor_green(32, wavenumber=3)
    advection = NavierStokes2d(SolverConfig(resolution=32)).advection(omega)
    scale = 2 * math.pi * 3 * omega.abs().max()  # |u| ≤ 1 times |∇ω|
    assert float(advection.abs().max() / scale) < 1e-13


def test_velocity_and_advection_signs() -> None:
    solver = NavierStokes2d(SolverConfig(resolution=32))
    x, y = grid_coordinates(32)
    # Shear u = (sin 2πy, 0) has ω = ∂v/∂x - ∂u/∂y = -2π cos 2πy.
    u, v = solver.velocity(-2 * math.pi * torch.cos(2 * math.pi * y))
    torch.testing.assert_close(u, torch.sin(2 * math.pi * y), rtol=0, atol=1e-13)
    torch.testing.assert_close(v, torch.zeros_like(v), rtol=0, atol=1e-13)
    # ω = cos 2πx + cos 4πy: u = -sin(4πy)/4π, v = sin(2πx)/2π, so u·∇ω = -1.5 sin 2πx sin 4πy.
    advection = solver.advection(torch.cos(2 * math.pi * x) + torch.cos(4 * math.pi * y))
    expected = -1.5 * torch.sin(2 * math.pi * x) * torch.sin(4 * math.pi * y)
    torch.testing.assert_close(advection, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("forcing", "wavenumber_squared"),
    [("kolmogorov", (2 * math.pi * 2) ** 2), ("fno", 2 * (2 * math.pi) ** 2)],
)
def test_forced_spin_up_is_fourth_order_accurate(forcing: str, wavenumber_squared: float) -> None:
    """From rest, a one-mode forcing drives a flow without advection: ω = f (1 - e^{-λt}) / λ."""

    def error(dt: float) -> float:
        config = SolverConfig(
            resolution=16,
            viscosity=0.01,
            drag=0.1,
            dt=dt,
            forcing=forcing,
            kolmogorov_wavenumber=2,
        )
        rate = config.viscosity * wavenumber_squared + config.drag
        f = forcing_field(config)
        omega = NavierStokes2d(config).advance(torch.zeros(1, 16, 16), round(1.0 / dt))[0]
        return relative_error(omega, f * (1 - math.exp(-rate)) / rate)

    coarse, fine = error(0.1), error(0.05)
    assert coarse < 1e-5
    assert 12 < coarse / fine < 20  # halving dt cuts the error 16-fold


def test_mean_vorticity_stays_zero() -> None:
    config = SolverConfig(resolution=32, forcing="fno", dt=0.02, seed=1)
    omega0 = random_vorticity(config, 2, torch.Generator().manual_seed(config.seed))
    omega = NavierStokes2d(config).advance(omega0, 100)
    assert float(omega0.mean(dim=(-2, -1)).abs().max()) < 1e-15
    assert float(omega.mean(dim=(-2, -1)).abs().max()) < 1e-15
    assert relative_error(omega, omega0) > 0.1  # the flow did evolve


def test_random_vorticity_has_the_configured_rms() -> None:
    config = SolverConfig(resolution=32, ic_rms=0.5)
    omega = random_vorticity(config, 64, torch.Generator().manual_seed(0))
    assert omega.shape == (64, 32, 32)
    assert abs(float(omega.pow(2).mean().sqrt()) / 0.5 - 1) < 0.1


def test_trajectories_are_reproducible_from_the_seed() -> None:
    def trajectory(seed: int) -> torch.Tensor:
        config = SolverConfig(resolution=32, dt=0.02, seed=seed)
        solver = NavierStokes2d(config)
        omega = random_vorticity(config, 2, torch.Generator().manual_seed(config.seed))
        return torch.stack(list(solver.snapshots(omega, n_snapshots=3, record_every=5)))

    assert torch.equal(trajectory(seed=7), trajectory(seed=7))
    assert not torch.allclose(trajectory(seed=7), trajectory(seed=8))


def test_cfl_guard_refuses_an_unstable_time_step() -> None:
    config = SolverConfig(resolution=32, dt=0.5, forcing="none")
    solver = NavierStokes2d(config)
    with pytest.raises(UnstableTimeStepError, match=r"dt=0\.5 gives CFL number"):
        solver.advance(taylor_green(32, wavenumber=1)[None], 1)
    with pytest.raises(UnstableTimeStepError, match="blew up"):
        solver.advance(torch.full((1, 32, 32), float("nan")), 1)


@pytest.mark.parametrize(
    "make",
    [
        lambda: SolverConfig(viscosity=0.0),
        lambda: SolverConfig(dt=-1.0),
        lambda: SolverConfig(forcing="spiral"),  # type: ignore[arg-type]
        lambda: SolverConfig(resolution=12, forcing="kolmogorov", kolmogorov_wavenumber=4),
        lambda: DatasetConfig(n_snapshots=1),
        lambda: DatasetConfig(n_train=0),
    ],
)
def test_invalid_configs_raise(make: object) -> None:
    with pytest.raises(ValueError, match="must be"):
        make()  # type: ignore[operator]


def test_generated_file_layout(tmp_path: Path) -> None:
    config = tiny_dataset()
    path = generate_dataset(tmp_path / "ns.h5", config)
    with h5py.File(path, "r") as file:
        vorticity = file["vorticity"]
        assert vorticity.shape == (3, 3, 16, 16)
        assert vorticity.dtype == np.float32
        assert vorticity.chunks == (1, 1, 16, 16)
        assert vorticity.compression is None
        attrs = dict(file.attrs)
        first = vorticity[:, 0]
    assert attrs["viscosity"] == 1e-3 and attrs["dt"] == 0.05 and attrs["record_dt"] == 0.1
    assert attrs["resolution"] == 16 and attrs["forcing"] == "fno" and attrs["seed"] == 3
    assert attrs["solver_version"] == SOLVER_VERSION and attrs["domain_length"] == 1.0
    assert attrs["created_by"].startswith("shardsci")
    expected = random_vorticity(config.solver, 3, torch.Generator().manual_seed(3))
    np.testing.assert_array_equal(first, expected.float().numpy())
    assert TRAJECTORIES.read(path) == Trajectories(path, 2, 1, 3, {"H": 16, "W": 16})


def test_chunks_tile_large_snapshots(tmp_path: Path) -> None:
    solver = SolverConfig(resolution=144, dt=0.005)
    config = DatasetConfig(solver=solver, n_train=1, n_test=0, n_snapshots=2, record_every=1)
    with h5py.File(generate_dataset(tmp_path / "ns.h5", config), "r") as file:
        assert file["vorticity"].chunks == (1, 1, 128, 128)


def test_batching_does_not_change_the_data(tmp_path: Path) -> None:
    one = generate_dataset(tmp_path / "one.h5", tiny_dataset(batch_size=1))
    all_ = generate_dataset(tmp_path / "all.h5", tiny_dataset(batch_size=3))
    with h5py.File(one, "r") as a, h5py.File(all_, "r") as b:
        np.testing.assert_array_equal(a["vorticity"][:], b["vorticity"][:])


def test_ensure_dataset_reuses_a_match_and_regenerates_a_mismatch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ns.h5"
    ensure_dataset(path, tiny_dataset())
    created = path.stat().st_mtime_ns

    def refuse(*args: object) -> None:
        raise AssertionError("a matching file was regenerated")

    with monkeypatch.context() as patch:
        patch.setattr(generate, "generate_dataset", refuse)
        same_data = dataclasses.replace(
            tiny_dataset(batch_size=1),
            solver=dataclasses.replace(tiny_dataset().solver, max_cfl=0.9),
        )
        ensure_dataset(path, same_data)  # neither batching nor the CFL guard changes the data
    assert path.stat().st_mtime_ns == created

    ensure_dataset(path, tiny_dataset(n_snapshots=4))
    with h5py.File(path, "r") as file:
        assert file["vorticity"].shape == (3, 4, 16, 16)
    ensure_dataset(path, tiny_dataset(viscosity=2e-3, n_snapshots=4))
    with h5py.File(path, "r") as file:
        assert file.attrs["viscosity"] == 2e-3


def test_ensure_dataset_never_replaces_a_file_it_did_not_write(tmp_path: Path) -> None:
    """Not even with force, nor when the file is not HDF5 (NOTE [Whose data file is it])."""
    garbage, foreign = tmp_path / "garbage.h5", tmp_path / "foreign.h5"
    garbage.write_bytes(b"not hdf5")
    with h5py.File(foreign, "w") as file:
        file["vorticity"] = np.zeros((3, 3, 16, 16), np.float32)
    before = {path: path.read_bytes() for path in (garbage, foreign)}
    for mode in GenerateMode:
        with pytest.raises(DataError, match="cannot be read as HDF5"):
            ensure_dataset(garbage, tiny_dataset(), mode)
    with pytest.raises(DataError, match="would overwrite"):
        ensure_dataset(foreign, tiny_dataset(), GenerateMode.force)
    with pytest.raises(DataError, match="refusing to overwrite"):
        generate_dataset(foreign, tiny_dataset())
    assert {path: path.read_bytes() for path in (garbage, foreign)} == before
    assert sorted(tmp_path.iterdir()) == sorted(before)


def test_the_leftover_of_a_killed_writer_goes_at_the_next_write(tmp_path: Path) -> None:
    """SIGKILL leaves a writer no chance to remove its temporary (``temporary_beside``); the
    next write here removes it, and keeps those of a running writer and of another host."""
    import signal
    import socket
    import subprocess
    import sys

    def hidden(host: str, pid: int) -> Path:
        return tmp_path / f".ns.h5.{host}.{pid}.0123abcd.tmp"

    writer = (
        "import os, signal, sys; open(sys.argv[1].replace('PID', str(os.getpid())), 'w')"
        ".write('half'); os.kill(os.getpid(), signal.SIGKILL)"
    )
    template = str(hidden(socket.gethostname(), 0)).replace(".0.", ".PID.")
    killed = subprocess.run([sys.executable, "-c", writer, template], check=False)
    assert killed.returncode == -signal.SIGKILL
    (leftover,) = tmp_path.iterdir()
    dead = int(leftover.name.split(".")[-3])
    with subprocess.Popen(["sleep", "60"]) as running:
        try:
            alive = hidden(socket.gethostname(), running.pid)
            elsewhere = hidden("another-host", dead)
            for path in (alive, elsewhere):
                path.write_text("in progress")
            generate_dataset(tmp_path / "ns.h5", tiny_dataset())
            assert sorted(tmp_path.iterdir()) == sorted([tmp_path / "ns.h5", alive, elsewhere])
        finally:
            running.kill()


def test_interrupted_write_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail_midway(
        self: NavierStokes2d, omega: torch.Tensor, *args: int
    ) -> Iterator[torch.Tensor]:
        yield omega
        raise KeyboardInterrupt

    path = tmp_path / "ns.h5"
    monkeypatch.setattr(NavierStokes2d, "snapshots", fail_midway)
    with pytest.raises(KeyboardInterrupt):
        generate_dataset(path, tiny_dataset())
    assert list(tmp_path.iterdir()) == []

    monkeypatch.undo()
    generate_dataset(path, tiny_dataset())
    before = path.read_bytes()
    monkeypatch.setattr(NavierStokes2d, "snapshots", fail_midway)
    with pytest.raises(KeyboardInterrupt):
        ensure_dataset(path, tiny_dataset(n_snapshots=4))
    assert path.read_bytes() == before
    assert list(tmp_path.iterdir()) == [path]


def test_command_line(tmp_path: Path) -> None:
    path = tmp_path / "cli.h5"
    options = {
        "--out": str(path),
        "--resolution": "16",
        "--dt": "0.05",
        "--forcing": "kolmogorov",
        "--n-train": "1",
        "--n-test": "1",
        "--n-snapshots": "2",
        "--record-every": "1",
    }
    main([word for option in options.items() for word in option])
    with h5py.File(path, "r") as file:
        assert file["vorticity"].shape == (2, 2, 16, 16)
        assert file.attrs["forcing"] == "kolmogorov"


def test_command_line_rejects_an_invalid_config(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path / "cli.h5"), "--n-snapshots", "1"])
    assert exit_info.value.code == 2
    assert list(tmp_path.iterdir()) == []
