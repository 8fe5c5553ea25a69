"""DCP's ``.metadata``, read through an unpickler that builds only what DCP metadata is made of.

NOTE [What a checkpoint may hold]
Loading a checkpoint runs no code from it, whoever wrote it. A checkpoint is three kinds of
file, and each is read so that an object of any other kind is refused before it is built:

- ``extra.pt``: ``torch.load(weights_only=True)``, tensors and plain values only
  (``_extra.py``); ``save_checkpoint`` refuses an ``extra`` that would not read back so.
- DCP's shards (``__<rank>_<n>.distcp``): each tensor is read by DCP with
  ``torch.load(weights_only=True)``; each non-tensor entry (optimiser hyperparameters) by
  ``RestrictedPlanner.load_bytes`` the same way (DCP's own planner uses ``weights_only=False``).
- DCP's ``.metadata``: a plain pickle of DCP's dataclasses, read here by ``_MetadataUnpickler``,
  whose ``find_class`` resolves only the names in ``METADATA_GLOBALS``: the classes of
  ``torch.distributed.checkpoint.metadata`` (``Metadata``, ``MetadataIndex``, ``StorageMeta``,
  ``TensorStorageMetadata``, ``BytesStorageMetadata``, ``ChunkStorageMetadata``,
  ``TensorProperties`` and its ``_MEM_FORMAT_ENCODING`` enum), the filesystem's per-entry
  ``_StorageInfo``, ``torch.Size``, the ``torch.dtype`` objects, ``torch.serialization.
  _get_layout`` (how a ``torch.layout`` pickles: a lookup by name) and the ``pathlib`` path
  classes (``StorageMeta.checkpoint_id`` is the ``Path`` the writer was given; Python 3.13
  names their module ``pathlib._local``). That is the whole of what torch 2.13's
  ``FileSystemWriter`` pickles, found by logging ``find_class`` over checkpoints of every zoo
  model, replicated and FSDP2-sharded, and of both recipes' runs; the tests that load real
  checkpoints (``tests/test_checkpoint_trust.py``, the recipes' resume tests) keep it true,
  and a checkpoint written before the allowlist loads (``tests/data/``). Each allowed
  name, called by the pickle with any arguments, only builds a value (a dataclass, a size, a
  path) or looks one up; none imports or runs anything else. The unpickled metadata is then
  checked for the shape DCP gives it (entries, chunks inside their tensor, every chunk's data
  in a shard file named ``__<rank>_<n>.distcp`` inside the checkpoint, no stream transforms),
  so a crafted one cannot make DCP read outside the checkpoint directory.

The names are strings, as a pickle names them: they are checked against the pickle's own
text before anything is imported, and the library never uses the private ones as Python
symbols (so they are not in ``_torch_compat``). A torch upgrade that renames one makes loading
refuse the checkpoint naming the class, never load it unchecked, and fails the tests above and
the one that resolves every allowed name. Nothing in
a checkpoint names code to run: ``extra`` comes back as plain data, and a run config stored in
it is never instantiated (its ``_target_`` stays a string) unless the caller does so.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from shardsci.checkpoint._errors import CheckpointError, reason

__all__ = ["DCP_METADATA", "METADATA_GLOBALS", "SHARD_FILE", "read_metadata", "shard_extents"]

DCP_METADATA = ".metadata"
"""Name of the file DCP's coordinator writes last, once every rank's shards are written."""

SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")
"""The names ``FileSystemWriter`` gives shard files: ``__<rank>_<n>.distcp``."""

_PATHS = ("PosixPath", "PurePosixPath", "PureWindowsPath", "WindowsPath")

METADATA_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset(
        {"Size"} | {name for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
    ),
    "pathlib": frozenset(_PATHS),
    "pathlib._local": frozenset(_PATHS),
}
"""Module -> the names in it that DCP's ``.metadata`` may refer to (NOTE [What a checkpoint
may hold]); nothing else is resolved."""

_MODULE_ALIASES = {"pathlib._local": "pathlib"}
"""Modules a newer Python pickles under another name than this one imports."""

EXPECTED = "DCP metadata as save_checkpoint writes it"


class _Refused(pickle.UnpicklingError):
    """The pickle names a global outside ``METADATA_GLOBALS``."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name not in METADATA_GLOBALS.get(module, ()):
            raise _Refused(f"{module}.{name}")
        return super().find_class(_MODULE_ALIASES.get(module, module), name)


def read_metadata(checkpoint: Path) -> Metadata:
    """Return the DCP metadata of ``checkpoint``, built from allowed classes only and checked.

    Raises
    ------
    CheckpointError
        Naming the file, if it refers to anything outside ``METADATA_GLOBALS`` (nothing it
        names is imported or run), cannot be read (truncated, not a pickle), or is not shaped
        as DCP's metadata.
    """
    file = checkpoint / DCP_METADATA
    try:
        with open(file, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
    except _Refused as exc:
        raise CheckpointError(
            f"checkpoint file {file} holds a pickled {exc}, which DCP metadata does not contain; "
            f"refused without building it (expected {EXPECTED}, of DCP's metadata classes only)"
        ) from exc
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint file {file} cannot be read: {reason(exc)}; expected {EXPECTED}"
        ) from exc
    problem = _structure_problem(metadata)
    if problem is not None:
        raise CheckpointError(f"checkpoint file {file} is not {EXPECTED}: {problem}")
    return metadata


def shard_extents(metadata: Metadata) -> dict[str, tuple[int, str]]:
    """For each shard file the metadata refers to: the size it must have at least (the end of
    its last entry) and the name of one entry stored in it."""
    extents: dict[str, tuple[int, str]] = {}
    for index, info in metadata.storage_data.items():
        end = info.offset + info.length
        if end > extents.get(info.relative_path, (-1, ""))[0]:
            extents[info.relative_path] = (end, index.fqn)
    return extents


def _structure_problem(metadata: Any) -> str | None:
    """What makes ``metadata`` other than DCP's metadata of a checkpoint, or None."""
    if not isinstance(metadata, Metadata):
        return f"it holds a {type(metadata).__name__}"
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        return "its entries or their storage are not dicts"
    for fqn, entry in entries.items():
        if not isinstance(fqn, str):
            return f"an entry is named {fqn!r}"
        problem = _entry_problem(entry) or next(
            filter(None, (_storage_problem(storage.get(i)) for i in _indices(fqn, entry))), None
        )
        if problem is not None:
            return f"entry {fqn}: {problem}"
    return None


def _entry_problem(entry: Any) -> str | None:
    if isinstance(entry, TensorStorageMetadata):
        return _tensor_problem(entry)
    if isinstance(entry, BytesStorageMetadata):
        return None
    return f"it is a {type(entry).__name__}"


def _indices(fqn: str, entry: TensorStorageMetadata | BytesStorageMetadata) -> list[MetadataIndex]:
    """Where the data of a well-formed entry is listed in ``Metadata.storage_data``."""
    if isinstance(entry, BytesStorageMetadata):
        return [MetadataIndex(fqn)]
    return [MetadataIndex(fqn, chunk.offsets) for chunk in entry.chunks]


def _tensor_problem(entry: TensorStorageMetadata) -> str | None:
    properties, size = entry.properties, entry.size
    if not isinstance(properties, TensorProperties) or not isinstance(
        properties.dtype, torch.dtype
    ):
        return "its tensor properties are not DCP's"
    if not _is_shape(size) or not isinstance(entry.chunks, list):
        return f"its size {size!r} or its chunks are malformed"
    for chunk in entry.chunks:
        if not (
            isinstance(chunk, ChunkStorageMetadata)
            and _is_shape(chunk.offsets)
            and _is_shape(chunk.sizes)
            and len(chunk.offsets) == len(chunk.sizes) == len(size)
            and all(o + s <= n for o, s, n in zip(chunk.offsets, chunk.sizes, size))
        ):
            return f"a chunk {chunk!r} does not lie inside its tensor of size {tuple(size)}"
    return None


def _storage_problem(info: Any) -> str | None:
    if info is None:
        return "its data is not stored in any shard file"
    name = getattr(info, "relative_path", None)
    if not isinstance(name, str) or not SHARD_FILE.fullmatch(name):
        return f"its data is in {name!r}; expected a shard file __<rank>_<n>.distcp inside it"
    if not (_is_count(getattr(info, "offset", None)) and _is_count(getattr(info, "length", None))):
        return f"its place in {name} is malformed"
    if getattr(info, "transform_descriptors", None):
        return f"its data in {name} is stored through transforms, which save_checkpoint never uses"
    return None


def _is_shape(value: Any) -> bool:
    return isinstance(value, torch.Size) and all(_is_count(n) for n in value)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
