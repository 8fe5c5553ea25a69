"""Start the ranks of a run on this machine when no launcher did, and behave like torchrun.

NOTE [Ranks forked by train.py behave like torchrun's]
``python train.py mesh=4x2`` without torchrun or SLURM variables forks its ranks from the
process that composed and checked the config (cheap after ``import torch``; safe because that
process has run no torch op, holds no open HDF5 file, has touched no GPU and runs no store
thread), gives each rank the variables torchrun would set and the run's checked plan as it is
(``run_ranks``; NOTE [A run is planned once]), and behaves like torchrun:

- SIGTERM or SIGINT to this process is forwarded to every rank (NOTE [Stopping a run on a
  signal]: the ranks stop after an agreed step and save a checkpoint); ranks still alive
  ``launcher.grace_s`` later are killed; this process exits with ``128 + signum``.
- A rank that fails or dies makes this process stop the others (SIGTERM, then SIGKILL after
  the grace period) and report that rank's error once, from the error file the rank wrote:
  one line for a user error (NOTE [Errors for people]), the traceback for anything else. The
  exit status is the rank's (``128 + signum`` if a signal killed it).
- ``launcher.max_restarts`` restarts all ranks after a failure (``train.resume=auto`` then
  resumes from the last complete checkpoint).
- Every rank dies with this process (``PR_SET_PDEATHSIG``, SIGKILL), so no rank outlives a
  launcher that was killed without a chance to forward anything.

Why not torch's own agent (``torch.distributed.launcher.api.elastic_launch``, what torchrun
runs), measured with ``scripts/launcher_startup.py`` (8 ranks joining a gloo group and passing
a barrier, on the 2-core machine while other jobs ran): with ``start_method="fork"`` it starts
in about 1 s (0.5 s more than a plain fork), but 4 launches in 20 hung: one rank blocked for
good connecting to the agent's TCPStore, forked while the store's server thread ran in the
agent. Its safe start methods cost the startup this file avoids: ``forkserver`` 9-18 s and
``spawn`` 106-163 s per launch against 1.2-4 s for ``fork`` in the same runs. So the agent's
behaviour is rebuilt here, on plain forks made before any store exists.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import json
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from shardsci.distributed import LaunchEnv
from shardsci.training._errors import EXIT_USER_ERROR, USER_ERRORS, traceback_requested
from shardsci.training._parallelism import ParallelPlan
from shardsci.training._signals import STOP_SIGNALS, exit_on_stop_signals, exit_status

__all__ = ["LauncherConfig", "LauncherKind", "run_local_ranks", "run_ranks"]

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.2


class LauncherKind(enum.Enum):
    """How the ranks of a run are started (``launcher.kind``)."""

    local = "local"
    """Without torchrun or SLURM variables, ``train.py`` starts the mesh's ranks here."""
    slurm = "slurm"
    """Hydra's submitit launcher submits the job (``python train.py -m ... launcher=slurm``)."""


@dataclass
class LauncherConfig:
    """How the ranks are started and stopped (the ``launcher`` group).

    Attributes
    ----------
    kind : LauncherKind
        ``local``: without torchrun or SLURM variables, ``train.py`` starts the mesh's ranks
        here; ``slurm``: Hydra's submitit launcher submits the job (``-m`` runs).
    timeout_s : float
        Timeout of every collective: a rank left waiting fails with a message after this long.
    grace_s : float
        After a stop signal or a rank's failure, how long the other ranks may take to save
        and exit before they are killed.
    max_restarts : int
        Restarts of all ranks after one fails (local launches; torchrun has
        ``--max-restarts``).
    """

    kind: LauncherKind = LauncherKind.local
    timeout_s: float = 600.0
    grace_s: float = 30.0
    max_restarts: int = 0


def run_ranks(
    cfg: DictConfig,
    plan: ParallelPlan,
    env: LaunchEnv,
    body: Callable[[DictConfig, ParallelPlan], Any],
) -> int:
    """Run ``body(cfg, plan)`` on every rank of ``plan``: here, when torchrun or srun started
    this process or the plan has one rank; else on ranks forked here, which take ``plan`` as it
    is (NOTE [A run is planned once]). The run's exit status.
    """
    if env.launcher != "single" or plan.world_size == 1:
        body(cfg, plan)
        return 0
    OmegaConf.resolve(cfg)  # one run directory for every rank, resolved here
    return run_local_ranks(
        plan.world_size,
        body,
        cfg,
        plan,
        grace_s=cfg.launcher.grace_s,
        max_restarts=cfg.launcher.max_restarts,
    )


def run_local_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    grace_s: float = 30.0,
    max_restarts: int = 0,
) -> int:
    """Run ``fn(*args)`` on ``world_size`` forked ranks; return the run's exit status.

    See NOTE [Ranks forked by train.py behave like torchrun's].

    Returns
    -------
    int
        0 when every rank succeeded; ``128 + signum`` when a stop signal ended the run; else
        the status of the first rank that failed (``128 + signum`` for one a signal killed).
    """
    for attempt in range(max_restarts + 1):
        job = _Job(world_size, attempt, grace_s)
        status = job.run(fn, args)
        if status == 0 or job.stopped_by is not None or attempt == max_restarts:
            return status
        print(
            f"restarting all {world_size} ranks ({attempt + 1} of {max_restarts})",
            file=sys.stderr,
            flush=True,
        )
    return status


@dataclass(frozen=True)
class _Exit:
    """How a rank ended."""

    rank: int
    pid: int
    exitcode: int
    error_file: Path

    @property
    def status(self) -> int:
        return self.exitcode if self.exitcode >= 0 else exit_status(-self.exitcode)

    def blame_order(self) -> int:
        """Among ranks that ended together, which most likely caused the others to fail:
        one killed by a signal, then one with a user error, then the rest."""
        if self.exitcode < 0:
            return 0
        return 1 if self.exitcode == EXIT_USER_ERROR else 2


class _Job:
    """One attempt: fork the ranks, watch them, forward stop signals, report a failure."""

    def __init__(self, world_size: int, attempt: int, grace_s: float):
        self.world_size = world_size
        self.attempt = attempt
        self.grace_s = grace_s
        self.stopped_by: signal.Signals | None = None
        self._processes: list[multiprocessing.Process] = []
        self._deadline: float | None = None

    def run(self, fn: Callable[..., Any], args: tuple) -> int:
        with tempfile.TemporaryDirectory(prefix="shardsci-ranks-") as errors:
            with self._forwarding_stop_signals() as forked:
                self._fork(fn, args, Path(errors))
                forked()
                failure = self._wait()
            if self.stopped_by is not None:
                print(f"stopped by {self.stopped_by.name}", file=sys.stderr, flush=True)
                return exit_status(self.stopped_by)
            if failure is not None:
                _report(failure)
                return failure.status
        return 0

    # ------------------------------------------------------------------ start
    def _fork(self, fn: Callable[..., Any], args: tuple, errors: Path) -> None:
        context = multiprocessing.get_context("fork")
        threads = max(1, (os.cpu_count() or 1) // self.world_size)
        port = _free_port()
        for rank in range(self.world_size):
            env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(self.world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": str(threads),
                "TORCHELASTIC_RESTART_COUNT": str(self.attempt),
            }
            error_file = errors / f"rank{rank}.json"
            process = context.Process(
                target=_rank_main,
                args=(os.getpid(), env, threads, error_file, fn, args),
                name=f"rank{rank}",
            )
            process.start()
            process.error_file = error_file  # type: ignore[attr-defined]
            self._processes.append(process)

    @contextlib.contextmanager
    def _forwarding_stop_signals(self) -> Iterator[Callable[[], None]]:
        """Forward stop signals to every rank. They are blocked until the caller says the
        ranks are forked (the ranks inherit the mask and unblock it once their own handlers
        are in place), so none is lost or half-handled in between."""
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        handlers = {s: signal.signal(s, self._forward) for s in STOP_SIGNALS}
        try:
            yield lambda: signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            for signum, handler in handlers.items():
                signal.signal(signum, handler)

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        if self.stopped_by is None:
            self.stopped_by = signal.Signals(signum)
        self._signal_all(signum)

    # ------------------------------------------------------------------ watch
    def _wait(self) -> _Exit | None:
        """Reap every rank; the first failure (None if none failed)."""
        pending = {p.sentinel: (rank, p) for rank, p in enumerate(self._processes)}
        failure: _Exit | None = None
        while pending:
            ready = wait(list(pending), timeout=_POLL_S)
            ended = []
            for sentinel in ready:
                rank, process = pending.pop(sentinel)
                process.join()
                error_file = process.error_file  # type: ignore[attr-defined]
                ended.append(_Exit(rank, process.pid, process.exitcode, error_file))
            failed = sorted((e for e in ended if e.exitcode != 0), key=_Exit.blame_order)
            if failed and failure is None:
                failure = failed[0]
                if self.stopped_by is None:
                    self._signal_all(signal.SIGTERM)
            if self.stopped_by is not None or failure is not None:
                self._deadline = self._deadline or time.monotonic() + self.grace_s
            if self._deadline is not None and time.monotonic() > self._deadline:
                self._signal_all(signal.SIGKILL)
        return failure

    def _signal_all(self, signum: int) -> None:
        for process in self._processes:
            if process.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signum)


# ---------------------------------------------------------------------------- in the rank
def _rank_main(
    parent: int,
    env: dict[str, str],
    threads: int,
    error_file: Path,
    fn: Callable[..., Any],
    args: tuple,
) -> None:
    """The body of a rank: dies with its parent, stops cleanly on a signal, and leaves what
    ended it in ``error_file`` for the parent to report."""
    _die_with(parent)
    exit_on_stop_signals()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    os.environ.update(env)
    torch.set_num_threads(threads)
    try:
        fn(*args)
    except USER_ERRORS as error:
        _write_error(error_file, error, user=True)
        raise SystemExit(EXIT_USER_ERROR) from None
    except Exception as error:
        _write_error(error_file, error, user=False)
        raise SystemExit(1) from None


def _die_with(parent: int) -> None:
    """Ask Linux to SIGKILL this process when ``parent`` dies (no-op elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(exit_status(signal.SIGKILL))


def _write_error(path: Path, error: Exception, user: bool) -> None:
    record = {
        "user": user,
        "message": str(error) if user else f"{type(error).__name__}: {error}",
        "traceback": traceback.format_exc(),
    }
    path.write_text(json.dumps(record))


# ---------------------------------------------------------------------------- in the parent
def _report(failure: _Exit) -> None:
    """Print what ended the run, once."""
    stopped = {exit_status(s): s.name for s in STOP_SIGNALS}
    record = json.loads(failure.error_file.read_text()) if failure.error_file.is_file() else None
    if failure.exitcode < 0:
        name = signal.Signals(-failure.exitcode).name
        line = f"error: rank {failure.rank} (pid {failure.pid}) was killed by {name}"
    elif record is None and failure.exitcode in stopped:
        line = f"stopped by {stopped[failure.exitcode]} (sent to rank {failure.rank})"
    elif record is None:
        line = f"error: rank {failure.rank} exited with status {failure.exitcode}"
    elif record["user"] and not traceback_requested():
        line = f"error: {record['message']}"
    else:
        line = f"{record['traceback'].rstrip()}\nerror: rank {failure.rank} failed"
    if record is None or not record["user"]:
        line += "; the other ranks were stopped"
    print(line, file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
