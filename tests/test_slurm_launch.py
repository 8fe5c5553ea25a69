"""A real 8-task SLURM job on the local single-node cluster: launch detection, mesh, collectives.

The cluster comes from ``scripts/slurm/local_cluster.sh`` (installed and started on first use,
reused afterwards and left running). Where it cannot be brought up, the test is skipped with
the reason.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

from shardsci.testing.slurm import (
    JobResult,
    SlurmUnavailable,
    ensure_local_cluster,
    submit_and_wait,
)
from tests.slurm_job_check import DOMAIN_SIZE, DP_SIZE, expected_report

REPO_ROOT = Path(__file__).resolve().parents[1]
JOB_CHECK = REPO_ROOT / "tests" / "slurm_job_check.py"
NTASKS = DP_SIZE * DOMAIN_SIZE
JOB_TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def local_cluster() -> None:
    """The local SLURM cluster, up; skips the test with the reason when it cannot be."""
    try:
        ensure_local_cluster()
    except SlurmUnavailable as error:
        pytest.skip(f"SLURM unavailable: {error.reason}")


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
