"""Start the ranks of a job on this machine when no launcher did.

``python train.py mesh=4x2`` without torchrun or SLURM variables starts its 8 ranks itself:
processes forked from the one that composed the configuration (cheap after ``import
torch``; safe because that process has run no torch op and touched no GPU), each given the
variables torchrun would set, so the rest of the code sees a torchrun launch.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

__all__ = ["run_local_ranks"]

_GRACE_S = 10.0


def run_local_ranks(world_size: int, fn: Callable[..., Any], *args: Any) -> int:
    """Run ``fn(*args)`` on ``world_size`` local ranks; return the job's exit status.

    When a rank fails, the others get ``_GRACE_S`` seconds to finish (they may be waiting in a
    collective the failed rank never reached) and are then terminated.

    Returns
    -------
    int
        0 when every rank succeeded, else the first failing rank's exit code (1 for an
        exception).
    """
    context = multiprocessing.get_context("fork")
    port = _free_port()
    threads = max(1, (os.cpu_count() or 1) // world_size)
    processes = []
    for rank in range(world_size):
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": str(threads),
        }
        process = context.Process(target=_rank_main, args=(env, threads, fn, args), daemon=False)
        process.start()
        processes.append(process)
    return _wait_all(processes)


def _rank_main(env: dict[str, str], threads: int, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(env)
    import torch

    torch.set_num_threads(threads)
    try:
        fn(*args)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _wait_all(processes: list[multiprocessing.Process]) -> int:
    pending = {p.sentinel: p for p in processes}
    status = 0
    deadline = None
    while pending:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = wait(list(pending), timeout=timeout)
        if not ready:
            for process in pending.values():
                process.terminate()
            for process in pending.values():
                process.join(5)
                if process.is_alive():
                    process.kill()
            status = status or 1
            break
        for sentinel in ready:
            process = pending.pop(sentinel)
            process.join()
            if process.exitcode and not status:
                status = process.exitcode if process.exitcode > 0 else 1
                deadline = time.monotonic() + _GRACE_S
    return status


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
