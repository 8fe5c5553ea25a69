"""Turn a ``resume`` setting into the checkpoint to load, if any."""

from __future__ import annotations

import os
from pathlib import Path

from shardsci.checkpoint._layout import latest_checkpoint
from shardsci.checkpoint._verify import verify_files

__all__ = ["resolve_resume"]

AUTO, NEVER = "auto", "never"


def resolve_resume(
    directory: str | os.PathLike[str], resume: str | os.PathLike[str] | None
) -> Path | None:
    """Return the checkpoint a run should resume from, or None to start fresh.

    Reads the filesystem only (no collective); on a shared filesystem every rank gets the
    same answer. A path given explicitly is checked as every load checks its files
    (``verify_files``: complete, nothing but what a checkpoint may hold, no shard missing or
    truncated), so that a run refuses it before it starts; ``load_checkpoint`` checks again,
    together with the model.

    Parameters
    ----------
    directory
        The run's checkpoint directory, as given to ``save_checkpoint``.
    resume
        ``"auto"``: the newest complete checkpoint in ``directory``, or None if there is none
        (a first start). ``"never"`` or None: None. Anything else: the path of a checkpoint.

    Raises
    ------
    CheckpointError
        If ``resume`` names a path that is not a complete checkpoint, or one whose files fail
        the check, with one line naming the file and what was expected.
    """
    if resume is None or resume == NEVER:
        return None
    if resume == AUTO:
        return latest_checkpoint(directory)
    path = Path(resume)
    verify_files(path)
    return path
