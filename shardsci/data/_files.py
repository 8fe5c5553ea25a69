"""Data files as the user gave them: checked against what a run expects, never modified."""

from __future__ import annotations

__all__ = ["DataError"]


class DataError(ValueError):
    """A data file is missing, unreadable, or not what the run expects; the message names the
    file and the mismatch."""
