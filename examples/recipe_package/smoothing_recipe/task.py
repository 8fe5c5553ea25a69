"""The recipe's run: fields of noise in, their periodic 5-point average out.

Every rank makes the same global batch from the step number, keeps its data-parallel rows and
its block of the domain (``distribute_tensor``, no communication), and ``Trainer`` does the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn

from shardsci import ShardTensor, distribute_tensor
from shardsci.training import RunContext, Trainer, dp_sample_mean, instantiate, start_run

_HELD_OUT_SEED = 1_000_000


@dataclass
class FieldsConfig:
    """The ``fields`` group: random fields of ``size`` x ``size`` cells."""

    size: int = 32


def run(cfg: DictConfig) -> dict[str, float]:
    """Train on this rank's part of the mesh; the final metrics."""
    with start_run(cfg) as context:
        model = instantiate(cfg.model).to(context.device)
        task = Smoothing(OmegaConf.to_object(cfg.data), cfg.train.global_batch, context)
        return Trainer(context, cfg, model, task).fit()


class Smoothing:
    """The ``Task``: learn the 5-point average of a periodic field."""

    def __init__(self, fields: FieldsConfig, global_batch: int, context: RunContext):
        self.size, self.context = fields.size, context
        self.rows = global_batch // context.layout.dp_size
        self.cells_per_sample = fields.size**2

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._sample(step)

    def losses(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        fields, averages = batch
        return {"average": F.mse_loss(model(fields), averages)}

    def evaluate(self, model: nn.Module, step: int) -> dict[str, float]:
        fields, averages = self._sample(_HELD_OUT_SEED)
        per_sample = (model(fields) - averages).pow(2).mean(dim=(1, 2, 3))
        if isinstance(per_sample, ShardTensor):
            per_sample = per_sample.full_tensor()
        return {"eval_mse": dp_sample_mean(per_sample, self.context.layout)}

    def describe(self, metrics: Mapping[str, Any]) -> str:
        return f"step {metrics['step']}: held-out mse {metrics['eval_mse']:.3g}"

    def _sample(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        layout = self.context.layout
        generator = torch.Generator().manual_seed(seed)
        batch = self.rows * layout.dp_size
        fields = torch.randn(batch, 1, self.size, self.size, generator=generator)
        averages = sum(fields.roll(s, d) for s in (1, -1) for d in (-1, -2)) + fields
        rows = slice(layout.dp_rank * self.rows, (layout.dp_rank + 1) * self.rows)
        pair = [t[rows].to(layout.device) for t in (fields, averages / 5)]
        if layout.domain_mesh is None:
            return pair[0], pair[1]
        placements = layout.field_placements(("N", "C", "H", "W"))
        return tuple(distribute_tensor(t, layout.domain_mesh, placements) for t in pair)
