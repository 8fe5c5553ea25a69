"""Detect how this process was launched and initialise the default process group.

Three launchers are recognised, in this order of precedence:

1. ``torchrun``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``
   and ``MASTER_PORT`` (any of the first four marks a torchrun launch).
2. ``slurm`` (one ``srun`` task per process): ``SLURM_PROCID``, ``SLURM_NTASKS`` and
   ``SLURM_LOCALID`` (any of them marks a Slurm launch), with the per-node task count, the
   master address and the master port derived as described in :func:`detect_launch_env`.
3. ``single``: none of the above; one process, rank 0 of 1.

A launcher whose variables are only partly present is an error, never a silent fallback to
the next launcher: a half-configured rank that ran alone would leave its peers waiting.
"""

from __future__ import annotations

import math
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

Launcher = Literal["torchrun", "slurm", "single"]

TORCHRUN_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
"""Variables torchrun sets for every worker; all are required once any rank variable is set."""

SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
"""Variables srun sets for every task; all are required once any of them is set."""

TIMEOUT_VAR = "SHARDSCI_TIMEOUT_S"
"""Environment variable giving the collective timeout in seconds."""

DEFAULT_TIMEOUT_S = 300.0
"""Collective timeout when neither ``timeout_s`` nor :data:`TIMEOUT_VAR` is given."""

_TORCHRUN_MARKERS = TORCHRUN_VARS[:4]
_SLURM_PORT_BASE = 20000
_SLURM_PORT_SPAN = 10000
_TASKS_ITEM = re.compile(r"(\d+)(?:\(x(\d+)\))?")
_HOST_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


class LaunchError(ValueError):
    """The launch environment is incomplete or inconsistent."""


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits among the processes of one job.

    Every instance is validated on construction, so a ``LaunchEnv`` always describes a
    consistent rank.
    """

    rank: int
    """Global rank of this process, in ``[0, world_size)``."""

    world_size: int
    """Number of processes in the job."""

    local_rank: int
    """Rank of this process on its node, in ``[0, local_world_size)``; selects the GPU."""

    local_world_size: int
    """Number of processes on this node."""

    master_addr: str
    """Host (name or IP address) on which rank 0 serves the rendezvous store."""

    master_port: int
    """TCP port of the rendezvous store; ``0`` (single launcher only) means "pick a free port"."""

    launcher: Launcher
    """Which launcher started the process: ``"torchrun"``, ``"slurm"`` or ``"single"``."""

    def __post_init__(self) -> None:
        if self.launcher not in ("torchrun", "slurm", "single"):
            raise LaunchError(
                f"launcher {self.launcher!r} is not one of 'torchrun', 'slurm', 'single'"
            )
        world, local_world = self.world_size, self.local_world_size
        lowest_port = 0 if self.launcher == "single" else 1
        checks = (
            (world >= 1, f"world size is {world}, expected >= 1"),
            (0 <= self.rank < world, f"rank is {self.rank}, expected 0 <= rank < {world}"),
            (
                1 <= local_world <= world,
                f"local world size is {local_world}, expected 1 <= local world size <= {world}",
            ),
            (
                0 <= self.local_rank < local_world,
                f"local rank is {self.local_rank}, expected 0 <= local rank < {local_world}",
            ),
            (
                lowest_port <= self.master_port <= 65535,
                f"master port is {self.master_port}, expected {lowest_port} to 65535",
            ),
            (bool(self.master_addr), "master address is empty"),
        )
        for holds, problem in checks:
            if not holds:
                raise LaunchError(f"{self.launcher} launch: {problem}")


def _get(environ: Mapping[str, str], name: str) -> str | None:
    """Value of ``name``, or ``None`` when it is unset or blank."""
    value = environ.get(name, "").strip()
    return value or None


def _read_int(environ: Mapping[str, str], name: str) -> int:
    """Parse the integer variable ``name``, which must be set."""
    value = environ[name].strip()
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{name}={value!r} is not an integer") from None


def _require(
    environ: Mapping[str, str], names: tuple[str, ...], launcher: str, hint: str = ""
) -> None:
    """Raise naming every variable of ``names`` that is missing from ``environ``."""
    missing = [name for name in names if _get(environ, name) is None]
    if missing:
        found = [name for name in names if name not in missing]
        raise LaunchError(
            f"incomplete {launcher} environment: {', '.join(found)} set but "
            f"{', '.join(missing)} missing; a {launcher} launch needs all of "
            f"{', '.join(names)}{hint}"
        )


def detect_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Work out this process's rank and rendezvous point from its environment.

    Parameters
    ----------
    environ
        Environment variables to read; ``os.environ`` when ``None``.

    Returns
    -------
    LaunchEnv
        The validated launch environment.

    Raises
    ------
    LaunchError
        If a launcher's variables are only partly present (the message names the missing
        ones), a value is not an integer, or the values are inconsistent.

    Notes
    -----
    Under Slurm, the per-node task count comes from ``SLURM_NTASKS_PER_NODE``, else from
    ``SLURM_TASKS_PER_NODE`` (``"4"``, ``"4(x2)"``, ``"2,1"``) at this task's node
    (``SLURM_NODEID``, or the node that holds this rank under block distribution), else the
    job is taken to run on one node. The master address is ``MASTER_ADDR``, else
    ``SLURM_LAUNCH_NODE_IPADDR``, else the first host of ``SLURM_JOB_NODELIST``. The master
    port is ``MASTER_PORT``, else ``20000 + SLURM_JOB_ID % 10000``, so every task of a job
    agrees on it without communicating.
    """
    environ = os.environ if environ is None else environ
    if any(_get(environ, name) is not None for name in _TORCHRUN_MARKERS):
        return _torchrun_env(environ)
    if any(_get(environ, name) is not None for name in SLURM_VARS):
        return _slurm_env(environ)
    return LaunchEnv(
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        master_addr=_get(environ, "MASTER_ADDR") or "127.0.0.1",
        master_port=_read_int(environ, "MASTER_PORT") if _get(environ, "MASTER_PORT") else 0,
        launcher="single",
    )


def _torchrun_env(environ: Mapping[str, str]) -> LaunchEnv:
    """Launch environment of a torchrun worker."""
    _require(environ, TORCHRUN_VARS, "torchrun")
    return LaunchEnv(
        rank=_read_int(environ, "RANK"),
        world_size=_read_int(environ, "WORLD_SIZE"),
        local_rank=_read_int(environ, "LOCAL_RANK"),
        local_world_size=_read_int(environ, "LOCAL_WORLD_SIZE"),
        master_addr=environ["MASTER_ADDR"].strip(),
        master_port=_read_int(environ, "MASTER_PORT"),
        launcher="torchrun",
    )


def _slurm_env(environ: Mapping[str, str]) -> LaunchEnv:
    """Launch environment of an srun task."""
    _require(environ, SLURM_VARS, "slurm", hint=" (launch each process as an srun task)")
    rank = _read_int(environ, "SLURM_PROCID")
    world_size = _read_int(environ, "SLURM_NTASKS")
    return LaunchEnv(
        rank=rank,
        world_size=world_size,
        local_rank=_read_int(environ, "SLURM_LOCALID"),
        local_world_size=_slurm_local_world_size(environ, rank, world_size),
        master_addr=_slurm_master_addr(environ),
        master_port=_slurm_master_port(environ),
        launcher="slurm",
    )


def _slurm_local_world_size(environ: Mapping[str, str], rank: int, world_size: int) -> int:
    """Number of tasks on this task's node."""
    if _get(environ, "SLURM_NTASKS_PER_NODE") is not None:
        return _read_int(environ, "SLURM_NTASKS_PER_NODE")
    tasks_per_node = _get(environ, "SLURM_TASKS_PER_NODE")
    if tasks_per_node is None:
        return world_size
    counts = parse_tasks_per_node(tasks_per_node)
    if _get(environ, "SLURM_NODEID") is not None:
        node = _read_int(environ, "SLURM_NODEID")
    else:
        node = _block_node_of(rank, counts, tasks_per_node)
    if not 0 <= node < len(counts):
        raise LaunchError(
            f"SLURM_NODEID={node} is out of range for SLURM_TASKS_PER_NODE={tasks_per_node!r} "
            f"({len(counts)} nodes)"
        )
    return counts[node]


def _block_node_of(rank: int, counts: list[int], tasks_per_node: str) -> int:
    """Node holding ``rank`` when tasks fill nodes in order (Slurm's block distribution)."""
    first_rank = 0
    for node, count in enumerate(counts):
        first_rank += count
        if rank < first_rank:
            return node
    raise LaunchError(
        f"SLURM_PROCID={rank} is beyond the {first_rank} tasks of "
        f"SLURM_TASKS_PER_NODE={tasks_per_node!r}"
    )


def _slurm_master_addr(environ: Mapping[str, str]) -> str:
    """Rendezvous host of a Slurm job."""
    addr = _get(environ, "MASTER_ADDR") or _get(environ, "SLURM_LAUNCH_NODE_IPADDR")
    if addr is not None:
        return addr
    nodelist = _get(environ, "SLURM_JOB_NODELIST")
    if nodelist is None:
        raise LaunchError(
            "slurm launch has no master address: set MASTER_ADDR, SLURM_LAUNCH_NODE_IPADDR "
            "or SLURM_JOB_NODELIST"
        )
    return expand_hostlist(nodelist)[0]


def _slurm_master_port(environ: Mapping[str, str]) -> int:
    """Rendezvous port of a Slurm job, the same on every task."""
    if _get(environ, "MASTER_PORT") is not None:
        return _read_int(environ, "MASTER_PORT")
    if _get(environ, "SLURM_JOB_ID") is None:
        raise LaunchError("slurm launch has no master port: set MASTER_PORT or SLURM_JOB_ID")
    return _SLURM_PORT_BASE + _read_int(environ, "SLURM_JOB_ID") % _SLURM_PORT_SPAN


def parse_tasks_per_node(value: str) -> list[int]:
    """Expand Slurm's ``SLURM_TASKS_PER_NODE`` into one task count per node.

    Parameters
    ----------
    value
        Comma-separated counts, each optionally repeated: ``"2(x3),1"``.

    Returns
    -------
    list[int]
        Task count of each node in order, e.g. ``[2, 2, 2, 1]``.
    """
    counts: list[int] = []
    for item in value.split(","):
        match = _TASKS_ITEM.fullmatch(item.strip())
        if match is None:
            raise LaunchError(
                f"SLURM_TASKS_PER_NODE={value!r}: item {item!r} is not of the form N or N(xM)"
            )
        count, repeat = match.groups()
        counts.extend([int(count)] * int(repeat or 1))
    return counts


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm hostlist expression into host names.

    Parameters
    ----------
    hostlist
        Comma-separated hosts with bracketed ranges, e.g. ``"node[001-004,007],gpu-a[1-2]"``.
        Zero padding of a range's start is kept; several bracket groups in one host expand
        to their product, leftmost group outermost.

    Returns
    -------
    list[str]
        Host names in order: ``["node001", ..., "node004", "node007", "gpu-a1", "gpu-a2"]``.
    """
    return [host for pattern in _split_hosts(hostlist) for host in _expand_host(pattern, hostlist)]


def _split_hosts(hostlist: str) -> list[str]:
    """Split ``hostlist`` at the commas outside brackets."""
    patterns, start, depth = [], 0, 0
    for index, char in enumerate(hostlist):
        depth += (char == "[") - (char == "]")
        if depth not in (0, 1):
            raise LaunchError(f"hostlist {hostlist!r} has unbalanced or nested brackets")
        if char == "," and depth == 0:
            patterns.append(hostlist[start:index])
            start = index + 1
    patterns.append(hostlist[start:])
    if depth != 0 or not all(pattern.strip() for pattern in patterns):
        raise LaunchError(f"hostlist {hostlist!r} has an unclosed bracket or an empty host")
    return [pattern.strip() for pattern in patterns]


def _expand_host(pattern: str, hostlist: str) -> list[str]:
    """Expand one host pattern with balanced, unnested brackets, such as ``"r[1-2]-n[01-02]"``."""
    if "[" not in pattern:
        return [pattern]
    start = pattern.index("[")
    end = pattern.index("]", start)
    tails = _expand_host(pattern[end + 1 :], hostlist)
    numbers = _expand_ranges(pattern[start + 1 : end], hostlist)
    return [pattern[:start] + number + tail for number in numbers for tail in tails]


def _expand_ranges(ranges: str, hostlist: str) -> list[str]:
    """Expand the inside of one bracket, e.g. ``"001-003,7"``, keeping zero padding."""
    numbers = []
    for item in ranges.split(","):
        match = _HOST_RANGE.fullmatch(item.strip())
        if match is None:
            raise LaunchError(f"hostlist {hostlist!r}: {item!r} is not a number or a range N-M")
        low, high = match.groups()
        width, last = len(low), int(high if high is not None else low)
        if last < int(low):
            raise LaunchError(f"hostlist {hostlist!r}: range {item!r} ends before it starts")
        numbers.extend(f"{number:0{width}d}" for number in range(int(low), last + 1))
    return numbers


def device_for_local_rank(env: LaunchEnv) -> torch.device:
    """The device this process computes on: its local GPU, or the CPU when there is no CUDA.

    Parameters
    ----------
    env
        This process's launch environment.

    Returns
    -------
    torch.device
        ``cuda:<local_rank>`` when CUDA is available, else ``cpu``.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if env.local_rank >= count:
        raise LaunchError(
            f"local rank {env.local_rank} has no GPU: only {count} CUDA device(s) are visible; "
            f"launch at most {count} processes per node"
        )
    return torch.device("cuda", env.local_rank)


def init_distributed(
    backend: str | None = None,
    timeout_s: float | None = None,
    environ: Mapping[str, str] | None = None,
) -> LaunchEnv:
    """Initialise the default process group from the launch environment.

    Idempotent: when the default group already exists, it is checked against the launch
    environment and left alone. A single process with no launcher gets a 1-rank gloo group on
    a free local port, so DeviceMesh code runs the same way at every scale.

    Parameters
    ----------
    backend
        Process-group backend; ``"nccl"`` when CUDA is available, else ``"gloo"``.
    timeout_s
        Seconds a collective may wait before failing with an error; defaults to
        ``SHARDSCI_TIMEOUT_S``, else 300. A rank that skips a collective then makes the
        others fail instead of hanging.
    environ
        Environment variables to read; ``os.environ`` when ``None``.

    Returns
    -------
    LaunchEnv
        This process's launch environment; when this call created the group, with the port
        it actually used.

    Raises
    ------
    LaunchError
        If the environment is incomplete or inconsistent, or an existing default group
        disagrees with it.
    """
    environ = os.environ if environ is None else environ
    env = detect_launch_env(environ)
    if dist.is_initialized():
        _check_agrees(env)
        return env
    if torch.cuda.is_available():
        torch.cuda.set_device(device_for_local_rank(env))
    if env.master_port == 0:
        env = replace(env, master_port=_free_port())
    timeout = timedelta(seconds=_timeout_s(timeout_s, environ))
    rendezvous: dict[str, Any] = {"init_method": _tcp_url(env)}
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        rendezvous = {"store": _agent_store(env, timeout, environ)}
    dist.init_process_group(
        backend=backend or ("nccl" if torch.cuda.is_available() else "gloo"),
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
        **rendezvous,
    )
    return env


def _agent_store(env: LaunchEnv, timeout: timedelta, environ: Mapping[str, str]) -> dist.Store:
    """torchrun's agent store, under a prefix of its own for each restart.

    The agent keeps one store for all restarts of its workers, and torch's rendezvous reuses
    its keys as they are: after ``--max-restarts`` restarted the workers, a new rank could read
    the address a dead rank of the previous attempt left under the same key, and gloo's
    connection to it fails (seen with torch 2.13).
    """
    store = dist.TCPStore(
        env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout
    )
    attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"shardsci/attempt_{attempt}/", store)


def _check_agrees(env: LaunchEnv) -> None:
    """Raise if the existing default group is not the one ``env`` describes."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if (rank, world_size) != (env.rank, env.world_size):
        raise LaunchError(
            f"the default process group is already initialised as rank {rank} of {world_size}, "
            f"but the {env.launcher} launch environment says rank {env.rank} of {env.world_size}"
        )


def _timeout_s(timeout_s: float | None, environ: Mapping[str, str]) -> float:
    """Collective timeout in seconds: the argument, else the environment, else the default."""
    if timeout_s is not None:
        source, value = "timeout_s", timeout_s
    elif _get(environ, TIMEOUT_VAR) is not None:
        source, text = TIMEOUT_VAR, environ[TIMEOUT_VAR].strip()
        try:
            value = float(text)
        except ValueError:
            raise LaunchError(f"{TIMEOUT_VAR}={text!r} is not a number of seconds") from None
    else:
        return DEFAULT_TIMEOUT_S
    if not 0 < value < math.inf:
        raise LaunchError(f"{source}={value!r}: expected a positive, finite number of seconds")
    return value


def _free_port() -> int:
    """A TCP port that was free on this host a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _tcp_url(env: LaunchEnv) -> str:
    """``tcp://`` rendezvous URL of ``env``, with IPv6 addresses bracketed."""
    host = f"[{env.master_addr}]" if ":" in env.master_addr else env.master_addr
    return f"tcp://{host}:{env.master_port}"
