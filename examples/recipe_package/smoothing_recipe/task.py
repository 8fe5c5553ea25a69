"""The recipe's task: fields of noise in, their periodic 5-point average out.

Every rank makes the same global batch from the step number, keeps its data-parallel rows and
its block of the domain (``distribute_tensor``, no communication); ``shardsci.training`` does
the rest (the mesh, the model ``cfg.model``, the loop).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn

from shardsci import distribute_tensor
from shardsci.training import RunContext, dp_sample_mean, whole_tensor

_HELD_OUT_SEED = 1_000_000


@dataclass
class FieldsConfig:
    """The ``fields`` group: random fields of ``size`` x ``size`` cells."""

    size: int = 32


def smoothing(cfg: DictConfig, run: RunContext) -> Smoothing:
    """The task on this rank (``Recipe.task``)."""
    return Smoothing(OmegaConf.to_object(cfg.data), cfg.train.global_batch, run)


class Smoothing:
    """The ``Task``: learn the 5-point average of a periodic field."""

    def __init__(self, fields: FieldsConfig, global_batch: int, run: RunContext):
        self.size, self.run = fields.size, run
        self.rows = global_batch // run.parallelism.dp_size
        self.cells_per_sample = fields.size**2

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._sample(step)

    def losses(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        fields, averages = batch
        return {"average": F.mse_loss(model(fields), averages)}

    def evaluate(self, model: nn.Module, step: int) -> dict[str, float]:
        fields, averages = self._sample(_HELD_OUT_SEED)
        per_sample = whole_tensor((model(fields) - averages).pow(2).mean(dim=(1, 2, 3)))
        return {"eval_mse": dp_sample_mean(per_sample, self.run.parallelism)}

    def describe(self, metrics: Mapping[str, Any]) -> str:
        return f"step {metrics['step']}: held-out mse {metrics['eval_mse']:.3g}"

    def _sample(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        parallelism = self.run.parallelism
        generator = torch.Generator().manual_seed(seed)
        batch = self.rows * parallelism.dp_size
        fields = torch.randn(batch, 1, self.size, self.size, generator=generator)
        averages = sum(fields.roll(s, d) for s in (1, -1) for d in (-1, -2)) + fields
        rows = slice(parallelism.dp_rank * self.rows, (parallelism.dp_rank + 1) * self.rows)
        pair = [t[rows].to(self.run.device) for t in (fields, averages / 5)]
        if parallelism.domain_mesh is None:
            return pair[0], pair[1]
        placements = parallelism.field_placements(("N", "C", "H", "W"))
        return tuple(distribute_tensor(t, parallelism.domain_mesh, placements) for t in pair)
