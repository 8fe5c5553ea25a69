"""Errors a user can fix are one line, not a Python traceback.

NOTE [Errors for people]
A wrong config value, mesh, path or file is the user's to fix, and a traceback only hides the
one line that says what is wrong and what is expected. Such errors are the classes in
``USER_ERRORS``; ``reported`` prints them as ``error: <message>`` on standard error and exits
with ``EXIT_USER_ERROR``. Every other exception is a bug and keeps its traceback. Setting
``HYDRA_FULL_ERROR=1`` (Hydra's own switch, which also governs Hydra's composition errors)
shows the traceback of user errors too. The README's error catalogue lists the messages.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

from shardsci.checkpoint import CheckpointError
from shardsci.data import DataError
from shardsci.distributed import CollectiveTimeout, LaunchError

__all__ = [
    "EXIT_USER_ERROR",
    "TRACEBACK_VAR",
    "USER_ERRORS",
    "ConfigError",
    "NonFiniteLoss",
    "reported",
    "traceback_requested",
]

TRACEBACK_VAR = "HYDRA_FULL_ERROR"
"""Set to ``1`` to see the Python traceback of a user error."""

EXIT_USER_ERROR = 2
"""Exit status of a run refused for a user error (as for a command-line usage error)."""


class ConfigError(ValueError):
    """The run's configuration cannot work; found before any rank starts."""


class NonFiniteLoss(ArithmeticError):
    """A training step's loss is NaN or infinite (``train.nonfinite=stop``); the message names
    the step and the field."""


USER_ERRORS: tuple[type[Exception], ...] = (
    ConfigError,
    NonFiniteLoss,
    DataError,
    LaunchError,
    CheckpointError,
    CollectiveTimeout,
)
"""Exceptions whose message is all a user needs (NOTE [Errors for people])."""


def traceback_requested() -> bool:
    """Whether ``HYDRA_FULL_ERROR`` asks for the traceback of user errors."""
    return os.environ.get(TRACEBACK_VAR, "") not in ("", "0")


@contextlib.contextmanager
def reported(prefix: str = "error") -> Iterator[None]:
    """Turn a user error raised inside into ``<prefix>: <message>`` and ``EXIT_USER_ERROR``."""
    try:
        yield
    except USER_ERRORS as error:
        if traceback_requested():
            raise
        print(f"{prefix}: {error}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USER_ERROR) from None
