"""``extra.pt``: the step and the caller's small run state, in a form whose loading runs no code.

The file is written with ``torch.save`` and read with ``torch.load(weights_only=True)``, whose
unpickler builds only tensors and plain values (numbers, strings, bytes, None, and lists,
tuples, sets and dicts of them) and refuses any other object before constructing it. A save
therefore checks that what it writes reads back that way: an ``extra`` holding anything else
is refused when saved, not when someone later loads it (see NOTE [What a checkpoint may hold]
in ``_metadata.py``).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from shardsci.checkpoint._errors import CheckpointError, reason

__all__ = ["EXTRA_FILE", "encode_extra", "read_extra"]

EXTRA_FILE = "extra.pt"
"""Name of the file, written by rank 0, that holds the step and the caller's ``extra``."""

_PLAIN_VALUES = (
    "tensors and plain values (numbers, strings, bytes, None; lists, tuples, sets and dicts of "
    "them)"
)
_NUMPY_HINT = (
    "; convert numpy arrays to tensors (torch.from_numpy) and numpy scalars to Python numbers, "
    "e.g. numpy's RNG state to (name, torch.from_numpy(keys), pos, has_gauss, cached_gaussian)"
)


def encode_extra(step: int, extra: dict[str, Any]) -> bytes:
    """The bytes of ``extra.pt`` for ``step`` and ``extra``.

    Raises
    ------
    CheckpointError
        If ``extra`` holds anything that ``torch.load(weights_only=True)`` would refuse.
    """
    payload = io.BytesIO()
    try:
        torch.save({"step": step, "extra": extra}, payload)
        torch.load(io.BytesIO(payload.getvalue()), weights_only=True)
    except Exception as exc:
        hint = _NUMPY_HINT if "numpy" in str(exc) else ""
        raise CheckpointError(
            f"extra must hold only {_PLAIN_VALUES}, which load without running code; "
            f"{reason(exc)}{hint}"
        ) from exc
    return payload.getvalue()


def read_extra(checkpoint: Path) -> dict[str, Any]:
    """Return the ``extra`` stored in ``checkpoint``, constructing nothing but plain values.

    Raises
    ------
    CheckpointError
        Naming the file, if it holds anything else, is damaged, or lacks the step.
    """
    file = checkpoint / EXTRA_FILE
    try:
        stored = torch.load(file, weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint file {file} cannot be read: {reason(exc)}; expected the step and extra "
            f"that save_checkpoint writes, {_PLAIN_VALUES} only"
        ) from exc
    if not (
        isinstance(stored, dict)
        and isinstance(stored.get("step"), int)
        and isinstance(stored.get("extra"), dict)
    ):
        raise CheckpointError(
            f"checkpoint file {file} holds a {type(stored).__name__}; expected the dict "
            f"{{'step': int, 'extra': dict}} that save_checkpoint writes"
        )
    return stored["extra"]
