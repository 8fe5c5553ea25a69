"""Random fields of the CFD data's shapes and layouts, for a dry run (``Recipe.dry_run_task``):
the task of ``shardsci.recipes.cfd.task`` fed batches drawn at random, without reading data."""

from __future__ import annotations

import torch

from shardsci import ShardTensor, ShardTensorSpec
from shardsci.recipes.cfd.data import FIELD_DIMS
from shardsci.training import RunContext

__all__ = ["RandomFields"]


class RandomFields:
    """Stands in for ``CFDData`` in ``NextStep``: normalised ``(b, 1, N, N)`` fields on
    ``run.device``, ``b`` the global batch over the data-parallel replicas (at least 1), split
    like ``CFDData``'s (``torch.chunk`` shard sizes over the domain axes)."""

    def __init__(self, run: RunContext, resolution: int, global_batch: int) -> None:
        self.run = run
        parallelism = run.parallelism
        self.shape = (max(1, global_batch // parallelism.dp_size), 1, resolution, resolution)
        self.cells_per_sample = resolution**2

    def train_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._field(), self._field()

    def _field(self) -> torch.Tensor:
        parallelism, device = self.run.parallelism, self.run.device
        mesh = parallelism.domain_mesh
        if mesh is None:
            return torch.randn(self.shape, device=device)
        placements = parallelism.field_placements(FIELD_DIMS)
        spec = ShardTensorSpec.build(mesh, placements, self.shape, torch.float32)
        local = torch.randn(spec.local_shape(), device=device)
        return ShardTensor.from_local(local, mesh, placements, "chunk", shape=self.shape)
