"""Bring up the single-node SLURM cluster of ``scripts/slurm`` and run batch jobs on it.

``ensure_local_cluster()`` runs ``scripts/slurm/local_cluster.sh up``, which installs, configures
and starts the cluster, or reuses a running one; when that fails it raises
:class:`SlurmUnavailable` with the script's reason and whether SLURM could be installed here at
all. Tests call ``local_cluster_or_skip()``: a test is skipped where SLURM cannot be installed;
where it can but the cluster does not come up, it is skipped too, unless
``SHARDSCI_REQUIRE_SLURM=1`` (set by ``.ci/run``) makes that a failure, so a broken SLURM path
cannot leave CI green. ``submit_and_wait(script, timeout_s)`` (or ``submit`` then
``wait_for_job``, with ``signal_job`` in between)
submits a batch script with ``sbatch``, polls ``scontrol show job`` until the job ends and
returns its state, exit code and output files.

The cluster keeps no accounting (``accounting_storage/none``), so there is no ``sacct``: the
job's record in slurmctld, kept ``MinJobAge`` (300 s by default) after the job ends, is the
only place its final state and exit code can be read.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

CLUSTER_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "slurm" / "local_cluster.sh"
"""Script that installs, starts and stops the local cluster (``up``, ``down``, ``status``)."""

REQUIRE_VAR = "SHARDSCI_REQUIRE_SLURM"
"""Set to ``1`` to fail, not skip, SLURM tests whose cluster can be installed but not started."""

UP_TIMEOUT_S = 540.0
"""Seconds ``local_cluster.sh up`` may take, package installation included (below pytest's
600 s timeout, so a stuck installation skips the test with a reason instead of failing it)."""

COMMAND_TIMEOUT_S = 30.0
"""Seconds one ``sbatch``, ``scontrol`` or ``scancel`` call may take."""

FINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)
"""Job states after which a job runs no more (``COMPLETING`` is not one: tasks may still write)."""

_POLL_INTERVAL_S = 0.5
_ERROR_MARK = f"{CLUSTER_SCRIPT.name}: error: "
_CANNOT_INSTALL_STATUS = 3


class SlurmUnavailable(RuntimeError):
    """The local SLURM cluster cannot be brought up here; ``reason`` says why, ``installable``
    whether SLURM could be installed and started here at all (root, apt-get, packages)."""

    def __init__(self, reason: str, installable: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.installable = installable


class SlurmJobError(RuntimeError):
    """A batch job could not be submitted or followed to its end."""


@dataclass(frozen=True)
class JobResult:
    """How a batch job ended, and what it wrote."""

    job_id: int
    """SLURM job id."""

    state: str
    """Final job state, e.g. ``"COMPLETED"`` or ``"FAILED"``."""

    exit_code: int
    """Exit status of the batch script, or minus the signal number that killed it."""

    stdout: str
    """Contents of the job's output file (``#SBATCH --output``); empty if it was not written."""

    stderr: str
    """Contents of the job's error file (``#SBATCH --error``); the same text as ``stdout``
    when both go to one file."""


def ensure_local_cluster(timeout_s: float = UP_TIMEOUT_S) -> None:
    """Make sure the local single-node SLURM cluster is up, starting it if needed.

    Parameters
    ----------
    timeout_s
        Seconds to allow ``local_cluster.sh up``; a first run installs Debian packages.

    Raises
    ------
    SlurmUnavailable
        If the cluster cannot be brought up: the script is missing, it is not run as root,
        apt-get or the packages are missing, a daemon fails, or the node never becomes idle.
        ``reason`` carries the script's explanation.
    """
    if not CLUSTER_SCRIPT.is_file():
        raise SlurmUnavailable(
            f"{CLUSTER_SCRIPT} not found: shardsci is not installed from a source checkout",
            installable=False,
        )
    try:
        done = _run(["bash", str(CLUSTER_SCRIPT), "up"], timeout_s)
    except subprocess.TimeoutExpired:
        raise SlurmUnavailable(
            f"'{CLUSTER_SCRIPT.name} up' did not finish within {timeout_s:g} s"
        ) from None
    except FileNotFoundError:
        raise SlurmUnavailable(
            f"bash is not installed, so {CLUSTER_SCRIPT} cannot run", installable=False
        ) from None
    if done.returncode != 0:
        raise SlurmUnavailable(
            _script_failure(done), installable=done.returncode != _CANNOT_INSTALL_STATUS
        )


def local_cluster_or_skip() -> None:
    """For tests: the local cluster, up; else skip the test with the reason, or fail it when
    SLURM is installable here and ``SHARDSCI_REQUIRE_SLURM=1``."""
    import pytest

    try:
        ensure_local_cluster()
    except SlurmUnavailable as error:
        if error.installable and os.environ.get(REQUIRE_VAR) == "1":
            pytest.fail(
                f"{REQUIRE_VAR}=1, but the local SLURM cluster could be installed here and did "
                f"not come up: {error.reason}",
                pytrace=False,
            )
        pytest.skip(f"SLURM unavailable: {error.reason}")


def _script_failure(done: subprocess.CompletedProcess[str]) -> str:
    """The reason ``local_cluster.sh`` gave for failing, or the end of what it printed."""
    if _ERROR_MARK in done.stderr:
        return done.stderr.split(_ERROR_MARK, 1)[1].strip()
    output = (done.stderr or done.stdout).strip().splitlines()[-5:]
    return f"'{CLUSTER_SCRIPT.name} up' exited with status {done.returncode}: " + " | ".join(output)


def submit_and_wait(
    script_path: str | os.PathLike[str],
    timeout_s: float,
    *,
    options: Sequence[str] = (),
    arguments: Sequence[str] = (),
    cwd: str | os.PathLike[str] | None = None,
) -> JobResult:
    """Submit a batch script, wait for the job to end and collect its output.

    Parameters
    ----------
    script_path
        Batch script for ``sbatch``; its ``#SBATCH`` lines choose tasks, output files and the
        working directory. Output paths must not contain whitespace.
    timeout_s
        Seconds the job may take from submission to its end, queueing included. A job still
        running then is cancelled.
    options, arguments
        ``sbatch`` options (they override the script's ``#SBATCH`` lines) and the script's
        own arguments.
    cwd
        Directory to submit from (the job's ``SLURM_SUBMIT_DIR``).

    Returns
    -------
    JobResult
        The job's final state, exit code and the contents of its output and error files.

    Raises
    ------
    SlurmJobError
        If ``sbatch`` or ``scontrol`` fails, or slurmctld forgets the job before it ends.
    TimeoutError
        If the job has not ended after ``timeout_s`` seconds; it is cancelled first.
    """
    return wait_for_job(
        submit(script_path, options=options, arguments=arguments, cwd=cwd), timeout_s
    )


def wait_for_job(job_id: int, timeout_s: float) -> JobResult:
    """Wait for job ``job_id`` to end (cancelling it after ``timeout_s`` seconds, with a
    ``TimeoutError`` that shows the queue, so a job pending behind another says which) and
    collect its output, as ``submit_and_wait`` does."""
    deadline = time.monotonic() + timeout_s
    fields = _job_fields(job_id)
    while fields["JobState"] not in FINAL_STATES:
        if time.monotonic() > deadline:
            queue = _run_slurm(["squeue", "--format=%i %j %T %M %C %R"])
            _run_slurm(["scancel", str(job_id)])
            raise TimeoutError(
                f"SLURM job {job_id} was still {fields['JobState']} (reason: "
                f"{fields.get('Reason', '?')}) after {timeout_s:g} s; cancelled it. The queue "
                f"before that:\n{queue}"
            )
        time.sleep(_POLL_INTERVAL_S)
        fields = _job_fields(job_id)
    return JobResult(
        job_id=job_id,
        state=fields["JobState"],
        exit_code=_exit_code(fields["ExitCode"]),
        stdout=_read_output(fields.get("StdOut", "")),
        stderr=_read_output(fields.get("StdErr", "")),
    )


def submit(
    script_path: str | os.PathLike[str],
    *,
    options: Sequence[str] = (),
    arguments: Sequence[str] = (),
    cwd: str | os.PathLike[str] | None = None,
) -> int:
    """Submit a batch script with ``sbatch --parsable`` (see ``submit_and_wait``); the job id."""
    script = Path(script_path)
    if not script.is_file():
        raise SlurmJobError(f"batch script {script} does not exist")
    command = ["sbatch", "--parsable", *options, str(script.resolve()), *arguments]
    answer = _run_slurm(command, cwd=cwd).strip()
    job_id = answer.split(";", 1)[0]
    if not job_id.isdigit():
        raise SlurmJobError(f"sbatch answered {answer!r}, expected a job id")
    return int(job_id)


def signal_job(job_id: int, signal: str) -> None:
    """Send ``signal`` (``"TERM"``) to every task of the job's steps, as SLURM does before
    preempting a job submitted with ``--signal``: ``scancel --signal``."""
    _run_slurm(["scancel", f"--signal={signal}", str(job_id)])


def job_state(job_id: int) -> str:
    """The job's state now (``PENDING``, ``RUNNING``, one of ``FINAL_STATES``, ...)."""
    return _job_fields(job_id)["JobState"]


def _job_fields(job_id: int) -> dict[str, str]:
    """The ``Key=Value`` fields of ``scontrol show job --oneliner``."""
    line = _run_slurm(["scontrol", "show", "job", "--oneliner", str(job_id)])
    fields = dict(item.partition("=")[::2] for item in line.split())
    if "JobState" not in fields or "ExitCode" not in fields:
        raise SlurmJobError(f"scontrol describes job {job_id} without JobState/ExitCode: {line!r}")
    return fields


def _exit_code(value: str) -> int:
    """Exit status from scontrol's ``status:signal`` pair; minus the signal if one killed it."""
    status, _, signal = value.partition(":")
    return -int(signal) if signal and int(signal) else int(status)


def _read_output(path: str) -> str:
    """Contents of a job's output file, or ``""`` when it was not written."""
    if not path:
        return ""
    try:
        return Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _run_slurm(args: Sequence[str], cwd: str | os.PathLike[str] | None = None) -> str:
    """Run a SLURM client command; its standard output."""
    try:
        done = _run(args, COMMAND_TIMEOUT_S, cwd)
    except FileNotFoundError:
        raise SlurmJobError(
            f"{args[0]} is not installed: call ensure_local_cluster() first"
        ) from None
    except subprocess.TimeoutExpired:
        raise SlurmJobError(
            f"'{' '.join(args)}' did not answer within {COMMAND_TIMEOUT_S:g} s"
        ) from None
    if done.returncode != 0:
        raise SlurmJobError(
            f"'{' '.join(args)}' exited with status {done.returncode}: {done.stderr.strip()}"
        )
    return done.stdout


def _run(
    args: Sequence[str], timeout_s: float, cwd: str | os.PathLike[str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a command to completion with a timeout, capturing its output as text."""
    return subprocess.run(
        args, capture_output=True, text=True, timeout=timeout_s, check=False, cwd=cwd
    )
