"""The 3-D CFD recipe (``+recipe=cfd3d``): its decompositions and axis roles, the checks that
refuse a configuration before any rank starts (``-m slow``: also through the command), the 3-D
UNet it selects with ``model=unet`` against one process, the augmentation by the box's
symmetries (the solver commutes with them; ``-m slow``: on sharded fields against one
process), the learnability probe, and (``-m slow``) a short run of the command on a 2x2x2 block.

Every configuration is checked in this process with the rank starter replaced by a tripwire
(as ``tests/test_run_checks.py`` does); none writes a file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch.distributed.tensor import Shard

import shardsci.train as train
from shardsci.checkpoint import latest_checkpoint
from shardsci.checkpoint._extra import read_extra
from shardsci.models import UNet
from shardsci.testing import Layout, check_against_reference, get_mesh, run_on_ranks
from shardsci.training import ConfigError, relative_l2

ROOT = Path(__file__).resolve().parents[1]
TINY_DATA = [
    "data.dataset.solver.resolution=8",
    "data.dataset.solver.dt=0.01",
    "data.dataset.solver.ic_max_wavenumber=2",
    "data.dataset.solver.forcing_wavenumber=1.5",
    "data.dataset.n_train=2",
    "data.dataset.n_test=1",
    "data.dataset.n_snapshots=4",
    "data.dataset.record_every=2",
    "data.dataset.warmup_steps=2",
    "eval.rollout_steps=2",
    "train.global_batch=4",
]
"""8³, 3 trajectories of 4 snapshots (a rollout of 2 steps): generated in about a second. Its
6 training pairs (4 2-step rollouts) hold a batch of 4, not the recipe's 8."""
SMALL_FNO = [
    "model.modes=[2,2,2]",
    "model.width=4",
    "model.layers=1",
    "model.projection_channels=4",
]
"""An FNO that takes 8³ (the default's 8 modes per dim need 16³ or more)."""


def _compose(tmp_path: Path, *overrides: str):
    recipe = [
        "+recipe=cfd3d", f"run_dir={tmp_path}", f"data.path={tmp_path}/v.h5", "data.generate=force"
    ]  # fmt: skip
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        return compose("config", overrides=[*recipe, *overrides])


@pytest.fixture
def no_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    def tripwire(*args, **kwargs):
        raise AssertionError("ranks were started before the config was refused")

    monkeypatch.setattr(train, "run_ranks", tripwire)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("SHARDSCI_MAX_LOCAL_RANKS", raising=False)


@pytest.mark.usefixtures("no_ranks")
@pytest.mark.parametrize(
    ("overrides", "roles"),
    [
        (["mesh=2x2x2"], "domain_d=2 (splits D), domain_h=2 (splits H), domain_w=2 (splits W)"),
        (["mesh=2x2"], "domain_d=2 (splits D), domain_h=2 (splits H)"),
        (["mesh=8"], "domain=8 (splits D)"),
        (["mesh=2x4", "parallel=auto"], "dp=2 (data parallel), domain=4 (splits D)"),
        (["mesh=2x2x2", "parallel=auto"],
         "dp=2 (data parallel), domain_d=2 (splits D), domain_h=2 (splits H)"),
    ],
)  # fmt: skip
def test_block_pencil_and_slab_roles_are_planned_before_any_rank_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: list[str], roles: str
) -> None:
    """The recipe's default ``parallel=block``: every mesh axis splits D, H, W in order. The
    plan is what ``launch`` hands to the ranks (here, the tripwire's arguments)."""
    planned = []
    monkeypatch.setattr(train, "run_ranks", lambda cfg, plan, env, body: planned.append(plan))
    assert train.launch(_compose(tmp_path, *TINY_DATA, *SMALL_FNO, *overrides)) is None
    assert planned[0].describe() == roles
    assert list(tmp_path.iterdir()) == []  # nothing generated before the ranks start


@pytest.mark.usefixtures("no_ranks")
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["mesh=2x2x2x1"], r"the mesh has 4 axes besides data parallelism but the fields have 3 "
         r"spatial dims \['D', 'H', 'W'\]"),
        (["mesh=1x1x16", "data.dataset.solver.resolution=8"],
         "splits W over 16 ranks, but the fields have 8 cells along W"),
        (["model=vit"], r"model shardsci.models.ViT cannot take the recipe's fields of shape "
         r"\(batch, 3, 8, 8, 8\)"),
        (["model=unet", "data.dataset.solver.resolution=10"],
         "needs D, H and W divisible by 4"),
        (["model=fno", "model.modes=[2,2]"], "cannot take the recipe's fields"),
        # 2-step rollouts: 2 trajectories x (4 - 2) starts.
        (["train.rollout.steps=2", "train.global_batch=7"],
         "exceeds the 4 training 2-step rollouts"),
        (["train.rollout.steps=1", "train.global_batch=7"], "exceeds the 6 training pairs"),
        (["train.rollout.steps=4"], r"train.rollout.steps=4: expected 1 to 3 \(the data has 4"),
        (["data.dataset.solver.resolution=6"], r"data.dataset: SolverConfig.ic_max_wavenumber "
         r"must be in \[1, N/3\)"),
    ],
)  # fmt: skip
def test_a_3d_config_that_cannot_run_is_one_line_before_any_rank_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: list[str], message: str
) -> None:
    monkeypatch.setenv("SHARDSCI_MAX_LOCAL_RANKS", "16")
    with pytest.raises(ConfigError, match=message):
        train.launch(_compose(tmp_path, *TINY_DATA, *overrides))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # about 10 s of train.py start-up; see the docstring
def test_a_bad_combination_is_one_line_and_exit_status_2(tmp_path: Path) -> None:
    """Through the real command: no traceback, no rank, no run directory. By default the
    message is checked in this process (the test above, ``mesh=2x2x2x1``) and what the command
    does with any refused config (one line, exit status 2, no run directory) by
    tests/test_run_checks.py's real-command test: the same ``reported`` path, another recipe."""
    done = subprocess.run(
        [sys.executable, "train.py", "+recipe=cfd3d", "mesh=2x2x2x1", f"run_dir={tmp_path}/run"],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: mesh=2x2x2x1: the mesh has 4 axes besides data parallelism but the fields have "
        "3 spatial dims ['D', 'H', 'W']; use fewer axes"
    ]
    assert not (tmp_path / "run").exists()


# (B, C, D, H, W) volumes, D, H and W multiples of 2 (a UNet of depth 1).
VOLUMES = {
    "2r-D-5/3": (2, (2,), (1, 2, 8, 6, 4), Layout((Shard(2),), {2: (5, 3)})),
    "2x2-pencil-6/2-1/5": (
        4, (2, 2), (1, 2, 8, 6, 4), Layout((Shard(2), Shard(3)), {2: (6, 2), 3: (1, 5)})
    ),
    # The recipe's default mesh=2x2x2, uneven on every axis, an empty block along W.
    "2x2x2-block-5/3-2/4-4/0": (
        8, (2, 2, 2), (1, 2, 8, 6, 4),
        Layout((Shard(2), Shard(3), Shard(4)), {2: (5, 3), 3: (2, 4), 4: (4, 0)}),
    ),
}  # fmt: skip


def _unet_3d_body(case: str) -> None:
    _, mesh_shape, shape, layout = VOLUMES[case]
    torch.manual_seed(0)
    module = UNet(
        in_channels=2, width=4, depth=1, norm_groups=2, blocks_per_level=1, spatial_dims=3,
        padding_mode="circular", up="bilinear", coordinates="periodic", residual=True,
    ).double()  # fmt: skip
    check_against_reference(
        lambda m, a: m(a),
        [torch.randn(shape, dtype=torch.float64)],
        [layout],
        get_mesh(mesh_shape),
        module=module,
        out_layouts=[layout],
        not_a_gather="a model's layers exchange wider features than its input, layer after layer",
        what="unet-3d",
    )


@pytest.mark.parametrize("case", VOLUMES)
def test_the_3d_unet_on_shard_tensors_equals_one_process(case: str) -> None:
    """``model=unet`` of this recipe: conv3d (circular), GroupNorm, 2x2x2 pooling, trilinear
    upsampling; forward, every parameter gradient and the output's layout, float64."""
    run_on_ranks(VOLUMES[case][0], _unet_3d_body, case)


@pytest.mark.slow
def test_the_command_trains_on_a_2x2x2_block(tmp_path: Path) -> None:
    """``python train.py +recipe=cfd3d mesh=2x2x2`` on 8³: generates its data on rank 0, trains,
    evaluates against persistence, draws the held-out rollout's mid-plane, and checkpoints
    what a prediction needs (the normalisation and the data's physics). About 40 s here at a
    load average of 20 (8 ranks on 2 cores)."""
    command = [
        sys.executable, "train.py", "+recipe=cfd3d", "mesh=2x2x2", "logger=none",
        f"run_dir={tmp_path}/run", f"data.path={tmp_path}/v.h5", "data.generate=force",
        "train.steps=2", "train.global_batch=2", *TINY_DATA, *SMALL_FNO,
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "run"
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["step"] == 2 and 0 < metrics["eval_relative_l2"] < 2
    assert 0 < metrics["persistence_relative_l2"] < 1
    assert {"rollout_relative_l2_step1", "rollout_relative_l2_step2"} <= metrics.keys()
    assert (run / "eval_step000002.png").stat().st_size > 10_000
    state = read_extra(latest_checkpoint(run / "checkpoints"))["prediction"]
    assert state["mean"].shape == state["std"].shape == (3,)
    assert state["data_attributes"]["resolution"] == 8


def test_learnability_probe_reports_train_and_held_out_errors_against_persistence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The one-process probe (README, "The 3-D recipe") trains the recipe's UNet on a tiny file
    and prints both errors; its held-out persistence is the file's, computed here directly.
    With ``--eval-every 1`` it prints the held-out error after step 1 of 2: that of the model a
    1-step run ends with (the warm-up's first step does not depend on the number of steps)."""
    import re

    import h5py

    from shardsci.recipes.cfd3d import learnability
    from shardsci.recipes.cfd3d.generate import DatasetConfig, generate_dataset
    from shardsci.recipes.cfd3d.navier_stokes import SolverConfig

    solver = SolverConfig(
        resolution=8, dt=0.01, ic_max_wavenumber=2, forcing_wavenumber=1.5, precision="float32"
    )
    config = DatasetConfig(
        solver=solver, n_train=2, n_test=1, n_snapshots=4, record_every=2, warmup_steps=2
    )
    path = generate_dataset(tmp_path / "v.h5", config)
    probe = [str(path), "--model", "unet", "--n-train", "2", "--augment"]
    learnability.main([*probe, "--steps", "1"])
    after_one_step = re.findall(r"on held-out pairs (\S+) ", capsys.readouterr().out)
    learnability.main([*probe, "--steps", "2", "--eval-every", "1"])
    printed = capsys.readouterr().out
    assert re.findall(r"step (\d+) \(.*\): held-out pairs (\S+)", printed) == [
        ("1", *after_one_step)
    ], printed
    with h5py.File(path, "r") as file:
        held_out = torch.from_numpy(file["velocity"][2:]).double()
    inputs, targets = held_out[:, :-1].flatten(0, 1), held_out[:, 1:].flatten(0, 1)
    persistence = relative_l2(inputs, targets).mean()
    assert "6 training pairs, 3 held-out pairs" in printed
    assert "on held-out pairs " in printed
    assert printed.rstrip().endswith(f"(persistence {persistence:.4f})"), printed
    learnability.main([*probe, "--steps", "1", "--rollout-steps", "2", "--rollout", "2"])
    start = min(4 // 2, 4 - 1 - 2)  # the recipe's rollout start: the middle snapshot, or earlier
    still = relative_l2(held_out[:, start], held_out[:, start + 2]).mean()
    assert (
        capsys.readouterr()
        .out.rstrip()
        .endswith(f"(persistence {persistence:.4f}, after 2 steps {still:.4f})")
    )
    with pytest.raises(SystemExit):
        learnability.main([str(path), "--n-train", "3"])


def test_every_symmetry_of_the_box_maps_a_solver_pair_to_a_solver_pair() -> None:
    """The augmentation (NOTE [Symmetries of the box act on positions and on components]): the
    solver's step commutes with each of the 48 symmetries of the cube, float64, to round-off
    (a permutation of positions without the components, or a flip without the sign, is off by
    O(1)); a box that is not a cube keeps only the symmetries that keep its shape."""
    from shardsci.recipes.cfd3d.navier_stokes import NavierStokes3d, SolverConfig, random_velocity
    from shardsci.recipes.cfd3d.symmetry import box_symmetries

    config = SolverConfig(resolution=8, dt=0.01, ic_max_wavenumber=2, forcing_wavenumber=1.5)
    solver = NavierStokes3d(config)
    before = random_velocity(config, 1, torch.Generator().manual_seed(0))
    after = solver.advance(before, 1)
    assert (after - before).abs().max() > 0.05
    symmetries = box_symmetries((8, 8, 8))
    assert len(set(symmetries)) == 48 and symmetries[0].is_identity
    mapped = solver.advance(torch.cat([symmetry(before) for symmetry in symmetries]), 1)
    expected = torch.cat([symmetry(after) for symmetry in symmetries])
    torch.testing.assert_close(mapped, expected, atol=1e-12, rtol=0)
    assert {(s.axes, len(s.signs)) for s in box_symmetries((8, 8, 4))} == {
        ((0, 1, 2), 3),
        ((1, 0, 2), 3),
    }
    assert len(box_symmetries((8, 8, 4))) == 16


# (axes, signs) that move a sharded dim onto another and reverse sharded dims.
SHARDED_SYMMETRIES = [((1, 0, 2), (-1, 1, 1)), ((2, 0, 1), (1, -1, -1)), ((0, 1, 2), (-1, -1, 1))]
CUBES = {
    "2r-D-5/1": (2, (2,), Layout((Shard(2),), {2: (5, 1)})),
    "2x2-pencil-4/2-1/5": (4, (2, 2), Layout((Shard(2), Shard(3)), {2: (4, 2), 3: (1, 5)})),
}


def _symmetry_body(case: str) -> None:
    from shardsci.recipes.cfd3d.symmetry import BoxSymmetry

    _, mesh_shape, layout = CUBES[case]
    fields = torch.randn(2, 3, 6, 6, 6, dtype=torch.float64)
    for axes, signs in SHARDED_SYMMETRIES:
        check_against_reference(
            BoxSymmetry(axes, signs),
            [fields], [layout], get_mesh(mesh_shape), out_layouts=[layout],
            what=f"box symmetry {axes} {signs}",
        )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", CUBES)
def test_a_symmetry_of_sharded_fields_equals_one_process_and_keeps_the_layout(case: str) -> None:
    """The augmentation on a training batch as the ranks hold it: uneven slabs and an uneven
    pencil, a permutation that moves a sharded dim and reversals of sharded dims; values,
    gradients and the output's placements and shard sizes (it fails without the redistribution
    back to the input's layout). 7-40 s per case here at load averages of 9-18 (the first
    ShardTensor calls' sharding propagation, and starting the pool)."""
    run_on_ranks(CUBES[case][0], _symmetry_body, case)
