"""The CFD recipe without its data, for a dry run (``Recipe.plan``): the model and the task
of ``recipes.cfd.train`` fed batches of the real shapes and layouts, drawn at random."""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch import nn

from recipes.cfd.train import NextStep
from shardsci import ShardTensor, ShardTensorSpec
from shardsci.training import ParallelLayout, RunContext, instantiate

__all__ = ["planned_task"]

FIELD_DIMS = ("N", "C", "H", "W")
"""Dims of a batch of vorticity fields, as ``CFDData`` produces them."""


def planned_task(
    cfg: DictConfig, context: RunContext, device: torch.device
) -> tuple[nn.Module, NextStep]:
    """The model of ``cfg`` on ``device`` and the CFD task on random fields."""
    model = instantiate(cfg.model).to(device)
    fields = RandomFields(
        context.layout, cfg.data.dataset.solver.resolution, int(cfg.train.global_batch), device
    )
    return model, NextStep(fields, context, cfg.eval.rollout_steps)


class RandomFields:
    """Stands in for ``CFDData`` in ``NextStep``: normalised ``(b, 1, N, N)`` fields, ``b`` the
    global batch over the data-parallel replicas (at least 1), split like ``CFDData``'s
    (``torch.chunk`` shard sizes over the domain axes)."""

    def __init__(
        self, layout: ParallelLayout, resolution: int, global_batch: int, device: torch.device
    ) -> None:
        self.layout = layout
        self.device = device
        self.shape = (max(1, global_batch // layout.dp_size), 1, resolution, resolution)
        self.cells_per_sample = resolution**2

    def train_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._field(), self._field()

    def _field(self) -> torch.Tensor:
        mesh = self.layout.domain_mesh
        if mesh is None:
            return torch.randn(self.shape, device=self.device)
        placements = self.layout.field_placements(FIELD_DIMS)
        spec = ShardTensorSpec.build(mesh, placements, self.shape, torch.float32)
        local = torch.randn(spec.local_shape(), device=self.device)
        return ShardTensor.from_local(local, mesh, placements, "chunk", shape=self.shape)
