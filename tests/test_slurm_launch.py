"""A real 8-task SLURM job on the local single-node cluster: launch detection, mesh, collectives.

The cluster comes from ``scripts/slurm/local_cluster.sh`` (installed and started on first use,
reused afterwards and left running). Where SLURM cannot be installed, the test is skipped with
the reason; where it can but the cluster does not come up, it fails under
``SHARDSCI_REQUIRE_SLURM=1`` (``.ci/run``) and is skipped otherwise.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shardsci.testing import slurm
from shardsci.testing.slurm import (
    JobResult,
    SlurmUnavailable,
    local_cluster_or_skip,
    submit_and_wait,
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
