"""What SIGTERM and SIGINT do to a rank: stop cleanly, and while training, at a step boundary.

NOTE [Stopping a run on a signal]
Schedulers (SLURM preemption, ``--signal``), ``kill``, IDE stop buttons and Ctrl-C send SIGTERM
or SIGINT, to the launching process (which forwards them to every rank; see NOTE [Ranks
forked by train.py behave like torchrun's]) or to every rank at once. A rank never dies mid-step:

- Before and after the training loop a stop signal raises ``SystemExit(128 + signum)``: the
  rank unwinds (a generator removes its temporary file), prints no traceback, and its exit
  status says which signal stopped it (143 for SIGTERM, 130 for SIGINT).
- Inside the loop (``StopRequests``) the signal is only recorded. Ranks can be signalled at
  different moments, so after every step they agree, in the one all-reduce that also averages
  the loss, on whether any rank was asked to stop; if so every rank stops after the same
  step, saves the final checkpoint together, and exits with ``128 + signum``.
A rank blocked in a collective runs its Python handler only when the collective returns; a
rank that cannot get there (a peer is gone) is ended by its launcher after the grace period.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

__all__ = ["STOP_SIGNALS", "StopRequests", "exit_on_stop_signals", "exit_status"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""The signals that stop a run cleanly."""


def exit_status(signum: int) -> int:
    """The exit status of a process stopped by signal ``signum``: ``128 + signum``."""
    return 128 + signum


def _exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(exit_status(signum))


def exit_on_stop_signals() -> None:
    """Make a stop signal raise ``SystemExit(128 + signum)`` in this process (main thread)."""
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            signal.signal(signum, _exit)


class StopRequests:
    """A context in which stop signals are recorded instead of acted on.

    ``pending()`` is, per signal of ``STOP_SIGNALS``, whether it arrived; the training loop
    combines it over ranks (NOTE [Stopping a run on a signal]). Outside a main thread (no
    signal handlers can be installed there) nothing is recorded.
    """

    def __init__(self) -> None:
        self._received: set[int] = set()
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self._received.add(signum)

    def pending(self) -> list[float]:
        """1.0 for each signal of ``STOP_SIGNALS`` that arrived, else 0.0."""
        return [float(signum in self._received) for signum in STOP_SIGNALS]
