"""The machine presets' measured figures agree with the records their docstrings name
(NOTE [One machine model] in ``shardsci/planning/_machine.py``): a figure changed without a
rerun, or a rerun that did not change the figure, fails here."""

from __future__ import annotations

import ast
import itertools
import json
import re
import statistics
from pathlib import Path

import pytest

from shardsci.planning import _machine
from shardsci.planning._machine import Machine, gloo_cpu

ROOT = Path(__file__).resolve().parents[1]

# constant -> the ``benchmarks.calibrate`` summary field it is the median of
MEASURED = {
    "GLOO_HOST_US_PER_OP": "host_us_per_op",
    "GLOO_PLAIN_HOST_US_PER_OP": "plain_host_us_per_op",
    "GLOO_HOST_US_PER_COMMUNICATION_OP": "host_us_per_communication_op",
}


def _docstrings() -> dict[str, str]:
    """Module constant -> the string literal that follows its assignment."""
    body = ast.parse(Path(_machine.__file__).read_text()).body
    found = {}
    for statement, after in itertools.pairwise(body):
        if (
            isinstance(statement, ast.Assign)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            found[statement.targets[0].id] = after.value.value
    return found


def _summaries(records: Path) -> list[dict]:
    summaries = []
    for path in sorted(records.glob("calibrate_*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        summaries += [line for line in lines if line.get("record") == "summary"]
    return summaries


@pytest.mark.parametrize("constant", sorted(MEASURED))
def test_a_measured_preset_is_the_median_of_the_runs_its_docstring_names(constant: str) -> None:
    doc = " ".join(_docstrings()[constant].split())
    named = re.search(r"benchmarks/records/[\w./-]+", doc)
    assert named, f"{constant}'s docstring names no records folder"
    records = ROOT / named.group(0).rstrip(".")
    figures = [s[MEASURED[constant]] for s in _summaries(records) if MEASURED[constant] in s]
    assert len(figures) >= 2, f"{records}: fewer than two calibrate runs with the figure"
    assert getattr(_machine, constant) == pytest.approx(statistics.median(figures), abs=0.05)
    for figure in figures:  # every run's figure is stated
        assert f"{figure:g}" in doc, f"{constant}'s docstring does not state the run's {figure}"


def test_the_presets_take_the_measured_figures() -> None:
    """``gloo_cpu`` with a core per rank charges the measured figures; the H100 preset assumes
    them (its host core as fast as this machine's, NOTE [One price per op])."""
    cpu = gloo_cpu(1, cores=1, memory_bytes=2**30)
    for machine in (cpu, Machine()):
        assert machine.host_us_per_op == _machine.GLOO_HOST_US_PER_OP
        assert machine.plain_host_us_per_op == _machine.GLOO_PLAIN_HOST_US_PER_OP
        assert machine.host_us_per_communication_op == _machine.GLOO_HOST_US_PER_COMMUNICATION_OP
    shared = gloo_cpu(4, cores=2, memory_bytes=2**30)
    assert shared.host_us_per_communication_op == 2 * _machine.GLOO_HOST_US_PER_COMMUNICATION_OP
