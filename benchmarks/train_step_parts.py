"""Where a ``parallel=auto`` candidate's training step waits: each part of ``train.py``'s steps
timed on every rank, wall and CPU (issue 22, item 1).

# NOTE [The parts of a step]
Each candidate of ``--labels`` (``parallel_auto``'s labels, e.g. ``"dp=8"``, ``"dp=4 x slab
H=2"``) is trained as ``parallel_auto`` trains it (``train.py``, the CFD recipe), its ranks
started with ``benchmarks/_step_parts`` on ``PYTHONPATH``: that directory's
``sitecustomize`` calls ``install_step_clock``, which wraps the trainer's ``training_step``
(the real one, called as it is: ``timed_training_step`` only hands it a task, an optimiser and a
``decide`` that read a clock as the step calls them) and the gradient reducer's end of
backward. Parts: ``batch``,
``forward`` (the loss terms, whole), ``backward`` (including ``gradient_wait``: the end of
backward launching the remaining buckets and waiting for every bucket's all-reduce), ``agree``
(the loss and stop-signal all-reduce), ``optimizer``; each part ends where the step makes
the call that begins the next (``task.batch`` returns; ``optimizer.zero_grad``; ``decide`` is
called; ``decide`` returns; the step returns), so the parts add up to the whole call. A rank's ``gradient_wait`` is the
all-reduce plus the time it waits for the last rank to finish its backward: the last rank to
arrive (``last_arrival``) waits least, and its wait is the all-reduce alone. Per candidate and
round: the step's wall time (the slowest rank's sum of parts, median over the steps after
``WARMUP_STEPS``), the CPU seconds of all ranks together, each part's median over ranks
and steps, and each rank's parts (``by_rank_ms``, medians over its steps). The candidates are interleaved, their order reversed every round.

Run ``python -m benchmarks.train_step_parts [--world 8] [--labels "dp=8" "dp=4 x slab H=2"]
[--rounds 2] [--steps 8]``; JSON lines: ``parts`` per candidate and round, ``summary``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir

from benchmarks._common import emit, emit_summary, parse_arguments
from benchmarks.parallel_auto import ROOT, candidate_overrides, recipe_overrides
from shardsci.planning import choose

PARTS = ("batch", "forward", "backward", "agree", "optimizer")
WARMUP_STEPS = 2
CLOCKS = ("wall", "cpu")


class StepClock:
    """Wall and CPU seconds charged to the named parts of one step (``seconds``:
    ``"<part>_wall"`` and ``"<part>_cpu"``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._mark = self.now()

    @staticmethod
    def now() -> tuple[float, float]:
        return time.perf_counter(), time.process_time()

    def add(self, part: str, since: tuple[float, float]) -> None:
        """Charge ``part`` the seconds from ``since`` to now."""
        for clock, start, end in zip(CLOCKS, since, self.now()):
            key = f"{part}_{clock}"
            self.seconds[key] = self.seconds.get(key, 0.0) + end - start

    def charge(self, part: str) -> None:
        """Charge ``part`` the seconds since the last charge (or the clock's start)."""
        self.add(part, self._mark)
        self._mark = self.now()


class _BatchEnds:
    """``task`` whose ``batch`` charges the ``batch`` part as it returns."""

    def __init__(self, task: Any, clock: StepClock) -> None:
        self._task, self._clock = task, clock

    def batch(self, step: int) -> Any:
        batch = self._task.batch(step)
        self._clock.charge("batch")
        return batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)


class _ForwardEnds:
    """``optimizer`` whose ``zero_grad`` charges the ``forward`` part first: the step zeroes
    the gradients between its whole loss terms and its backward pass."""

    def __init__(self, optimizer: torch.optim.Optimizer, clock: StepClock) -> None:
        self._optimizer, self._clock = optimizer, clock

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._clock.charge("forward")
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


def timed_training_step(step_function: Callable, clock: StepClock) -> Callable:
    """``step_function`` (``training_step``'s signature) with its parts charged to ``clock``
    (NOTE [The parts of a step]): the real step runs, on a task, an optimiser and a ``decide``
    that charge the part each call ends."""

    def step(model, optimizer, task, index, precision, grad_clip, device, decide=None):
        def timed_decide(terms: Mapping[str, torch.Tensor]) -> bool:
            clock.charge("backward")
            apply = decide is None or decide(terms)
            clock.charge("agree")
            return apply

        terms = step_function(
            model,
            _ForwardEnds(optimizer, clock),
            _BatchEnds(task, clock),
            index,
            precision,
            grad_clip,
            device,
            timed_decide,
        )
        clock.charge("optimizer")
        return terms

    return step


def install_step_clock(parts_dir: str) -> None:
    """Time every step of the trainer in this process: ``training_step`` by
    ``timed_training_step``, the gradient reducer's end of backward as ``gradient_wait``; one
    JSON line per step (``rank``, ``step``, the clock's seconds) appended to
    ``parts_dir/rank<r>.jsonl``."""
    import torch.distributed as dist

    import shardsci.parallel._reducer as reducer
    import shardsci.training._trainer as trainer

    step_function, end_backward = trainer.training_step, reducer.GradientReducer._end_backward
    current = [StepClock()]

    def step(model, optimizer, task, index, *args, **kwargs):
        current[0] = clock = StepClock()
        terms = timed_training_step(step_function, clock)(
            model, optimizer, task, index, *args, **kwargs
        )
        record = {"rank": dist.get_rank(), "step": index, **clock.seconds}
        path = Path(parts_dir) / f"rank{dist.get_rank()}.jsonl"
        with path.open("a") as parts:
            parts.write(json.dumps(record) + "\n")
        return terms

    def timed_end_backward(self) -> None:
        since = StepClock.now()
        end_backward(self)
        current[0].add("gradient_wait", since)

    trainer.training_step = step
    reducer.GradientReducer._end_backward = timed_end_backward


def run_parts(overrides: list[str], steps: int, parts_dir: Path, run_dir: Path) -> None:
    """Train ``steps`` steps of ``overrides``, each rank's parts into ``parts_dir``."""
    command = [
        sys.executable,
        "train.py",
        *overrides,
        f"train.steps={steps}",
        f"train.log_every={steps}",
        f"train.eval_every={10 * steps}",
        "train.checkpoint_every=0",
        f"run_dir={run_dir}",
    ]
    probe = os.pathsep.join((str(ROOT / "benchmarks" / "_step_parts"), str(ROOT)))
    env = dict(os.environ, STEP_PARTS_DIR=str(parts_dir), PYTHONPATH=probe)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")


def summarise(parts_dir: Path) -> dict:
    """The step's wall ms, all ranks' CPU ms and each part's median (NOTE [The parts of a
    step])."""
    steps: dict[int, list[dict]] = {}
    for path in parts_dir.glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            steps.setdefault(record["step"], []).append(record)
    timed = [ranks for step, ranks in sorted(steps.items()) if step >= WARMUP_STEPS]
    if not timed:
        raise SystemExit(f"no step after the first {WARMUP_STEPS} in {parts_dir}")
    records = [r for ranks in timed for r in ranks]

    def step_sum(record: dict, clock: str) -> float:
        return sum(record[f"{part}_{clock}"] for part in PARTS)

    def median_ms(values) -> float:
        return round(statistics.median(values) * 1e3, 1)

    last = [min(ranks, key=lambda r: r.get("gradient_wait_wall", 0.0)) for ranks in timed]
    return {
        "steps": len(timed),
        "step_wall_ms": median_ms(max(step_sum(r, "wall") for r in ranks) for ranks in timed),
        "all_ranks_cpu_ms": median_ms(sum(step_sum(r, "cpu") for r in ranks) for ranks in timed),
        **{
            f"{part}_ms": {
                clock: median_ms(r.get(f"{part}_{clock}", 0.0) for r in records) for clock in CLOCKS
            }
            for part in (*PARTS, "gradient_wait")
        },
        "last_arrival_gradient_wait_ms": median_ms(r.get("gradient_wait_wall", 0.0) for r in last),
        "by_rank_ms": {
            rank: {
                f"{part}_{clock}": median_ms(r.get(f"{part}_{clock}", 0.0) for r in mine)
                for part in (*PARTS, "gradient_wait")
                for clock in CLOCKS
            }
            for rank, mine in sorted(_by_rank(records).items())
        },
    }


def _by_rank(records: list[dict]) -> dict[int, list[dict]]:
    ranks: dict[int, list[dict]] = {}
    for record in records:
        ranks.setdefault(record["rank"], []).append(record)
    return ranks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--labels", nargs="+", default=["dp=8", "dp=4 x slab H=2"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="training steps per run")
    parser.add_argument("--resolution", type=int, default=64, help="H = W of the data")
    parser.add_argument("--batch", type=int, default=16, help="global batch")
    parser.add_argument("--model", default="fno", help="configs/model/<name>")
    args = parse_arguments(parser, argv)
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must exceed the {WARMUP_STEPS} warm-up steps")
    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
            cfg = compose("config", overrides=[*recipe_overrides(args), f"run_dir={scratch}"])
        candidates = {c.label: c for c in choose(cfg, args.world, prune=False).ranked}
        unknown = [label for label in args.labels if label not in candidates]
        if unknown:
            raise SystemExit(
                f"--labels {unknown}: not candidates on {args.world} ranks; "
                f"expected some of {list(candidates)}"
            )
        order = list(enumerate(args.labels))
        for round_index in range(args.rounds):
            for number, label in order:
                name = f"candidate{number}_round{round_index}"
                configs = scratch / f"candidate{number}_configs"
                overrides = [
                    *recipe_overrides(args),
                    *candidate_overrides(candidates[label], configs),
                ]
                parts_dir = scratch / f"{name}_parts"
                parts_dir.mkdir()
                run_parts(overrides, args.steps, parts_dir, scratch / name)
                emit(
                    "parts",
                    world=args.world,
                    label=label,
                    round=round_index,
                    load_average=round(os.getloadavg()[0], 1),
                    **summarise(parts_dir),
                )
            order.reverse()
    emit_summary([], args.check)


if __name__ == "__main__":
    main()
