"""What clusters do to a training run, done to real processes (issue 11, item 3).

- A rank that stops participating (SIGSTOP) makes every other rank fail within
  ``launcher.timeout_s`` plus ``report_wait_s`` with one line naming the collective and the rank
  (NOTE [A rank that stops participating]).
- A NaN or infinite loss stops the run naming the step and the field, or, with
  ``train.nonfinite=skip``, skips that step's update and goes on.
- A rank killed by SIGKILL under ``torchrun --max-restarts=1`` (or ``launcher.max_restarts=1``):
  the job restarts, resumes from the last complete checkpoint and ends with the parameters of an
  uninterrupted run.
- SIGTERM (SLURM preemption with ``--signal``, ``kill``): a checkpoint is written before exit,
  and the same command run again (a requeued job) resumes and ends with the parameters of an
  uninterrupted run.

Every run trains the recipe on a 32x32 dataset of 6 trajectories on 2 ranks; the runs that are
interrupted use the same mesh, seed and batches as the uninterrupted one, so their parameters
must agree bit for bit.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch import nn

import shardsci.train  # noqa: F401  registers the config schemas and the recipes
from shardsci.checkpoint import load_checkpoint
from shardsci.distributed import detect_launch_env, report_wait_s
from shardsci.recipes.cfd.generate import CREATED_BY, DatasetConfig, generate_dataset
from shardsci.recipes.cfd.navier_stokes import SolverConfig
from shardsci.testing import run_on_ranks
from shardsci.testing.slurm import (
    FINAL_STATES,
    job_state,
    local_cluster_or_skip,
    signal_job,
    submit,
    wait_for_job,
)
from shardsci.training import (
    USER_ERRORS,
    NonFiniteLoss,
    ParallelConfig,
    Parallelism,
    ParallelPlan,
    RunConfig,
    RunContext,
    Trainer,
    exit_status,
    instantiate,
)
from tests.recipe_on_ranks import train_recipe_on_the_pool

ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 240
RUN_TIMEOUT_S = 300
TINY = [
    "logger=none",
    "train.log_every=1",
    "train.eval_every=100000",
    "train.global_batch=8",
    "eval.samples=8",
    "eval.rollout_steps=1",
]


TINY_DATA = DatasetConfig(solver=SolverConfig(resolution=32), n_train=4, n_test=2, n_snapshots=6)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = generate_dataset(tmp_path_factory.mktemp("data") / "ns.h5", TINY_DATA)
    with h5py.File(path, "r+") as file:
        del file.attrs["created_by"]  # a file of the user's: read as it is
    return path


def _train_py(dataset: Path, run_dir: Path, mesh: str, *overrides: str) -> list[str]:
    return [
        "train.py", "+recipe=cfd", f"mesh={mesh}", f"data.path={dataset}", f"run_dir={run_dir}",
        *TINY, *overrides,
    ]  # fmt: skip


def _torchrun(*arguments: str, max_restarts: int = 0) -> list[str]:
    return [
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        f"--max-restarts={max_restarts}", *arguments,
    ]  # fmt: skip


class _Run:
    """``python <arguments>`` in the repository, its own session, output kept in files (a
    pipe nobody reads could fill up and block the run)."""

    def __init__(self, arguments: list[str], log: Path):
        self.log = log
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:
            self.process = subprocess.Popen(
                [sys.executable, *arguments], cwd=ROOT, env=env, stdout=out, stderr=err,
                start_new_session=True,
            )  # fmt: skip

    @property
    def stderr(self) -> str:
        return Path(f"{self.log}.err").read_text()

    @property
    def stdout(self) -> str:
        return Path(f"{self.log}.out").read_text()

    def wait(self, timeout_s: float = RUN_TIMEOUT_S) -> int:
        return self.process.wait(timeout=timeout_s)

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@pytest.fixture
def runs() -> Iterator[Callable[[list[str], Path], _Run]]:
    """Start runs; whatever still runs at the end of the test is killed, with its ranks."""
    started: list[_Run] = []

    def start(arguments: list[str], log: Path) -> _Run:
        started.append(_Run(arguments, log))
        return started[-1]

    yield start
    for run in started:
        run.kill()


def _logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if line.endswith("}") and "loss" in line]


def _wait_until(run: _Run, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not done():
        assert run.process.poll() is None, f"the run ended early:\n{run.stderr[-3000:]}"
        assert time.monotonic() < deadline, "the run did not get there within the timeout"
        time.sleep(0.05)


def _ranks(pid: int) -> list[int]:
    """The processes below ``pid`` that run ``train.py`` (the ranks; under torchrun, the
    agent's workers), in order of process id."""
    below, todo = [], [pid]
    while todo:
        tasks = Path(f"/proc/{todo.pop()}/task")
        with_children = list(tasks.iterdir()) if tasks.is_dir() else []
        for task in with_children:
            for child in (task / "children").read_text().split():
                below.append(int(child))
                todo.append(int(child))
    return sorted(p for p in below if _is_rank(p))


def _is_rank(pid: int) -> bool:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_text()
    except FileNotFoundError:
        return False
    return "train.py" in command and "torch.distributed.run" not in command


def _rank_pids(run: _Run, world_size: int = 2) -> list[int]:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while len(ranks := _ranks(run.process.pid)) < world_size:
        assert run.process.poll() is None, f"the run ended early:\n{run.stderr[-3000:]}"
        assert time.monotonic() < deadline, f"ranks not found: {ranks}"
        time.sleep(0.05)
    return ranks


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie does not: it only waits to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


# ---------------------------------------------------------------------------- (c) a hung rank
HANG_TIMEOUT_S = 5
"""Far above a step of the tiny run (milliseconds; the rank is stopped after a logged step, so
no start-up is inside it), and what the test waits, with ``report_wait_s`` (5 s), for the line."""
HANG_GRACE_S = 1
"""The stopped rank cannot exit, so the launcher kills it when this grace ends: no reason to
wait longer."""


@pytest.mark.parametrize(
    ("mesh", "stopped"),
    [
        ("1x2", 1),  # domain-parallel: the ranks meet in shardsci's collectives
        # data-parallel, in the gradient reduction; the stopped rank hosts the rendezvous store
        pytest.param("2x1", 0, marks=pytest.mark.slow),
    ],
)
def test_a_rank_that_stops_participating_fails_the_others_with_one_line(
    dataset: Path, tmp_path: Path, runs, mesh: str, stopped: int
) -> None:
    run_dir = tmp_path / "run"
    arguments = _train_py(
        dataset, run_dir, mesh, "train.steps=100000", "train.checkpoint_every=0",
        f"launcher.timeout_s={HANG_TIMEOUT_S}", f"launcher.grace_s={HANG_GRACE_S}",
    )  # fmt: skip
    run = runs(arguments, tmp_path / "log")
    ranks = _rank_pids(run)
    _wait_until(run, lambda: _logged_steps(run_dir))
    os.kill(ranks[stopped], signal.SIGSTOP)
    # A generous bound, for a loaded machine: the timeout, the wait for reports, the grace.
    status = run.wait(timeout_s=HANG_TIMEOUT_S + report_wait_s(HANG_TIMEOUT_S) + HANG_GRACE_S + 120)
    errors = re.findall(r"error: .*", run.stderr)  # the leader may stop mid-progress-bar
    assert status == 2 and len(errors) == 1, run.stderr[-3000:]
    waited = rf"^error: rank {1 - stopped} waited {HANG_TIMEOUT_S} s \(launcher\.timeout_s\) in "
    collective = (
        r"(the collective \w+ called by|a collective( issued in torch's \w+)? under `.+` in) "
        r"\w+ \(\S+:\d+\)"
    )
    assert re.match(f"{waited}{collective} for rank {stopped}, which", errors[0]), errors[0]
    assert "Traceback" not in run.stderr
    assert not [pid for pid in ranks if _alive(pid)]


# ---------------------------------------------------------------------------- (d) NaN or Inf loss
class _Toy:
    """A ``Task``: fit a linear map; the loss of field ``v`` is ``bad`` at step ``bad_step``
    (counted from 1) on ``bad_ranks``. Records the parameters each step starts from."""

    cells_per_sample = 1

    def __init__(self, model: nn.Module, bad_step: int, bad: float, bad_ranks: set[int]):
        self.model = model
        self.bad_step, self.bad, self.bad_ranks = bad_step, bad, bad_ranks
        self.started_from: list[list[torch.Tensor]] = []

    def batch(self, step: int) -> tuple[torch.Tensor, int]:
        self.started_from.append([p.detach().clone() for p in self.model.parameters()])
        generator = torch.Generator().manual_seed(step)
        return torch.randn(4, 3, generator=generator, dtype=torch.float64), step + 1

    def losses(self, model: nn.Module, batch: tuple[torch.Tensor, int]) -> dict[str, torch.Tensor]:
        inputs, step = batch
        error = model(inputs) - inputs.flip(-1)
        v = (error[:, 1:] ** 2).mean()
        if step == self.bad_step and torch.distributed.get_rank() in self.bad_ranks:
            v = v * self.bad
        return {"u": (error[:, :1] ** 2).mean(), "v": v}

    def evaluate(self, model: nn.Module, step: int) -> dict[str, float]:
        return {}

    def describe(self, metrics: Mapping[str, Any]) -> str:
        return ""


def _fit_toy(run_dir: str, nonfinite: str, bad_step: int, bad: float, bad_ranks: set[int]):
    """On every rank of a 2-rank data-parallel mesh: the real ``Trainer`` on ``_Toy`` for 4
    steps; the parameters each step started from and the final ones, or the error's message."""
    cfg = OmegaConf.structured(RunConfig)
    cfg.merge_with(
        {
            "run_dir": run_dir, "mesh": "2", "logger": {"kind": "none"},
            "optim": {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 0.1},
            "train": {
                "steps": 4, "checkpoint_every": 0, "eval_every": 100, "log_every": 1,
                "nonfinite": nonfinite, "schedule": {"warmup_steps": 0},
            },
        }
    )  # fmt: skip
    parallelism = Parallelism.build(ParallelPlan.of("2", ParallelConfig(), ("H", "W")), "cpu")
    context = RunContext(detect_launch_env(), parallelism, Path(run_dir), torch.device("cpu"))
    model = nn.Linear(3, 3).double()
    task = _Toy(model, bad_step, bad, bad_ranks)
    try:
        Trainer(context, cfg, model, task).fit()
    except NonFiniteLoss as error:
        return str(error)
    return [*task.started_from, [p.detach().clone() for p in model.parameters()]]


@pytest.mark.parametrize(
    ("bad", "bad_ranks", "said"),
    [(math.nan, {0, 1}, "nan"), (math.inf, {1}, "inf"), (-math.inf, {0}, "-inf")],
)
def test_a_nonfinite_loss_stops_every_rank_naming_the_step_and_the_field(
    tmp_path: Path, bad: float, bad_ranks: set[int], said: str
) -> None:
    """Also when only one replica's loss is bad: the ranks agree on the mean loss."""
    assert issubclass(NonFiniteLoss, USER_ERRORS)  # one line for the user, not a traceback
    messages = run_on_ranks(2, _fit_toy, str(tmp_path), "stop", 3, bad, bad_ranks)
    assert messages[0] == messages[1]
    assert messages[0].startswith(f"step 3: the loss of field 'v' is {said}; stopped"), messages


def test_a_nonfinite_loss_with_skip_leaves_the_parameters_of_that_step_and_goes_on(
    tmp_path: Path,
) -> None:
    per_rank = run_on_ranks(2, _fit_toy, str(tmp_path), "skip", 3, math.nan, {1})
    for started_from in per_rank:  # the parameters before steps 1-4, and after step 4
        assert len(started_from) == 5
        for before, after in zip(started_from[2], started_from[3]):
            assert torch.equal(before, after)  # step 3 changed nothing
        for step in (0, 1, 3):
            assert not torch.equal(started_from[step][0], started_from[step + 1][0]), step
    for mine, theirs in zip(per_rank[0][-1], per_rank[1][-1]):
        assert torch.equal(mine, theirs)


# Slow (a train.py start-up, about 7 s): by default the trainer's stop is checked on the pool
# above, and a rank's user error reaching the user as one line with exit status 2 is the
# stopped-rank test's path (the launcher's, for every class of USER_ERRORS).
@pytest.mark.slow
def test_a_diverging_run_stops_with_one_line(dataset: Path, tmp_path: Path, runs) -> None:
    """The real recipe with a learning rate that makes the loss NaN at step 2."""
    arguments = _train_py(
        dataset, tmp_path / "run", "2x1", "train.steps=6", "optim.lr=1e30",
        "train.schedule.warmup_steps=0",
    )  # fmt: skip
    run = runs(arguments, tmp_path / "log")
    assert run.wait() == 2
    assert "Traceback" not in run.stderr
    assert run.stderr.splitlines()[-1] == (
        "error: step 2: the loss of field 'vorticity' is nan; stopped (train.nonfinite=stop). "
        "Lower optim.lr, check the data, or set train.nonfinite=skip to skip such steps"
    )


# ---------------------------------------------------------------------------- (a), (b) resumption
STEPS = 12
CHECKPOINT_EVERY = 4
SMALL_FNO = ["model.modes=[4,4]", "model.width=8", "model.layers=2", "model.projection_channels=8"]
"""The recipe's FNO made small: what is checked (resumption from the last complete checkpoint,
bit for bit) does not depend on its size, and the recipe's own (2.4M parameters) made each run
here 2-4x slower (12 steps on the warm pool: 5.4-10.3 s against 2.1-2.4 s at load 40)."""


def _resumable(dataset: Path, run_dir: Path, *overrides: str) -> list[str]:
    return _train_py(
        dataset, run_dir, "2x1", f"train.steps={STEPS}", f"train.checkpoint_every={CHECKPOINT_EVERY}",
        "launcher.grace_s=60", *SMALL_FNO, *overrides,
    )  # fmt: skip


def _final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model and optimiser state of the run's checkpoint of step ``STEPS``, loaded in this
    (single) process into the model the runs trained."""
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=["+recipe=cfd", *SMALL_FNO])
    model = instantiate(cfg.model)
    optimizer = torch.optim.AdamW(model.parameters())
    load_checkpoint(run_dir / "checkpoints" / f"step_{STEPS:06d}", model, optimizer)
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    for index, moments in optimizer.state_dict()["state"].items():
        state.update({f"optimizer.{index}.{k}": v for k, v in moments.items()})
    return state


@pytest.fixture(scope="module")
def uninterrupted(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted run's final state: the recipe's rank body on the 2-rank pool, which
    computes what ``train.py``'s ranks do (the interrupted runs, through the command, must
    end with the same bits; a ``train.py`` start-up saved)."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    run_on_ranks(
        2, train_recipe_on_the_pool, _resumable(dataset, run_dir)[2:], timeout_s=RUN_TIMEOUT_S
    )
    return _final_state(run_dir)


def _assert_same_state(run_dir: Path, expected: dict[str, torch.Tensor]) -> None:
    """Bit for bit: the same steps on the same batches in the same order of operations."""
    got = _final_state(run_dir)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def _resumed_at(stdout: str) -> list[int]:
    return [int(step) for step in re.findall(r"^resumed from \S+ at step (\d+)$", stdout, re.M)]


def _after_a_checkpoint(run_dir: Path) -> Callable[[], bool]:
    """Whether a step after the first checkpoint was logged (so the kill lands mid-training)."""
    return lambda: max(_logged_steps(run_dir), default=0) > CHECKPOINT_EVERY


@pytest.mark.parametrize("launcher", ["torchrun", pytest.param("local", marks=pytest.mark.slow)])
def test_a_killed_rank_restarts_the_job_from_the_last_checkpoint_to_the_same_result(
    dataset: Path, tmp_path: Path, runs, uninterrupted: dict, launcher: str
) -> None:
    """SIGKILL of one rank under ``torchrun --max-restarts=1`` (or ``launcher.max_restarts=1``
    of ``train.py``'s own ranks): every rank restarts and resumes from the latest complete
    checkpoint."""
    run_dir = tmp_path / "run"
    if launcher == "torchrun":
        arguments = _torchrun(*_resumable(dataset, run_dir), max_restarts=1)
    else:
        arguments = _resumable(dataset, run_dir, "launcher.max_restarts=1")
    run = runs(arguments, tmp_path / "log")
    ranks = _rank_pids(run)
    _wait_until(run, _after_a_checkpoint(run_dir))
    os.kill(ranks[1], signal.SIGKILL)
    assert run.wait() == 0, run.stderr[-3000:]
    resumed = _resumed_at(run.stdout)
    assert len(resumed) == 1 and resumed[0] % CHECKPOINT_EVERY == 0 and resumed[0] < STEPS
    assert not [pid for pid in ranks if _alive(pid)]
    _assert_same_state(run_dir, uninterrupted)


@pytest.mark.parametrize("launcher", ["local", pytest.param("torchrun", marks=pytest.mark.slow)])
def test_sigterm_checkpoints_and_the_requeued_run_ends_at_the_same_result(
    dataset: Path, tmp_path: Path, runs, uninterrupted: dict, launcher: str
) -> None:
    """SIGTERM to the launching process (``train.py``, or torchrun's agent, which forwards it
    to its workers) stops every rank after an agreed step with a checkpoint of that step; the
    same configuration again (a requeued job) resumes from it. With ``train.py``'s own ranks
    this is also tests/test_launcher.py's SIGTERM case (its checks are here: the launcher says
    which signal, no traceback, no rank left), run once for both. The requeued run is the
    recipe's rank body on the 2-rank pool, what ``train.py``'s ranks compute (a ``train.py``
    start-up saved): a run of the command that resumes from the latest checkpoint is the
    killed-rank test's restart."""
    run_dir = tmp_path / "run"
    arguments = _resumable(dataset, run_dir, "train.checkpoint_every=0")
    overrides = arguments[2:]
    if launcher == "torchrun":
        arguments = _torchrun(*arguments)
    first = runs(arguments, tmp_path / "first")
    ranks = _rank_pids(first)
    _wait_until(first, lambda: max(_logged_steps(run_dir), default=0) >= 2)
    first.process.send_signal(signal.SIGTERM)
    status = first.wait()
    stopped_at = max(_logged_steps(run_dir))
    assert stopped_at < STEPS, "the run ended before SIGTERM reached it"
    assert status != 0 and f"stopped by SIGTERM after step {stopped_at}" in first.stdout
    if launcher == "local":
        assert status == exit_status(signal.SIGTERM), first.stderr[-3000:]
        assert "stopped by SIGTERM" in first.stderr
        assert "Traceback" not in first.stderr
        assert not [pid for pid in ranks if _alive(pid)]
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{stopped_at:06d}"
    logged = len(_logged_steps(run_dir))
    run_on_ranks(2, train_recipe_on_the_pool, overrides, timeout_s=RUN_TIMEOUT_S)
    assert _logged_steps(run_dir)[logged:] == list(range(stopped_at + 1, STEPS + 1))
    _assert_same_state(run_dir, uninterrupted)


# ---------------------------------------------------------------------------- (e) a bad data file
"""What Hydra writes in the run directory before any code of ours runs."""


def _truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _integers(path: Path) -> None:
    with h5py.File(path, "r+") as file:
        shape = file["vorticity"].shape
        del file["vorticity"]
        file["vorticity"] = np.zeros(shape, np.int32)


def _another_solver(path: Path) -> None:
    """A file of ours (from ``recipes/cfd/generate.py``) that an older solver wrote."""
    with h5py.File(path, "r+") as file:
        file.attrs["created_by"] = CREATED_BY
        file.attrs["solver_version"] = "shardsci-ns2d-ifrk4-v0"


DESCRIBES_TINY = [
    f"data.dataset.solver.resolution={TINY_DATA.solver.resolution}",
    f"data.dataset.n_train={TINY_DATA.n_train}",
    f"data.dataset.n_test={TINY_DATA.n_test}",
    f"data.dataset.n_snapshots={TINY_DATA.n_snapshots}",
]
"""``data.dataset`` describing the test's dataset, as a file of ours must be described."""


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_truncated, r" cannot be read as HDF5 \(truncated file"),
        # The two below are checked in-process in tests/test_user_data.py; here they only
        # repeat the entry point's path (about 8 s each).
        pytest.param(
            _integers,
            r": dataset 'vorticity' of shape \(6, 6, 32, 32\) has dtype int32; expected",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            _another_solver,
            r" .*: attribute 'solver_version' is 'shardsci-ns2d-ifrk4-v0', expected",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_a_bad_data_file_is_one_line_before_any_rank_starts(
    dataset: Path, tmp_path: Path, runs, damage: Callable[[Path], None], message: str
) -> None:
    """Through the real entry point; the rest of the cases are in tests/test_user_data.py."""
    path = tmp_path / "mine.h5"
    path.write_bytes(dataset.read_bytes())
    damage(path)
    before = path.read_bytes()
    arguments = _train_py(path, tmp_path / "run", "2x1", "train.steps=2", *DESCRIBES_TINY)
    run = runs(arguments, tmp_path / "log")
    assert run.wait() == 2, run.stderr[-3000:]
    assert re.fullmatch(rf"error: data file {path}{message}.*\n", run.stderr), run.stderr
    assert path.read_bytes() == before
    assert not (tmp_path / "run").exists(), "a run that failed before training left its directory"


# ---------------------------------------------------------------------------- (b) under SLURM
@pytest.mark.slow
def test_slurm_preemption_checkpoints_and_the_requeued_job_ends_at_the_same_result(
    dataset: Path, tmp_path: Path, uninterrupted: dict
) -> None:
    """``scancel --signal=TERM`` (what ``sbatch --signal=TERM@<s>`` sends before preemption)
    reaches every task of ``scripts/slurm/train.sbatch``; they stop after an agreed step with
    a checkpoint, and the job submitted again (a requeued job) resumes from it."""
    local_cluster_or_skip()
    run_dir = tmp_path / "run"
    overrides = _resumable(dataset, run_dir, "train.checkpoint_every=0")[2:]  # mesh=2x1 on

    def submit_job(name: str) -> int:
        return submit(
            ROOT / "scripts" / "slurm" / "train.sbatch",
            options=[
                "--ntasks=2", "--time=00:06:00", f"--output={tmp_path}/{name}-%j.out",
                f"--chdir={ROOT}",
                f"--export=ALL,SHARDSCI_PYTHON={sys.executable}",
            ],
            arguments=overrides,
            cwd=ROOT,
        )  # fmt: skip

    first = submit_job("first")
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while max(_logged_steps(run_dir), default=0) < 2:
            assert job_state(first) in ("PENDING", "RUNNING", "CONFIGURING"), job_state(first)
            assert time.monotonic() < deadline, "no training step within the startup timeout"
            time.sleep(0.1)
        signal_job(first, "TERM")
        preempted = wait_for_job(first, RUN_TIMEOUT_S)
    finally:
        if job_state(first) not in FINAL_STATES:
            signal_job(first, "KILL")
    stopped_at = max(_logged_steps(run_dir))
    assert stopped_at < STEPS, "the job ended before SIGTERM reached it"
    assert f"stopped by SIGTERM after step {stopped_at}" in preempted.stdout, preempted.stdout
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{stopped_at:06d}"
    requeued = wait_for_job(submit_job("requeued"), RUN_TIMEOUT_S)
    assert (requeued.state, requeued.exit_code) == ("COMPLETED", 0), requeued.stdout[-3000:]
    assert _resumed_at(requeued.stdout) == [stopped_at]
    _assert_same_state(run_dir, uninterrupted)
