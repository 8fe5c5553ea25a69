"""The check every load goes through: a checkpoint's files, then its match with the model.

Filesystem work only, no collective (``check_checkpoint`` in ``_dcp.py`` runs it on rank 0 and
raises its error on every rank). Reads ``.metadata`` and ``extra.pt`` (small) and the sizes of
the shard files, never their contents.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from shardsci.checkpoint._errors import CheckpointError
from shardsci.checkpoint._extra import read_extra
from shardsci.checkpoint._layout import check_complete
from shardsci.checkpoint._metadata import read_metadata, shard_extents

__all__ = ["CheckedFiles", "TensorEntry", "check_state_matches", "tensor_entries", "verify_files"]

_LISTED = 5


@dataclass(frozen=True)
class CheckedFiles:
    """What a checkpoint directory holds, read without running anything from it."""

    metadata: Metadata
    """DCP's metadata: every entry, its chunks and where their data lies."""
    extra: dict[str, Any]
    """The ``extra`` given to ``save_checkpoint``."""


class TensorEntry(NamedTuple):
    """The global shape and dtype of a tensor in a state dict."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def verify_files(checkpoint: Path) -> CheckedFiles:
    """Check that ``checkpoint`` is complete, holds only what a checkpoint may hold (NOTE
    [What a checkpoint may hold]) and that every shard file its metadata lists is there, at
    least as long as the data listed in it; return its metadata and ``extra``.

    Raises
    ------
    CheckpointError
        Naming the first file that is missing, truncated or holds anything else.
    """
    check_complete(checkpoint)
    metadata = read_metadata(checkpoint)
    for name, (end, entry) in sorted(shard_extents(metadata).items()):
        file = checkpoint / name
        if not file.is_file():
            raise CheckpointError(
                f"checkpoint file {file} is missing; its .metadata stores {entry} and other "
                f"entries in it (expected every shard file save_checkpoint wrote)"
            )
        size = file.stat().st_size
        if size < end:
            raise CheckpointError(
                f"checkpoint file {file} is truncated: {size} bytes, expected at least {end} "
                f"(its .metadata stores {entry} up to there)"
            )
    return CheckedFiles(metadata, read_extra(checkpoint))


def tensor_entries(state: dict[str, Any]) -> dict[str, TensorEntry]:
    """Every tensor in a nested state dict under DCP's flat name (the path through dicts and
    lists joined by ``.``), with its global shape (a DTensor's unsharded one) and dtype. DCP
    stores a tuple whole, as one non-tensor entry, so tensors inside one are not listed."""
    found: dict[str, TensorEntry] = {}

    def visit(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            found[prefix] = TensorEntry(tuple(value.shape), value.dtype)
        elif isinstance(value, dict):
            for key, item in value.items():
                visit(f"{prefix}.{key}", item)
        elif isinstance(value, list):
            for index, item in enumerate(value):
                visit(f"{prefix}.{index}", item)

    for key, value in state.items():
        visit(key, value)
    return found


def check_state_matches(
    checkpoint: Path, metadata: Metadata, expected: dict[str, dict[str, TensorEntry]]
) -> None:
    """Raise ``CheckpointError`` naming every tensor the checkpoint lacks or adds, or holds with
    another shape or dtype, for each part of the state being loaded.

    Parameters
    ----------
    checkpoint, metadata
        The checkpoint and its metadata.
    expected
        Per part of the state (``"model"``, ``"optim"``): ``tensor_entries`` of that part,
        keyed without the part's prefix.
    """
    for part, wanted in expected.items():
        prefix = part + "."
        saved = {
            key.removeprefix(prefix): entry
            for key, entry in metadata.state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
        }
        what = "the model" if part == "model" else "the optimiser"
        if wanted and not any(key.startswith(prefix) for key in metadata.state_dict_metadata):
            raise CheckpointError(
                f"checkpoint {checkpoint} holds no state of {what}: it was saved without one; "
                f"load it without one"
            )
        problems = _differences(saved, wanted, what)
        if problems:
            raise CheckpointError(
                f"checkpoint {checkpoint} does not match {what}: " + "; ".join(problems)
            )


def _differences(
    saved: dict[str, TensorStorageMetadata], wanted: dict[str, TensorEntry], what: str
) -> list[str]:
    problems = []
    missing = sorted(wanted.keys() - saved.keys())
    unexpected = sorted(saved.keys() - wanted.keys())
    if missing:
        problems.append(f"missing {_list(missing)}")
    if unexpected:
        problems.append(f"unexpected {_list(unexpected)}")
    for name in sorted(wanted.keys() & saved.keys()):
        entry, want = saved[name], wanted[name]
        have = TensorEntry(tuple(entry.size), entry.properties.dtype)
        if have.shape != want.shape:
            problems.append(f"{name} is {have.shape} in the checkpoint, {want.shape} in {what}")
        elif have.dtype != want.dtype:
            problems.append(f"{name} is {have.dtype} in the checkpoint, {want.dtype} in {what}")
    return problems


def _list(names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    more = len(names) - _LISTED
    return f"{shown} (and {more} more)" if more > 0 else shown
