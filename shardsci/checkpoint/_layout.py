"""The on-disk layout of a checkpoint directory and the commit protocol that keeps it valid.

Filesystem work only, done by one process (rank 0 of the saving group); nothing here runs a
collective. The layout, for ``directory``::

    directory/
        step_000100/        a complete checkpoint: DCP shards, ``.metadata``, ``extra.pt``
        step_000200/
        step_000300.tmp/    a save in progress, or one killed mid-write: never read
        latest              text file naming the newest committed checkpoint: "step_000200"

NOTE [Checkpoint commit protocol]
A save of step N goes through these stages; a crash at any point leaves the last committed
checkpoint intact and loadable.

1. ``begin_save``: remove the leftovers of killed saves (``step_*.tmp``, ``step_*.trash``,
   ``latest.tmp``), create ``step_N.tmp/`` and write ``extra.pt`` into it.
2. Every rank writes its DCP shards into ``step_N.tmp/``; DCP's coordinator writes
   ``.metadata`` once every rank's writes are done (the barrier of the save).
3. ``commit_save``: fsync every file in ``step_N.tmp/`` and the directory, rename it to
   ``step_N`` (atomic) and fsync ``directory``. From here ``step_N`` is *complete*: a name
   ``step_<digits>`` without suffix only ever holds a durable, complete checkpoint, and it is
   the rename that makes one exist. A crash before the rename leaves only a ``.tmp``
   directory, which no reader looks at and the next save removes.
4. Write ``latest.tmp`` naming ``step_N``, fsync it, ``os.replace`` it onto ``latest``
   (atomic), fsync ``directory``. From here ``latest_checkpoint`` returns ``step_N``. A crash
   between 3 and 4 leaves ``latest`` naming step N-1, which is complete and loadable.
5. Prune: complete checkpoints older than the newest ``keep_last`` (counting step N) are
   renamed to ``step_K.trash`` (atomic) and then deleted, so a half-deleted checkpoint is never
   mistaken for a complete one. Pruning starts only after 4, so it never removes what
   ``latest`` names or leaves fewer than ``keep_last`` complete checkpoints.

Saving a step that already has a complete directory (e.g. a final save at the step of the
last periodic one) first renames the old directory to ``step_N.trash``. A crash between that
rename and the new one leaves ``latest`` naming a missing directory; ``latest_checkpoint``
then falls back to the newest complete checkpoint on disk.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path
from typing import Any

from shardsci.checkpoint._errors import CheckpointError
from shardsci.checkpoint._extra import EXTRA_FILE, encode_extra
from shardsci.checkpoint._metadata import DCP_METADATA

__all__ = [
    "begin_save",
    "check_complete",
    "commit_save",
    "complete_checkpoints",
    "latest_checkpoint",
    "step_name",
]

LATEST = "latest"
"""Name of the pointer file holding the directory name of the newest committed checkpoint."""

_COMPLETE = re.compile(r"step_(\d+)")
_LEFTOVER = re.compile(r"step_\d+\.(tmp|trash)")
_TMP_SUFFIX = ".tmp"
_TRASH_SUFFIX = ".trash"


def step_name(step: int) -> str:
    """Return the directory name of the checkpoint of ``step``, e.g. ``"step_000123"``."""
    return f"step_{step:06d}"


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def complete_checkpoints(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Return ``(step, path)`` of every complete checkpoint in ``directory``, oldest first.

    Complete means committed (see NOTE [Checkpoint commit protocol]): a directory named
    ``step_<digits>``, without the ``.tmp`` or ``.trash`` suffix of an unfinished save or
    deletion. A missing ``directory`` holds none.
    """
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _COMPLETE.fullmatch(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """Return the newest committed checkpoint in ``directory``, or None if there is none.

    The ``latest`` pointer decides; if it is missing or names a directory that is not a
    complete checkpoint (a crash while re-saving the same step), the complete checkpoint with
    the largest step is returned. Half-written saves (``step_*.tmp``) are never returned.
    Reads the filesystem only (no collective): on a shared filesystem every rank gets the same
    answer.

    Parameters
    ----------
    directory
        The checkpoint directory given to ``save_checkpoint``.
    """
    root = Path(directory)
    with contextlib.suppress(OSError, UnicodeDecodeError):
        name = (root / LATEST).read_text(encoding="utf-8").strip()
        if _COMPLETE.fullmatch(name) and (root / name).is_dir():
            return root / name
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def check_complete(path: Path) -> None:
    """Raise ``CheckpointError`` unless ``path`` is a complete checkpoint directory.

    A checkpoint copied elsewhere may have any name except the ``.tmp``/``.trash`` suffix of
    an unfinished save or deletion; it must hold DCP's ``.metadata`` and ``extra.pt``.
    """
    if path.name.endswith((_TMP_SUFFIX, _TRASH_SUFFIX)):
        raise CheckpointError(
            f"{path} is an unfinished save or deletion, not a complete checkpoint; use "
            "latest_checkpoint(directory) to find the newest complete one"
        )
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
    missing = [name for name in (DCP_METADATA, EXTRA_FILE) if not (path / name).is_file()]
    if missing:
        raise CheckpointError(
            f"{path} is not a complete checkpoint: it lacks {', '.join(missing)} "
            f"(expected a step_<N> directory written by save_checkpoint)"
        )


# ---------------------------------------------------------------------------------------------
# Writing (rank 0 only)
# ---------------------------------------------------------------------------------------------


def begin_save(directory: Path, step: int, extra: dict[str, Any]) -> Path:
    """Stage 1: clear leftovers, create ``step_N.tmp/`` holding ``extra.pt``; return it.

    Raises
    ------
    CheckpointError
        If ``extra`` holds anything but tensors and plain values (``encode_extra``).
    """
    payload = encode_extra(step, extra)
    if not directory.is_dir():
        directory.mkdir(parents=True)
        _fsync(directory.parent)
    _remove_leftovers(directory)
    staging = directory / (step_name(step) + _TMP_SUFFIX)
    staging.mkdir()
    (staging / EXTRA_FILE).write_bytes(payload)
    return staging


def commit_save(directory: Path, step: int, keep_last: int | None) -> Path:
    """Stages 3-5: make ``step_N.tmp`` durable, rename it, point ``latest`` at it, prune.

    Parameters
    ----------
    directory, step
        As given to ``begin_save``; every rank's shards are written into ``step_N.tmp``.
    keep_last
        Number of complete checkpoints to keep, counting the new one; None keeps all.

    Returns
    -------
    Path
        The committed checkpoint, ``step_N``.
    """
    final = directory / step_name(step)
    staging = directory / (final.name + _TMP_SUFFIX)
    for path in staging.iterdir():
        _fsync(path)
    _fsync(staging)
    if final.exists():
        final.rename(final.with_name(final.name + _TRASH_SUFFIX))
    staging.rename(final)
    _fsync(directory)
    _replace_latest(directory, final.name)
    _prune(directory, step, keep_last)
    _remove_leftovers(directory)
    return final


def _replace_latest(directory: Path, name: str) -> None:
    """Stage 4: atomically point ``latest`` at ``name``, durably."""
    pending = directory / (LATEST + _TMP_SUFFIX)
    with open(pending, "w", encoding="utf-8") as stream:
        stream.write(name + "\n")
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(pending, directory / LATEST)
    _fsync(directory)


def _prune(directory: Path, newest_step: int, keep_last: int | None) -> None:
    """Stage 5: delete complete checkpoints older than the newest ``keep_last``.

    Checkpoints with a larger step than ``newest_step`` (left by a run that was rolled back) are
    not counted and not deleted: they are not this run's to remove.
    """
    if keep_last is None:
        return
    older = [path for step, path in complete_checkpoints(directory) if step < newest_step]
    for path in older[: max(0, len(older) - (keep_last - 1))]:
        trash = path.with_name(path.name + _TRASH_SUFFIX)
        path.rename(trash)
        shutil.rmtree(trash)


def _remove_leftovers(directory: Path) -> None:
    """Delete what killed saves and deletions left: ``step_*.{tmp,trash}``, ``latest.tmp``."""
    for entry in directory.iterdir():
        if _LEFTOVER.fullmatch(entry.name):
            shutil.rmtree(entry)
    (directory / (LATEST + _TMP_SUFFIX)).unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file, or a directory's entries) to stable storage."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
