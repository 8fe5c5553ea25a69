"""A progress bar for people: on rank 0 only, with loss, throughput and ETA."""

from __future__ import annotations

import time

from tqdm import tqdm

__all__ = ["Progress"]


class Progress:
    """Rank-0 progress over training steps.

    Parameters
    ----------
    total_steps, start_step : int
        The run's last step and the step it starts from (after a resume).
    cells_per_step : int
        Grid cells processed per step over all ranks (global batch x cells per sample), for
        the throughput figure.
    enabled : bool
        False on every rank but one.
    """

    def __init__(self, total_steps: int, start_step: int, cells_per_step: int, enabled: bool):
        self._bar = tqdm(
            total=total_steps,
            initial=start_step,
            disable=not enabled,
            dynamic_ncols=True,
            unit="step",
            desc="train",
        )
        self._cells_per_step = cells_per_step
        self._start = time.perf_counter()
        self._steps = 0

    def step(self, loss: float) -> float:
        """Advance one step; returns the throughput so far in cells per second."""
        self._steps += 1
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        cells_per_s = self._cells_per_step * self._steps / elapsed
        self._bar.set_postfix(loss=f"{loss:.4g}", cells_s=f"{cells_per_s:.3g}", refresh=False)
        self._bar.update(1)
        return cells_per_s

    def write(self, message: str) -> None:
        if not self._bar.disable:
            self._bar.write(message)

    def close(self) -> None:
        self._bar.close()
