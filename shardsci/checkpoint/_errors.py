"""The one error type of checkpoints, and one line for what a failed read said."""

from __future__ import annotations

import re

__all__ = ["CheckpointError", "reason"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; raised on every rank of the group."""


_REFUSED_GLOBAL = re.compile(r"Unsupported global: GLOBAL (\S+)")
_UNPICKLER_ERROR = "WeightsUnpickler error:"


def reason(exc: BaseException) -> str:
    """One line saying why reading a file failed, for a ``CheckpointError`` message.

    ``torch.load(weights_only=True)`` explains a refused object in a page of advice (including
    how to load the file anyway, which a checkpoint from someone else must not be); only the
    object it refused, or its first line of diagnosis, is kept.
    """
    text = str(exc)
    refused = _REFUSED_GLOBAL.search(text)
    if refused:
        return f"it holds a pickled {refused.group(1)}, which is not a tensor or a plain value"
    if _UNPICKLER_ERROR in text:
        text = text.split(_UNPICKLER_ERROR, 1)[1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
