"""When a collective times out: which collective, called where, and which ranks did not join.

NOTE [A rank that stops participating]
A rank that hangs, is stopped or is cut off leaves the others waiting in their next collective
until the process-group timeout (``launcher.timeout_s``). gloo then says only ``Timed out
waiting 600000ms for recv operation to complete``: neither the collective nor the rank. So a
rank that meets a timeout (``is_collective_timeout``) raises ``CollectiveTimeout`` instead
(``explain_timeout``), whose message names:

- the collective and its caller, from the traceback (the last ``torch.distributed`` function
  called, and the frame outside torch that called it; a collective issued from C++ or
  waited for there (autograd's engine, an asynchronous collective's ``wait``) is named by the
  innermost torch function and the last call outside torch, with its source line);
- the ranks that did not join: every rank that timed out writes its rank to the rendezvous
  store and waits ``report_wait_s(timeout_s)`` (a tenth of the timeout, 5 to 30 s) for the
  others; the ranks whose key is missing are the ones that stopped participating. If the
  store itself does not answer within that wait, the process that hosts it (rank 0, or
  torchrun's agent) is the one that stopped.
So every rank that was left waiting fails within the timeout plus ``report_wait_s``, with
one line; the launcher then stops the rank that hangs (tests/test_faults.py).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import traceback
from types import TracebackType

import torch.distributed as dist

from shardsci.tensor._torch_compat import _get_default_store

__all__ = ["CollectiveTimeout", "explain_timeout", "is_collective_timeout", "report_wait_s"]

_PRESENT = "shardsci/present/"
_TIMEOUT_MARKS = ("Timed out waiting", "collective operation timeout")  # gloo, NCCL
_STORE_SLACK_S = 1.0


class CollectiveTimeout(RuntimeError):
    """A collective timed out because some rank stopped participating; the message names the
    collective, its caller and the ranks that did not join."""


def is_collective_timeout(error: BaseException) -> bool:
    """Whether ``error`` is a process group's timeout in a collective (gloo or NCCL)."""
    if not isinstance(error, RuntimeError) or isinstance(error, CollectiveTimeout):
        return False
    return any(mark in str(error) for mark in _TIMEOUT_MARKS)


def report_wait_s(timeout_s: float) -> float:
    """How long a rank that timed out waits for the others to report in: a tenth of the
    collective timeout ``timeout_s``, at least 5 s and at most 30 s."""
    return min(30.0, max(5.0, timeout_s / 10))


def explain_timeout(error: RuntimeError, timeout_s: float) -> CollectiveTimeout:
    """The ``CollectiveTimeout`` that explains ``error``, a timeout after ``timeout_s``
    seconds (see NOTE [A rank that stops participating]); takes at most
    ``report_wait_s(timeout_s)`` more seconds, asking the rendezvous store who else timed out."""
    rank = dist.get_rank()
    absent = _absent_ranks(rank, dist.get_world_size(), report_wait_s(timeout_s))
    return CollectiveTimeout(
        f"rank {rank} waited {timeout_s:g} s (launcher.timeout_s) in "
        f"{_collective_call(error.__traceback__)} for {absent}; no rank may stop "
        f"participating in the collectives of a run"
    )


def _collective_call(trace: TracebackType | None) -> str:
    """``the collective all_reduce called by f (file.py:12)`` from the innermost
    torch.distributed frame; for a collective issued from C++ (autograd's engine, an
    asynchronous collective's ``wait``), the innermost torch function and the last call outside
    torch: ``a collective issued in torch's _pre_forward under `model(x)` in f (file.py:12)``."""
    frames = traceback.extract_tb(trace)
    inner = [i for i, f in enumerate(frames) if "torch/distributed/" in f.filename]
    below = inner[0] if inner else len(frames)
    ours = [f for f in frames[:below] if "/torch/" not in f.filename]
    if not ours:
        return f"the collective {frames[inner[-1]].name}" if inner else "a collective"
    caller = ours[-1]
    where = f"{caller.name} ({caller.filename}:{caller.lineno})"
    if inner:
        return f"the collective {frames[inner[-1]].name} called by {where}"
    inside = f" issued in torch's {frames[-1].name}" if frames[-1] is not caller else ""
    return f"a collective{inside} under `{caller.line}` in {where}"


def _absent_ranks(rank: int, world_size: int, wait_s: float) -> str:
    """Which ranks did not also time out and report in, as a phrase for the message.

    The store is asked from a daemon thread: a store whose server is stopped (SIGSTOP) accepts
    the connection and never answers, whatever the store's own timeout says.
    """
    store = _get_default_store()
    keys = [f"{_PRESENT}{r}" for r in range(world_size)]
    deadline = time.monotonic() + wait_s
    answer: list[list[int]] = []

    def ask() -> None:
        with contextlib.suppress(RuntimeError):
            store.set(keys[rank], "1")
            absent = list(range(world_size))
            while absent and time.monotonic() < deadline:
                time.sleep(0.1)
                absent = [r for r in absent if not store.check([keys[r]])]
            answer.append(absent)

    thread = threading.Thread(target=ask, name="shardsci-timeout-report", daemon=True)
    thread.start()
    thread.join(wait_s + _STORE_SLACK_S)
    if not answer:
        return _silent_store()
    absent = answer[0]
    if not absent:
        return "a rank that answered late (every rank reported in after the timeout)"
    names = ", ".join(str(r) for r in absent)
    return f"rank{'s' if len(absent) > 1 else ''} {names}, which stopped participating"


def _silent_store() -> str:
    """Who stopped when the rendezvous store does not answer: torchrun's agent hosts it
    under torchrun, else rank 0."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return "the torchrun agent, whose rendezvous store does not answer"
    return "rank 0, which hosts the rendezvous store and does not answer"
