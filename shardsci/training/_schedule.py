"""Learning-rate schedule: linear warm-up, then cosine decay to a floor."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["ScheduleConfig", "warmup_cosine"]


@dataclass
class ScheduleConfig:
    """The learning-rate schedule.

    Attributes
    ----------
    warmup_steps : int
        Steps of linear warm-up from 0 to the optimiser's learning rate.
    min_ratio : float
        The final learning rate as a fraction of the peak.
    """

    warmup_steps: int = 20
    min_ratio: float = 0.05


def warmup_cosine(
    optimizer: torch.optim.Optimizer, config: ScheduleConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR``: warm-up over ``config.warmup_steps``, cosine to ``config.min_ratio``."""

    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return config.min_ratio + (1 - config.min_ratio) * cosine

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
