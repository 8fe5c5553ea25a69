"""Every script in ``examples/`` runs on the ranks its docstring names and passes its own checks
against a single-process computation.

The ranks are started the way ``train.py`` starts local ranks (``run_local_ranks``: forked from
one process that imported torch once, each given the variables torchrun sets), all examples
from one such process, which costs a few seconds instead of a torchrun per example; each rank
of each example must say it ran (``rank <r>: ...``). Under torchrun itself (``-m slow``: the
torchrun launcher and ``init_distributed`` under it are the default run's in
tests/test_train_recipe.py and tests/test_faults.py) the zoo example runs as its docstring says.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {
    "zoo_model.py": 2,
    "custom_stencil.py": 4,
    "custom_handler.py": 2,
    "scatter_gather.py": 4,
    "uneven_softmax.py": 4,
}
_ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

_MARK = "=== example "
_RUN_ALL = """
import json, runpy, sys
import torch, torch._dynamo
from shardsci.training import run_local_ranks
examples, mark = json.loads(sys.argv[1]), sys.argv[2]
statuses = {}
for s, n in examples.items():
    print(f"{mark}{s}", flush=True)
    statuses[s] = run_local_ranks(n, runpy.run_path, f"examples/{s}")
print(json.dumps(statuses))
"""


@pytest.fixture(scope="module")
def statuses() -> tuple[dict[str, int], dict[str, str], str]:
    """Each example's exit status and what its ranks printed, and what the ranks wrote to
    stderr."""
    done = subprocess.run(
        [sys.executable, "-c", _RUN_ALL, json.dumps(EXAMPLES), _MARK],
        cwd=ROOT, env=_ENV, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    *sections, last = done.stdout.split(_MARK)
    printed = dict(section.split("\n", 1) for section in [*sections[1:], last])
    return json.loads(done.stdout.splitlines()[-1]), printed, done.stderr


def test_every_example_is_run() -> None:
    assert set(EXAMPLES) == {p.name for p in (ROOT / "examples").glob("*.py")}


@pytest.mark.parametrize(("script", "ranks"), EXAMPLES.items())
def test_the_example_runs_on_its_ranks(statuses, script: str, ranks: int) -> None:
    assert f"--nproc-per-node {ranks} examples/{script}" in (ROOT / "examples" / script).read_text()
    exit_statuses, printed, stderr = statuses
    assert exit_statuses[script] == 0, (
        f"examples/{script} failed on {ranks} ranks:\n{stderr[-4000:]}"
    )
    # The ranks' lines may interleave (each writes its text and its newline separately).
    said = sorted(int(rank) for rank in re.findall(r"rank (\d+): ", printed[script]))
    assert said == list(range(ranks)), printed[script]


@pytest.mark.slow  # about 12 s of torchrun start-up; see the module's docstring
def test_the_zoo_example_runs_under_torchrun() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "examples/zoo_model.py"],
        cwd=ROOT, env=_ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("OK") == 2
