"""Persistent pools of gloo ranks that run test bodies on N processes.

Starting N fresh processes per test costs 14-25 s on a 2-core machine. A pool of ranks is
instead started once per world size, on first use, and reused by every test of the pytest
session: a call sends a module-level function to every rank, each rank runs it and answers
with its return value or its traceback.

NOTE [Forking ranks from a clean zygote]
Forking a process that has run a multi-threaded torch op can hang the child. Ranks are
therefore started through a ``forkserver`` whose only work is importing ``_PRELOAD``: each
rank is forked from that clean, torch-importing zygote (fast: no re-import), never from the
pytest process, which may run torch ops freely. ``preload_in_ranks`` adds modules the ranks
would each import anyway (a suite's bodies that import the training command: about 1 s of CPU
per rank and pool, once in the zygote instead); they must start no threads and run no torch op
on import. Each rank starts with
``torch.set_num_threads(1)``. The forkserver receives the parent's ``sys.path`` when it starts
(because preload modules are set) and every rank receives it again when it is forked, so
functions from the ``tests`` package (repo root on ``sys.path`` through pytest's
``pythonpath``) are importable in the ranks.

NOTE [A failed call kills the pool]
After a rank raised, died or stopped answering, the ranks can disagree about which
collectives ran: a collective one rank skipped may have left messages in flight that a later
collective would read. So any failed call kills the pool; the next call on that world size
starts a fresh one. Once one rank has failed, the others get ``failure_grace_s`` to answer
(ranks stuck in a collective the failed rank never entered would otherwise hold the test
until ``timeout_s``).

NOTE [Ranks die with the pool's owner]
A rank reads its pipe only between bodies, so a rank running a body for minutes (a chunk of
the op-database sweep) would outlive a pytest process killed by a signal until the body ends.
Each rank therefore watches the process that started the pool (its own parent is the
forkserver) and exits within ``_OWNER_POLL_S`` of its death.
"""

from __future__ import annotations

import contextlib
import functools
import math
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.context import ForkServerContext, ForkServerProcess
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardsci.tensor._gather_guard import forget_warnings
from shardsci.tensor._registry import outliving_handlers, registered_handlers
from shardsci.tensor._torch_compat import (
    LocalTensorMode,
    _map_to_rank_local_val,
    dtensor_random,
    set_pg_timeout,
    tree_map,
)

__all__ = [
    "RankFailure",
    "RankPool",
    "current_world_size",
    "get_mesh",
    "preload_in_ranks",
    "run_local_tensor",
    "run_on_ranks",
    "shutdown_pools",
]

_HOST = "127.0.0.1"
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo"]
_SEED = 1234
_STARTUP_TIMEOUT_S = 120.0
_SHUTDOWN_GRACE_S = 5.0
_OWNER_POLL_S = 1.0

MeshKey = tuple[tuple[int, ...], tuple[str, ...] | None]


class RankFailure(AssertionError):
    """A rank body raised, died or did not answer in time on at least one rank."""


# ---------------------------------------------------------------------------------------------
# Inside a rank
# ---------------------------------------------------------------------------------------------

_meshes: dict[MeshKey, DeviceMesh] = {}


def current_world_size() -> int:
    """Return the number of ranks running the current rank body.

    Raises
    ------
    RuntimeError
        If called outside a rank body (no default process group).
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "current_world_size() needs a default process group: call it inside a rank body "
            "run by run_on_ranks or run_local_tensor"
        )
    return dist.get_world_size()


def get_mesh(shape: Sequence[int], names: Sequence[str] | None = None) -> DeviceMesh:
    """Return the CPU device mesh of ``shape``, created once per rank and then cached.

    Creating a mesh creates one process group per axis slice, collectively, on every rank;
    caching keeps that cost to the first test that asks for a given mesh.

    Parameters
    ----------
    shape
        Ranks along each mesh axis, row-major over ``arange(world_size)``; their product must
        equal the world size, e.g. ``(4, 2)`` at 8 ranks.
    names
        One name per axis, e.g. ``("dp", "sp")``, or None for unnamed axes.

    Raises
    ------
    ValueError
        If ``shape`` does not cover the world or ``names`` does not name every axis.
    """
    key = (tuple(shape), None if names is None else tuple(names))
    if key not in _meshes:
        _check_mesh_request(*key)
        _meshes[key] = init_device_mesh("cpu", key[0], mesh_dim_names=key[1])
    return _meshes[key]


def _check_mesh_request(shape: tuple[int, ...], names: tuple[str, ...] | None) -> None:
    world_size = current_world_size()
    ranks = math.prod(shape)
    if ranks != world_size:
        raise ValueError(f"mesh shape {shape} holds {ranks} ranks; this body runs on {world_size}")
    if names is not None and len(names) != len(shape):
        raise ValueError(f"mesh names {names} must name each of the {len(shape)} axes of {shape}")


def _worker_main(
    rank: int,
    world_size: int,
    store_port: int,
    collective_timeout_s: float,
    conn: Connection,
    owner_pid: int,
) -> None:
    """Entry point of one rank: join the gloo group, then serve calls until the pipe closes
    or the process that started the pool is gone (NOTE [Ranks die with the pool's owner])."""
    threading.Thread(target=_exit_without_owner, args=(owner_pid,), daemon=True).start()
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore(
            _HOST, store_port, is_master=False, timeout=timedelta(seconds=_STARTUP_TIMEOUT_S)
        )
        # Joining waits for every rank, which a loaded machine can delay past a short
        # collective timeout: join with the startup timeout, then shorten it.
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=max(collective_timeout_s, _STARTUP_TIMEOUT_S)),
        )
        set_pg_timeout(timedelta(seconds=collective_timeout_s))
    except Exception:
        conn.send_bytes(_failure_reply())
        return
    conn.send_bytes(_success_reply(None))
    _serve(conn)
    dist.destroy_process_group()


def _exit_without_owner(owner_pid: int) -> None:
    """Exit this rank at once when process ``owner_pid`` no longer exists."""
    while True:
        time.sleep(_OWNER_POLL_S)
        try:
            os.kill(owner_pid, 0)
        except ProcessLookupError:
            os._exit(1)
        except PermissionError:  # the pid exists (another user's process): keep waiting
            pass


def _serve(conn: Connection) -> None:
    """Answer requests until the parent hangs up (closes the pipe or kills the pool)."""
    while True:
        try:
            request = conn.recv_bytes()
            conn.send_bytes(_run_request(request))
        except (EOFError, BrokenPipeError):
            return


def _run_request(request: bytes) -> bytes:
    """Run one pickled ``(fn, args, kwargs)``; answer with its result or its traceback.

    ``BaseException`` is caught so that ``pytest.fail``/``pytest.skip`` or ``sys.exit`` in a
    body are reported like any other failure instead of killing the rank.
    """
    torch.manual_seed(_SEED)
    before = registered_handlers()  # before unpickling, which may import the test module
    try:
        fn, args, kwargs, filters = pickle.loads(request)
        forget_warnings()  # each body is told of its gathers, whatever ran on this rank before
        with warnings.catch_warnings():
            _take_warning_filters(filters)
            result = fn(*args, **kwargs)
        _check_no_handler_outlives(before)
    except BaseException:
        return _failure_reply()
    try:
        return _success_reply(result)
    except Exception:
        return _failure_reply("the rank body returned a value that cannot be pickled:\n")


def _take_warning_filters(filters: list[tuple[Any, ...]]) -> None:
    """Make the caller's warning filters this rank's (inside ``catch_warnings``): a rank is
    forked from the pool's zygote, which never saw them, so pytest's ``filterwarnings``
    (``error::shardsci.GatherWarning``) would otherwise not reach a rank body."""
    warnings.resetwarnings()
    for action, message, category, module, lineno in reversed(filters):
        warnings.filterwarnings(
            action,
            getattr(message, "pattern", message) or "",  # a compiled pattern, a string or None
            category,
            getattr(module, "pattern", module) or "",
            lineno,
        )


def _check_no_handler_outlives(before: dict[Any, Callable]) -> None:
    """A handler a test registers would stay registered in this rank for every later test
    (the pool outlives tests): fail the test that did it, on every rank alike."""
    outliving = outliving_handlers(before)
    if outliving:
        raise RuntimeError(
            f"handlers registered by this test outlive it in the rank pool: {outliving}; "
            "register them inside shardsci.handlers.scoped_handlers()"
        )


def _success_reply(result: Any) -> bytes:
    return pickle.dumps((True, result, ""))


def _failure_reply(prefix: str = "") -> bytes:
    """Encode the exception being handled: its traceback, and a one-line summary."""
    summary = "".join(traceback.format_exception_only(sys.exc_info()[1])).splitlines()[0]
    return pickle.dumps((False, prefix + traceback.format_exc(), summary))


# ---------------------------------------------------------------------------------------------
# In the parent
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Reply:
    """One rank's answer: its return value if ``ok``, else its traceback and a summary."""

    rank: int
    ok: bool
    value: Any
    summary: str


def preload_in_ranks(*modules: str) -> None:
    """Import ``modules`` once in the zygote every rank is forked from, so that every rank
    starts with them (NOTE [Forking ranks from a clean zygote]); a module that cannot be
    imported there is left to the ranks. Call it before the first pool starts.

    Parameters
    ----------
    *modules
        Names of modules whose import starts no thread and runs no torch op.

    Raises
    ------
    RuntimeError
        If a pool has started: the zygote has imported what it will.
    """
    if _forkserver.cache_info().currsize:
        raise RuntimeError("preload_in_ranks: the ranks' zygote has started; call it earlier")
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


@functools.cache
def _forkserver() -> ForkServerContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


class RankPool:
    """``world_size`` gloo ranks on 127.0.0.1, started once and reused for many calls.

    The parent hosts the ``TCPStore`` the ranks rendezvous on, on a free port. See
    NOTE [Forking ranks from a clean zygote] and NOTE [A failed call kills the pool].

    Parameters
    ----------
    world_size
        Number of ranks (processes).
    collective_timeout_s
        Process-group timeout: a collective that some rank never enters raises on the ranks
        waiting in it after this many seconds.
    failure_grace_s
        Once one rank has failed, how long the others get to answer before the pool is killed.

    Raises
    ------
    ValueError
        If an argument is not positive.
    RuntimeError
        If the ranks do not all join the process group.
    """

    def __init__(
        self, world_size: int, collective_timeout_s: float = 60.0, failure_grace_s: float = 3.0
    ) -> None:
        _check_positive(world_size=world_size)
        _check_positive(collective_timeout_s=collective_timeout_s, failure_grace_s=failure_grace_s)
        self.world_size = world_size
        self.failure_grace_s = failure_grace_s
        self._store = dist.TCPStore(
            _HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        self._processes: list[ForkServerProcess] = []
        self._conns: list[Connection] = []
        try:
            for rank in range(world_size):
                self._start_rank(rank, collective_timeout_s)
            self._await_ready()
        except BaseException:
            self.close(grace_s=0.0)
            raise

    @property
    def closed(self) -> bool:
        """Whether the ranks have been stopped; a closed pool cannot run anything."""
        return not self._processes

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout_s: float = 120.0,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        Parameters
        ----------
        fn, args, kwargs, timeout_s
            As in ``run_on_ranks``.

        Raises
        ------
        RuntimeError
            If the pool is closed.
        TypeError
            If ``fn`` or its arguments cannot be pickled (``fn`` must be module-level).
        RankFailure
            If a rank raised, died, or did not answer within ``timeout_s`` seconds; the pool
            is then closed.
        """
        if self.closed:
            raise RuntimeError(f"this {self.world_size}-rank pool is closed")
        _check_positive(timeout_s=timeout_s)
        request = _encode_request(fn, args, kwargs or {})
        start = time.monotonic()
        try:
            for conn in self._conns:
                # A rank that died since the last call shows up as EOF in _collect.
                with contextlib.suppress(BrokenPipeError):
                    conn.send_bytes(request)
            replies = self._collect(timeout_s)
        except BaseException:
            self.close(grace_s=0.0)
            raise
        if self._all_succeeded(replies):
            return [reply.value for reply in sorted(replies, key=lambda reply: reply.rank)]
        self.close(grace_s=0.0)
        raise RankFailure(
            _describe_failure(_name_of(fn), self.world_size, replies, time.monotonic() - start)
        )

    def close(self, grace_s: float = _SHUTDOWN_GRACE_S) -> None:
        """Stop the ranks: close their pipes, wait up to ``grace_s`` s, kill the rest."""
        for conn in self._conns:
            conn.close()
        deadline = time.monotonic() + grace_s
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self._processes:
            if process.is_alive():
                process.kill()
        for process in self._processes:
            process.join()
            process.close()
        self._conns, self._processes = [], []

    def _start_rank(self, rank: int, collective_timeout_s: float) -> None:
        parent_end, child_end = _forkserver().Pipe()
        owner = os.getpid()
        process = _forkserver().Process(
            target=_worker_main,
            args=(rank, self.world_size, self._store.port, collective_timeout_s, child_end, owner),
            name=f"shardsci-rank{rank}-of-{self.world_size}",
            daemon=True,
        )
        process.start()
        child_end.close()
        self._processes.append(process)
        self._conns.append(parent_end)

    def _await_ready(self) -> None:
        start = time.monotonic()
        replies = self._collect(_STARTUP_TIMEOUT_S)
        if self._all_succeeded(replies):
            return
        elapsed = time.monotonic() - start
        what = f"starting a {self.world_size}-rank gloo pool"
        raise RuntimeError(_describe_failure(what, self.world_size, replies, elapsed))

    def _all_succeeded(self, replies: list[_Reply]) -> bool:
        return len(replies) == self.world_size and all(reply.ok for reply in replies)

    def _collect(self, timeout_s: float) -> list[_Reply]:
        """Wait for one reply per rank, in order of arrival, until the deadline passes."""
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        replies: list[_Reply] = []
        deadline = time.monotonic() + timeout_s
        while pending:
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for conn in sorted(ready, key=pending.__getitem__):
                replies.append(self._receive(conn, pending.pop(conn)))
            if not all(reply.ok for reply in replies):
                deadline = min(deadline, time.monotonic() + self.failure_grace_s)
        return replies

    def _receive(self, conn: Connection, rank: int) -> _Reply:
        try:
            ok, value, summary = pickle.loads(conn.recv_bytes())
        except EOFError:
            death = _describe_death(self._processes[rank])
            return _Reply(rank, False, death, death)
        return _Reply(rank, ok, value, summary)


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value!r}")


def _encode_request(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> bytes:
    """The pickled call, with the caller's warning filters (``_take_warning_filters``)."""
    try:
        return pickle.dumps((fn, tuple(args), kwargs, _picklable_warning_filters()))
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise TypeError(
            f"cannot send {fn!r} and its arguments to the ranks: the body must be a module-level "
            f"function and its arguments picklable ({exc})"
        ) from exc


def _picklable_warning_filters() -> list[tuple[Any, ...]]:
    """The caller's warning filters, but one whose category cannot be pickled (a class
    defined in a function), which a rank could not apply."""
    filters = []
    for entry in warnings.filters:
        try:
            pickle.dumps(entry)
        except (pickle.PicklingError, AttributeError, TypeError):
            continue
        filters.append(entry)
    return filters


def _name_of(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _describe_death(process: ForkServerProcess) -> str:
    process.join(timeout=1.0)
    code = process.exitcode
    if code is not None and code < 0:
        return f"the rank process was killed by {signal.Signals(-code).name}"
    return f"the rank process exited (exit code {code}) without answering"


def _describe_failure(what: str, world_size: int, replies: list[_Reply], elapsed_s: float) -> str:
    """Headline, the first failure's full traceback, then a summary of the later ones."""
    failed = [reply for reply in replies if not reply.ok]
    answered = {reply.rank for reply in replies}
    stuck = [rank for rank in range(world_size) if rank not in answered]
    lines = [f"{what} on {world_size} ranks failed."]
    if failed:
        lines.append(f"Failed ranks, in order of failure: {[reply.rank for reply in failed]}.")
    if stuck:
        lines.append(
            f"Ranks that did not answer within {elapsed_s:.1f} s: {stuck} "
            "(the pool was killed; the next call starts a fresh one)."
        )
    if failed:
        lines.append(f"\nFirst failure, rank {failed[0].rank}:\n{failed[0].value.rstrip()}")
    later: dict[str, list[int]] = {}
    for reply in failed[1:]:
        later.setdefault(reply.summary, []).append(reply.rank)
    lines.extend(f"Then ranks {ranks}: {summary}" for summary, ranks in later.items())
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# One pool per world size, for the whole session
# ---------------------------------------------------------------------------------------------

_pools: dict[int, RankPool] = {}


def run_on_ranks(
    world_size: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0, **kwargs: Any
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return results in rank order.

    The ranks come from a pool kept for the whole session (one per world size, started on
    first use, in about 1-4 s). Each call starts from ``torch.manual_seed(1234)`` on every
    rank; meshes from ``get_mesh`` and other process-level state persist between calls.

    Parameters
    ----------
    world_size
        Number of ranks.
    fn
        A module-level function (it is pickled by reference), run once on each rank with the
        default process group initialised.
    *args, **kwargs
        Picklable arguments, the same on every rank.
    timeout_s
        Seconds to wait for every rank to answer.

    Returns
    -------
    list
        ``fn``'s return value on each rank, in rank order.

    Raises
    ------
    RankFailure
        If a rank raised, died, or did not answer within ``timeout_s``. The message holds the
        first failing rank's full traceback and lists the failed and the stuck ranks. The pool
        is then replaced, so a failure never hangs or poisons later calls.
    TypeError
        If ``fn`` or its arguments cannot be pickled.
    """
    pool = _pools.get(world_size)
    if pool is None or pool.closed:
        pool = _pools[world_size] = RankPool(world_size)
    return pool.run(fn, args, kwargs, timeout_s=timeout_s)


def shutdown_pools() -> None:
    """Stop every pool started by ``run_on_ranks`` (call once, when the session ends)."""
    while _pools:
        _pools.popitem()[1].close()


# ---------------------------------------------------------------------------------------------
# One process, simulated ranks
# ---------------------------------------------------------------------------------------------


def run_local_tensor(
    world_size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` once, in this process, on ``world_size`` simulated ranks.

    ``fn`` runs under ``torch.distributed._local_tensor.LocalTensorMode`` with a ``"fake"``
    default process group: every tensor holds one value per rank and collectives combine
    them, with no processes started (0.1-0.7 s per test). The calling convention and the
    per-rank results match ``run_on_ranks``, so a body written for ``run_on_ranks`` can run
    both ways if it stays within the limits below.

    Limits, seen with torch 2.13; use ``run_on_ranks`` for anything beyond them:

    - Python runs once for all ranks: ``dist.get_rank()`` is 0 and a branch on it takes the
      rank-0 path for every rank, silently. Per-rank values come from tensors (e.g.
      ``_local_tensor.rank_map``) or mesh coordinates (``get_coordinate`` returns per-rank
      ints).
    - ``item()``, ``bool()``, ``tolist()`` of a tensor whose value differs between ranks
      raise, and so does ``assert_close_all_ranks`` on such tensors, even when every rank
      would pass.
    - Uneven shards break autograd through ``to_local``/``from_local`` (per-rank strides
      become symbolic); c10d ``all_to_all_single`` with per-rank split sizes and plain
      ``send``/``isend`` fail (their functional-collective versions work). Good for even
      shards; no substitute for real ranks on uneven shards, halos or p2p.

    Parameters
    ----------
    world_size
        Number of simulated ranks.
    fn, *args, **kwargs
        The rank body and its arguments; ``torch.manual_seed(1234)`` is set first.

    Returns
    -------
    list
        ``fn``'s return value as seen by each rank, in rank order.

    Raises
    ------
    RuntimeError
        If this process already has a default process group.
    """
    _check_positive(world_size=world_size)
    if dist.is_initialized():
        raise RuntimeError(
            "run_local_tensor needs a process without a default process group; "
            f"this one has a {dist.get_backend()!r} group of {dist.get_world_size()} ranks"
        )
    dist.init_process_group("fake", rank=0, world_size=world_size)
    try:
        torch.manual_seed(_SEED)
        with LocalTensorMode(world_size):
            result = fn(*args, **kwargs)
    finally:
        _meshes.clear()
        dtensor_random._rng_tracker = None
        dist.destroy_process_group()
    return [_as_seen_by(rank, result) for rank in range(world_size)]


def _as_seen_by(rank: int, value: Any) -> Any:
    """``value`` with each per-rank leaf (a LocalTensor, a per-rank int) replaced by ``rank``'s."""
    return tree_map(functools.partial(_map_to_rank_local_val, rank=rank), value)
