"""``benchmarks.train_step_parts`` times the trainer's own step (NOTE [The parts of a step]).

The timed step is ``training_step`` itself, handed a task, an optimiser and a ``decide`` that
read a clock: it must leave the parameters the untimed step leaves (so a timing wrapper that
drifted from the step, e.g. a copy of its body that lost the clipping, fails), and charge each
part exactly the time between the calls that bound it (read on a fake clock that each call
advances by its own power of 2). The benchmark itself runs end to end on 2 ranks (slow).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import train_step_parts
from benchmarks.train_step_parts import (
    PARTS,
    WARMUP_STEPS,
    StepClock,
    summarise,
    timed_training_step,
)
from shardsci.training import training_step
from shardsci.training._precision import Precision

CPU = torch.device("cpu")
# The fake seconds each part's own work takes: any misplaced boundary mixes two of them.
SECONDS = {part: 2.0**index for index, part in enumerate(PARTS)}


class _FakeTime:
    """A clock that only the step's calls advance (wall and CPU alike)."""

    def __init__(self) -> None:
        self.now = 0.0

    def read(self) -> tuple[float, float]:
        return self.now, self.now

    def spend(self, part: str) -> None:
        self.now += SECONDS[part]


class _Regression:
    """A task whose batch and loss advance ``time`` by the batch's and forward's seconds."""

    cells_per_sample = 1

    def __init__(self, time: _FakeTime) -> None:
        generator = torch.Generator().manual_seed(3)
        self.inputs = torch.randn(5, 4, generator=generator, dtype=torch.float64)
        self.time = time

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.time.spend("batch")
        return self.inputs, self.inputs.flip(1) * 3

    def losses(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        self.time.spend("forward")
        inputs, targets = batch
        return {"y": F.mse_loss(model(inputs), targets), "l1": model(inputs).abs().mean()}


def _model(time: _FakeTime) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 4).double()
    model.weight.register_hook(lambda grad: time.spend("backward"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    optimizer.register_step_pre_hook(lambda *args: time.spend("optimizer"))
    return model, optimizer


@pytest.mark.parametrize("apply", [True, False])
def test_the_timed_step_is_the_trainers_step_with_each_part_charged(monkeypatch, apply):
    time = _FakeTime()
    monkeypatch.setattr(StepClock, "now", staticmethod(time.read))
    decided: list[Mapping[str, torch.Tensor]] = []

    def decide(terms: Mapping[str, torch.Tensor]) -> bool:
        time.spend("agree")
        decided.append(terms)
        return apply

    steps = []
    for timed in (False, True):
        model, optimizer = _model(time)
        clock = StepClock()
        step = timed_training_step(training_step, clock) if timed else training_step
        terms = step(model, optimizer, _Regression(time), 0, Precision.fp32, 1e-2, CPU, decide)
        steps.append(([p.detach().clone() for p in model.parameters()], terms))
    (untimed, untimed_terms), (timed_parameters, timed_terms) = steps
    for a, b in zip(untimed, timed_parameters):
        assert torch.equal(a, b)  # the same update: clipped to 1e-2, or none
    assert timed_terms.keys() == untimed_terms.keys() == decided[1].keys()
    assert all(torch.equal(timed_terms[k], untimed_terms[k]) for k in timed_terms)
    charged = {part: SECONDS[part] for part in PARTS if apply or part != "optimizer"}
    expected = {f"{part}_{c}": charged.get(part, 0.0) for part in PARTS for c in ("wall", "cpu")}
    assert clock.seconds == expected


# 40 s at load 18-20 (16 CPU s: two train.py runs' start-up, 3 steps of 2 ranks).
@pytest.mark.slow
def test_the_benchmark_times_two_ranks_of_train_py(capsys):
    """One tiny candidate (dp=2, FNO at 32², 3 steps): every part timed on both ranks."""
    arguments = ["--world", "2", "--labels", "dp=2", "--rounds", "1", "--steps", "3"]
    train_step_parts.main([*arguments, "--resolution", "32", "--batch", "2"])
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    (parts,) = [r for r in records if r["record"] == "parts"]
    assert parts["steps"] == 1 and parts["label"] == "dp=2"
    for part in (*PARTS, "gradient_wait"):
        assert parts[f"{part}_ms"]["wall"] > 0, part
    assert parts["step_wall_ms"] >= parts["backward_ms"]["wall"] + parts["forward_ms"]["wall"]


def test_train_step_parts_summary_on_written_parts(tmp_path):
    """The step is the slowest rank's sum of parts; the last rank to reach the gradient
    all-reduce is the one that waits least; warm-up steps are left out."""

    def record(rank: int, step: int, seconds: float, gradient_wait: float) -> str:
        parts = {f"{part}_{clock}": seconds for part in PARTS for clock in ("wall", "cpu")}
        return json.dumps(
            {"rank": rank, "step": step, **parts, "gradient_wait_wall": gradient_wait}
        )

    for rank, (seconds, wait) in enumerate([(0.1, 0.3), (0.2, 0.05)]):
        lines = [record(rank, step, 9.0, 9.0) for step in range(WARMUP_STEPS)]
        lines.append(record(rank, WARMUP_STEPS, seconds, wait))
        (tmp_path / f"rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    summary = summarise(tmp_path)
    assert summary["steps"] == 1
    assert summary["step_wall_ms"] == pytest.approx(len(PARTS) * 200.0)
    assert summary["all_ranks_cpu_ms"] == pytest.approx(len(PARTS) * 300.0)
    assert summary["last_arrival_gradient_wait_ms"] == pytest.approx(50.0)
