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


# constant -> what it prices: a dispatch path's ``added_us_per_call`` of a
# ``benchmarks.calibrate_dispatch`` summary, or ``factor``: its ``in_step_factor``
DISPATCH_MEASURED = {
    f"{machine}_{name}": what
    for machine in ("GLOO", "H200")
    for name, what in (
        ("HOST_US_PER_FAST_OP", "fast"),
        ("HOST_US_PER_PROPAGATION_OP", "propagation"),
        ("HOST_US_PER_HANDLER_OP", "handler"),
        ("HOST_US_PER_FUNCTION_CALL", "function"),
        ("HOST_CALLS_IN_STEP_FACTOR", "factor"),
    )
}


def _dispatch_runs(records: Path, what: str) -> list[float]:
    """Each ``calibrate_dispatch`` run's figure of ``what`` in ``records``: a path's µs a call,
    or the in-step factor of its 1-rank UNet step at the run's figures (``in_step_factor``)."""
    from benchmarks.calibrate_dispatch import in_step_factor

    figures = []
    for path in sorted(records.glob("*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        summary = [s for s in lines if s.get("record") == "summary" and "added_us_per_call" in s]
        if not summary:
            continue
        added = summary[0]["added_us_per_call"]
        if what != "factor":
            figures.append(added[what])
            continue
        unet = next(
            s
            for s in lines
            if s.get("model") == "unet" and "path_ops" in s and s.get("ranks", 1) == 1
        )
        step = {**unet, "cpu_s": {v: [s["median"]] for v, s in unet["cpu_ms"].items()}}
        figures.append(round(in_step_factor(step, added) / 1e3, 2))
    return figures


@pytest.mark.parametrize("constant", sorted(DISPATCH_MEASURED))
def test_a_dispatch_price_is_the_median_of_the_runs_its_docstring_names(constant: str) -> None:
    """NOTE [Host time by dispatch path]: each path's price and the in-step factor."""
    doc = " ".join(_docstrings()[constant].split())
    named = re.search(r"benchmarks/records/[\w./-]+", doc)
    assert named, f"{constant}'s docstring names no records folder"
    figures = _dispatch_runs(ROOT / named.group(0).rstrip(".)"), DISPATCH_MEASURED[constant])
    assert figures, f"{named.group(0)}: no calibrate_dispatch run"
    assert getattr(_machine, constant) == pytest.approx(statistics.median(figures), abs=0.05)
    for figure in figures:
        assert f"{figure:g}" in doc, f"{constant}'s docstring does not state the run's {figure}"


def test_the_presets_price_calls_by_their_path() -> None:
    """``gloo_cpu`` prices a call by path at this machine's figures (shared by ranks beyond the
    cores, as every host figure); the H100 preset at the H200 host's."""
    cpu, shared = gloo_cpu(1, cores=1, memory_bytes=2**30), gloo_cpu(4, cores=2, memory_bytes=2**30)
    for name in DISPATCH_MEASURED:
        field = name.split("_", 1)[1].lower()
        preset = cpu if name.startswith("GLOO") else Machine()
        assert getattr(preset, field) == getattr(_machine, name)
        if name.startswith("GLOO") and "FACTOR" not in name:
            assert getattr(shared, field) == 2 * getattr(_machine, name)


def test_the_flop_free_family_rates_are_the_medians_of_their_record():
    """NOTE [Calibrating the machine]: ``GLOO_FLOP_FREE_BYTES_PER_S`` is each family's median
    over the runs of ``benchmarks.calibrate``'s ``measure_flop_free_families`` its docstring
    names, and the docstring states each median."""
    records = ROOT / "benchmarks/records/2026-11-30-predicted-vs-measured"
    doc = " ".join(_docstrings()["GLOO_FLOP_FREE_BYTES_PER_S"].split())
    names = re.findall(r"``(families_\d\.jsonl)``", doc)
    runs = [
        json.loads(line)
        for name in names
        for line in (records / name).read_text().splitlines()
        if line.strip()
    ]
    assert names and len(runs) >= 3 and f"{len(runs)} runs" in doc
    for family, rate in _machine.GLOO_FLOP_FREE_BYTES_PER_S.items():
        median = statistics.median(r[family] for r in runs)
        assert rate == pytest.approx(median * 1e9, rel=1e-9), family
        assert f"{median:g}" in doc
