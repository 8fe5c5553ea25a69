"""A real 8-task SLURM job on the local single-node cluster: launch detection, mesh, collectives.

The cluster comes from ``scripts/slurm/local_cluster.sh`` (installed and started on first use,
reused afterwards and left running). Where SLURM cannot be installed, the test is skipped with
the reason; where it can but the cluster does not come up, it fails under
``SHARDSCI_REQUIRE_SLURM=1`` (``.ci/run``) and is skipped otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardsci.testing import slurm
from shardsci.testing.slurm import (
    CLUSTER_SCRIPT,
    FINAL_STATES,
    JobResult,
    SlurmUnavailable,
    job_state,
    local_cluster_or_skip,
    submit,
    submit_and_wait,
    wait_for_job,
)
from tests.slurm_job_check import DOMAIN_SIZE, DP_SIZE, expected_report

REPO_ROOT = Path(__file__).resolve().parents[1]
JOB_CHECK = REPO_ROOT / "tests" / "slurm_job_check.py"
NTASKS = DP_SIZE * DOMAIN_SIZE
JOB_TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def local_cluster() -> None:
    """The local SLURM cluster, up (see ``local_cluster_or_skip``)."""
    local_cluster_or_skip()


@pytest.mark.parametrize(
    ("installable", "required", "outcome"),
    [
        (False, "1", pytest.skip.Exception),
        (True, "1", pytest.fail.Exception),
        (True, "", pytest.skip.Exception),
        (False, "", pytest.skip.Exception),
    ],
)
def test_a_cluster_that_does_not_come_up_fails_only_when_ci_requires_slurm(
    monkeypatch: pytest.MonkeyPatch, installable: bool, required: str, outcome: type
) -> None:
    """Skips stay for machines where SLURM cannot be installed."""

    def broken() -> None:
        raise SlurmUnavailable("slurmctld exited after starting", installable)

    monkeypatch.setattr(slurm, "ensure_local_cluster", broken)
    monkeypatch.setenv(slurm.REQUIRE_VAR, required)
    with pytest.raises(outcome, match="slurmctld exited after starting"):
        local_cluster_or_skip()


def test_the_cluster_script_says_when_slurm_cannot_be_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Exit status 3 of ``local_cluster.sh up`` (not root, no apt-get) means not installable."""
    statuses = {3: False, 1: True}
    for status, installable in statuses.items():
        done = subprocess.CompletedProcess([], status, "", "local_cluster.sh: error: why\n")
        monkeypatch.setattr(slurm, "_run", lambda *args, done=done: done)
        with pytest.raises(SlurmUnavailable) as raised:
            slurm.ensure_local_cluster()
        assert (raised.value.installable, raised.value.reason) == (installable, "why")


def _free_port() -> int:
    """A TCP port that was free on this host a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _write_job_script(directory: Path) -> Path:
    """An sbatch script running the job check on ``NTASKS`` tasks, its output in ``directory``."""
    script = directory / "slurm_job_check.sbatch"
    script.write_text(
        f"""#!/bin/bash
#SBATCH --job-name=shardsci-launch-check
#SBATCH --ntasks={NTASKS}
#SBATCH --time=00:05:00
#SBATCH --chdir={REPO_ROOT}
#SBATCH --output={directory}/job.out
#SBATCH --error={directory}/job.err
set -euo pipefail
export MASTER_PORT={_free_port()}
export OMP_NUM_THREADS=1
srun --kill-on-bad-exit=1 {sys.executable} {JOB_CHECK}
"""
    )
    return script


def _rank_reports(result: JobResult) -> dict[int, dict[str, object]]:
    """The JSON line each rank printed, by rank."""
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return {report["rank"]: report for report in reports}


# Slow (about 40 s): test_train_recipe's sbatch job runs the recipe through
# scripts/slurm/train.sbatch on 4 tasks by default, which needs the same detection.
@pytest.mark.slow
@pytest.mark.usefixtures("local_cluster")
def test_sbatch_job_detects_slurm_and_reduces_over_mesh(tmp_path: Path) -> None:
    result = submit_and_wait(_write_job_script(tmp_path), timeout_s=JOB_TIMEOUT_S)
    job = f"job {result.job_id}\n--- stdout\n{result.stdout}--- stderr\n{result.stderr}"

    assert (result.state, result.exit_code) == ("COMPLETED", 0), job
    reports = _rank_reports(result)
    assert sorted(reports) == list(range(NTASKS)), job
    for rank, report in reports.items():
        expected = {"rank": rank, **expected_report(rank), "mismatches": []}
        assert report == expected, job


def _process_tree(roots: list[int]) -> list[int]:
    """``roots`` and every process descended from them, read from ``/proc``."""
    parents = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue
        if entry.name.isdigit():
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, grew = set(roots), True
    while grew:
        children = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= children
        grew = bool(children)
    return sorted(tree)


def _job_steps(job_id: int) -> list[int]:
    """The pids of job ``job_id``'s ``slurmstepd`` processes on this host."""
    found = subprocess.run(
        ["pgrep", "-f", rf"^slurmstepd: \[{job_id}\."], capture_output=True, text=True
    )
    return [int(pid) for pid in found.stdout.split()]


def _wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s"
        time.sleep(0.2)


# Slow (about 10 s: the cluster taken down and brought up again): it checks the test
# cluster's own script (`local_cluster.sh up` recovering after a restart), not shardsci.
@pytest.mark.slow
@pytest.mark.usefixtures("local_cluster")
def test_a_restarted_cluster_cancels_saved_jobs_whose_processes_are_gone(tmp_path: Path) -> None:
    """A machine restored from a snapshot taken while a job ran: slurmctld recovers the job as
    running though its processes are gone, and would hold its CPUs until its time limit (a CI
    run's 8-task job once pended 180 s behind one). ``local_cluster.sh up`` cancels it."""
    script = tmp_path / "sleeper.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --ntasks=1\n#SBATCH --time=00:05:00\n"
        f"#SBATCH --output={tmp_path}/sleeper.out\nexec sleep 300\n"
    )
    job = submit(script)
    try:
        _wait_until(lambda: job_state(job) == "RUNNING" and _job_steps(job), 60, "running job")
        processes = _process_tree(_job_steps(job))
        subprocess.run(["bash", str(CLUSTER_SCRIPT), "down"], check=True, capture_output=True)
        for pid in processes:
            os.kill(pid, signal.SIGKILL)
        up = subprocess.run(["bash", str(CLUSTER_SCRIPT), "up"], capture_output=True, text=True)
        assert up.returncode == 0, up.stderr
        assert f"cancelling job {job}: saved as running since" in up.stderr, up.stderr
        _wait_until(lambda: job_state(job) in FINAL_STATES, 30, "final state of the saved job")
    finally:
        subprocess.run(["scancel", str(job)], capture_output=True)


@pytest.mark.usefixtures("local_cluster")
def test_a_job_that_pends_past_its_timeout_is_cancelled_and_the_error_shows_the_queue(
    tmp_path: Path,
) -> None:
    script = tmp_path / "later.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH --output={tmp_path}/later.out\ntrue\n")
    job = submit(script, options=["--begin=now+1hour"])
    with pytest.raises(TimeoutError, match=rf"(?s)still PENDING \(reason: BeginTime\).*{job} "):
        wait_for_job(job, timeout_s=1)
    assert job_state(job) == "CANCELLED"
