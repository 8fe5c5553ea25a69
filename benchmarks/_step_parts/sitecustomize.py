"""Imported by every Python process started with this directory on ``PYTHONPATH`` (the ranks
of ``benchmarks.train_step_parts``' runs): with ``STEP_PARTS_DIR`` set, times the parts of
``train.py``'s steps (NOTE [The parts of a step] in ``benchmarks/train_step_parts.py``)."""

import os

if os.environ.get("STEP_PARTS_DIR"):
    import json
    import time

    import torch.distributed as dist
    from torch import nn

    import shardsci.parallel._reducer as reducer
    import shardsci.training._step as step_module
    import shardsci.training._trainer as trainer

    _seconds: dict[str, float] = {}

    def _now() -> list[float]:
        return [time.perf_counter(), time.process_time()]

    def _charge(part: str, since: list[float]) -> None:
        """Add the wall and CPU seconds from ``since`` to ``part``; ``since`` becomes now."""
        now = _now()
        for clock, start, end in (("wall", since[0], now[0]), ("cpu", since[1], now[1])):
            key = f"{part}_{clock}"
            _seconds[key] = _seconds.get(key, 0.0) + end - start
        since[:] = now

    def _timed_step(model, optimizer, task, step, precision, grad_clip, device, decide=None):
        """``training_step``'s body, each part charged (keep in step with ``_step.py``)."""
        _seconds.clear()
        since = _now()
        batch = task.batch(step)
        _charge("batch", since)
        with step_module.autocast(precision, device):
            terms = task.losses(model, batch)
        terms = {name: step_module.whole_tensor(t).float() for name, t in terms.items()}
        _charge("forward", since)
        optimizer.zero_grad(set_to_none=True)
        sum(terms.values()).backward()
        _charge("backward", since)
        apply = decide is None or decide(terms)
        _charge("agree", since)
        if apply:
            if grad_clip:
                nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
        _charge("optimizer", since)
        record = {"rank": dist.get_rank(), "step": step, **_seconds}
        path = os.path.join(os.environ["STEP_PARTS_DIR"], f"rank{dist.get_rank()}.jsonl")
        with open(path, "a") as parts:
            parts.write(json.dumps(record) + "\n")
        return terms

    _end_backward = reducer.GradientReducer._end_backward

    def _timed_end_backward(self) -> None:
        since = _now()
        _end_backward(self)
        _charge("gradient_wait", since)

    reducer.GradientReducer._end_backward = _timed_end_backward
    trainer.training_step = _timed_step
