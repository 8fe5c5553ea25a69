"""DCP's filesystem reading, with nothing unpickled outside an allowlist (NOTE [What a
checkpoint may hold] in ``_metadata.py``) and each failure naming its shard file."""

from __future__ import annotations

import dataclasses
import io
import os
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from shardsci.checkpoint._errors import CheckpointError, reason

__all__ = ["CheckedReader", "RestrictedPlanner"]


class RestrictedPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that a non-tensor entry (an optimiser's
    hyperparameters) is read with ``torch.load(weights_only=True)``: plain values only."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        # The entry's place in the state dict being loaded, as DCP flattened it.
        *parents, last = self.mappings[read_item.dest_index.fqn]
        container: Any = self.original_state_dict
        for key in parents:
            container = container[key]
        container[last] = loaded


class CheckedReader(FileSystemReader):
    """Reads the shards of checkpoint ``path``, whose metadata was read and checked already.

    Every rank uses the ``metadata`` it is given (rank 0's checked copy) instead of reading
    ``.metadata`` again; a shard file that fails to read is named in a ``CheckpointError``.
    """

    def __init__(self, path: str | os.PathLike[str], metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as exc:
                raise CheckpointError(
                    f"checkpoint file {self.path / name} cannot be read: {reason(exc)}; expected "
                    f"the tensors and plain values that save_checkpoint writes"
                ) from exc
        done: Future[None] = Future()
        done.set_result(None)
        return done
