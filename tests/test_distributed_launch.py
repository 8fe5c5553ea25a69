"""Launch-environment detection, process-group initialisation, and one real 4-rank run."""

from __future__ import annotations

import dataclasses
import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardsci.distributed import (
    LaunchEnv,
    LaunchError,
    build_mesh,
    detect_launch_env,
    device_for_local_rank,
    init_distributed,
)
from shardsci.distributed._launch import expand_hostlist, parse_tasks_per_node

TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "head",
    "MASTER_PORT": "29500",
}
SLURM = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS_PER_NODE": "4",
    "SLURM_JOB_NODELIST": "node[003-004]",
    "SLURM_JOB_ID": "123456",
}


# --- hostlists and task counts ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("single", ["single"]),
        ("a,b", ["a", "b"]),
        ("nid[8-10]", ["nid8", "nid9", "nid10"]),
        (
            "node[001-004,007],gpu-a[1-2]",
            ["node001", "node002", "node003", "node004", "node007", "gpu-a1", "gpu-a2"],
        ),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("n[09-11]", ["n09", "n10", "n11"]),
    ],
)
def test_expand_hostlist(hostlist: str, hosts: list[str]) -> None:
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(
    ("hostlist", "problem"),
    [
        ("node[1-2", "unclosed bracket"),
        ("node]1[", "unbalanced or nested"),
        ("node[[1]]", "unbalanced or nested"),
        ("a,,b", "empty host"),
        ("", "empty host"),
        ("node[3-1]", "ends before it starts"),
        ("node[a-b]", "'a-b' is not a number"),
        ("node[]", "'' is not a number"),
    ],
)
def test_expand_hostlist_rejects_malformed(hostlist: str, problem: str) -> None:
    with pytest.raises(LaunchError, match=problem) as error:
        expand_hostlist(hostlist)
    assert repr(hostlist) in str(error.value)


@pytest.mark.parametrize(
    ("value", "counts"),
    [("4", [4]), ("4(x2)", [4, 4]), ("2,1", [2, 1]), ("2(x3),1", [2, 2, 2, 1])],
)
def test_parse_tasks_per_node(value: str, counts: list[int]) -> None:
    assert parse_tasks_per_node(value) == counts


@pytest.mark.parametrize("value", ["a", "4(x)", "4x2", "2,,1"])
def test_parse_tasks_per_node_rejects_malformed(value: str) -> None:
    with pytest.raises(LaunchError, match="SLURM_TASKS_PER_NODE"):
        parse_tasks_per_node(value)


# --- detection -------------------------------------------------------------------------------


def test_single_process_without_launcher() -> None:
    assert detect_launch_env({}) == LaunchEnv(0, 1, 0, 1, "127.0.0.1", 0, "single")


def test_single_process_keeps_master_address_and_port() -> None:
    env = detect_launch_env({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert (env.launcher, env.master_addr, env.master_port) == ("single", "10.0.0.1", 1234)


def test_torchrun() -> None:
    assert detect_launch_env(TORCHRUN) == LaunchEnv(3, 8, 1, 2, "head", 29500, "torchrun")


def test_torchrun_takes_precedence_over_slurm() -> None:
    assert detect_launch_env({**SLURM, **TORCHRUN}).launcher == "torchrun"


def test_partial_torchrun_is_an_error_even_beside_slurm() -> None:
    partial = {key: TORCHRUN[key] for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    with pytest.raises(LaunchError, match="torchrun") as error:
        detect_launch_env({**SLURM, **partial})
    message = str(error.value)
    assert "LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_PORT missing" in message


def test_slurm() -> None:
    expected = LaunchEnv(5, 8, 1, 4, "node003", 20000 + 123456 % 10000, "slurm")
    assert detect_launch_env(SLURM) == expected


@pytest.mark.parametrize("missing", ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"])
def test_partial_slurm_names_the_missing_variable(missing: str) -> None:
    environ = {key: value for key, value in SLURM.items() if key != missing}
    with pytest.raises(LaunchError, match=f"slurm environment: .* set but {missing} missing"):
        detect_launch_env(environ)


def test_blank_variable_counts_as_missing() -> None:
    with pytest.raises(LaunchError, match="MASTER_PORT missing"):
        detect_launch_env({**TORCHRUN, "MASTER_PORT": " "})


@pytest.mark.parametrize(
    ("extra", "local_world_size"),
    [
        ({"SLURM_TASKS_PER_NODE": "4(x2)"}, 4),
        ({"SLURM_TASKS_PER_NODE": "6,2", "SLURM_NODEID": "1"}, 2),
        ({"SLURM_TASKS_PER_NODE": "3(x2),2"}, 3),
        ({"SLURM_TASKS_PER_NODE": "5,3"}, 3),
        ({}, 8),
    ],
)
def test_slurm_local_world_size(extra: dict[str, str], local_world_size: int) -> None:
    environ = {key: value for key, value in SLURM.items() if key != "SLURM_NTASKS_PER_NODE"}
    assert detect_launch_env({**environ, **extra}).local_world_size == local_world_size


def test_slurm_ntasks_per_node_beats_tasks_per_node() -> None:
    environ = {**SLURM, "SLURM_TASKS_PER_NODE": "2(x4)"}
    assert detect_launch_env(environ).local_world_size == 4


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        ({"SLURM_TASKS_PER_NODE": "2,2", "SLURM_NODEID": "2"}, "SLURM_NODEID=2 is out of range"),
        ({"SLURM_TASKS_PER_NODE": "2,2", "SLURM_NTASKS": "6"}, "SLURM_PROCID=5 is beyond"),
    ],
)
def test_slurm_task_layout_errors(extra: dict[str, str], problem: str) -> None:
    environ = {key: value for key, value in SLURM.items() if key != "SLURM_NTASKS_PER_NODE"}
    with pytest.raises(LaunchError, match=problem):
        detect_launch_env({**environ, **extra})


@pytest.mark.parametrize(
    ("extra", "master_addr"),
    [
        ({}, "node003"),
        ({"SLURM_LAUNCH_NODE_IPADDR": "10.1.2.3"}, "10.1.2.3"),
        ({"SLURM_LAUNCH_NODE_IPADDR": "10.1.2.3", "MASTER_ADDR": "head"}, "head"),
    ],
)
def test_slurm_master_addr_precedence(extra: dict[str, str], master_addr: str) -> None:
    assert detect_launch_env({**SLURM, **extra}).master_addr == master_addr


def test_slurm_master_port_from_environment_or_job_id() -> None:
    assert detect_launch_env({**SLURM, "MASTER_PORT": "4242"}).master_port == 4242
    ports = {
        detect_launch_env({**SLURM, "SLURM_JOB_ID": str(job)}).master_port for job in range(99)
    }
    assert len(ports) == 99
    assert all(20000 <= port < 30000 for port in ports)


@pytest.mark.parametrize(
    ("absent", "problem"),
    [
        ("SLURM_JOB_NODELIST", "MASTER_ADDR, SLURM_LAUNCH_NODE_IPADDR or SLURM_JOB_NODELIST"),
        ("SLURM_JOB_ID", "set MASTER_PORT or SLURM_JOB_ID"),
    ],
)
def test_slurm_without_rendezvous_names_the_variables(absent: str, problem: str) -> None:
    environ = {key: value for key, value in SLURM.items() if key != absent}
    with pytest.raises(LaunchError, match=problem):
        detect_launch_env(environ)


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        ({"RANK": "8"}, "torchrun launch: rank is 8, expected 0 <= rank < 8"),
        ({"RANK": "-1"}, "rank is -1"),
        ({"WORLD_SIZE": "0"}, "world size is 0, expected >= 1"),
        ({"LOCAL_RANK": "2"}, "local rank is 2, expected 0 <= local rank < 2"),
        ({"LOCAL_WORLD_SIZE": "9"}, "local world size is 9, expected 1 <= local world size <= 8"),
        ({"MASTER_PORT": "70000"}, "master port is 70000, expected 1 to 65535"),
        ({"MASTER_PORT": "0"}, "master port is 0"),
        ({"RANK": "three"}, "RANK='three' is not an integer"),
    ],
)
def test_torchrun_values_are_validated(override: dict[str, str], problem: str) -> None:
    with pytest.raises(LaunchError, match=problem):
        detect_launch_env({**TORCHRUN, **override})


def test_slurm_rank_is_validated() -> None:
    with pytest.raises(LaunchError, match="slurm launch: rank is 8, expected 0 <= rank < 8"):
        detect_launch_env({**SLURM, "SLURM_PROCID": "8"})


def test_launch_env_is_frozen_and_checks_launcher() -> None:
    env = detect_launch_env({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        env.rank = 1  # type: ignore[misc]
    with pytest.raises(LaunchError, match="launcher 'mpi' is not one of"):
        dataclasses.replace(env, launcher="mpi")  # type: ignore[arg-type]


def test_device_for_local_rank_on_cpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU fallback")
    assert device_for_local_rank(detect_launch_env(TORCHRUN)) == torch.device("cpu")


# --- init_distributed ------------------------------------------------------------------------


@pytest.fixture
def no_process_group():
    """Run a test with no default process group, and destroy whatever it creates."""
    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process")
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_init_single_process_is_idempotent(no_process_group: None) -> None:
    env = init_distributed(environ={})
    assert (env.launcher, env.rank, env.world_size, dist.get_backend()) == ("single", 0, 1, "gloo")
    assert env.master_port > 0
    assert init_distributed(environ={}).world_size == 1


def test_init_rejects_a_disagreeing_group(no_process_group: None) -> None:
    init_distributed(environ={})
    with pytest.raises(LaunchError, match=r"already initialised as rank 0 of 1.*rank 3 of 8"):
        init_distributed(environ=TORCHRUN)


@pytest.mark.parametrize(
    ("timeout_s", "environ", "seconds"),
    [(None, {}, 300.0), (None, {"SHARDSCI_TIMEOUT_S": "12.5"}, 12.5), (7, {}, 7.0)],
)
def test_init_always_passes_a_timeout(
    monkeypatch: pytest.MonkeyPatch, timeout_s: float | None, environ: dict, seconds: float
) -> None:
    calls: list[dict] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    init_distributed(timeout_s=timeout_s, environ={**TORCHRUN, **environ})
    assert calls == [
        {
            "backend": "nccl" if torch.cuda.is_available() else "gloo",
            "init_method": "tcp://head:29500",
            "rank": 3,
            "world_size": 8,
            "timeout": timedelta(seconds=seconds),
        }
    ]


@pytest.mark.parametrize(
    ("timeout_s", "environ", "problem"),
    [
        (None, {"SHARDSCI_TIMEOUT_S": "soon"}, "SHARDSCI_TIMEOUT_S='soon' is not a number"),
        (None, {"SHARDSCI_TIMEOUT_S": "0"}, "SHARDSCI_TIMEOUT_S=0.0: expected a positive"),
        (-1.0, {}, "timeout_s=-1.0: expected a positive"),
        (float("inf"), {}, "timeout_s=inf"),
    ],
)
def test_init_rejects_bad_timeouts(
    monkeypatch: pytest.MonkeyPatch, timeout_s: float | None, environ: dict, problem: str
) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(LaunchError, match=problem):
        init_distributed(timeout_s=timeout_s, environ={**TORCHRUN, **environ})


# --- four real gloo processes under a simulated srun -----------------------------------------

WORLD_SIZE = 4


def _srun_task(rank: int, port: int, results: mp.SimpleQueue) -> None:
    """One simulated srun task: init from SLURM variables, build a 2x2 mesh, all-reduce."""
    torch.set_num_threads(1)
    for name in [*TORCHRUN, *(name for name in os.environ if name.startswith("SLURM_"))]:
        os.environ.pop(name, None)
    os.environ.update(
        SLURM_PROCID=str(rank),
        SLURM_NTASKS=str(WORLD_SIZE),
        SLURM_LOCALID=str(rank),
        SLURM_TASKS_PER_NODE=str(WORLD_SIZE),
        SLURM_LAUNCH_NODE_IPADDR="127.0.0.1",
        MASTER_PORT=str(port),
        SHARDSCI_TIMEOUT_S="30",
    )
    env = init_distributed()
    mesh = build_mesh("2x2", ("dp", "domain"))
    sums = {}
    for axis in ("dp", "domain"):
        value = torch.tensor([float(rank)])
        dist.all_reduce(value, group=mesh.get_group(axis))
        sums[axis] = value.item()
    results.put((rank, env, tuple(mesh.get_coordinate()), mesh.mesh_dim_names, sums))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(60)
def test_four_srun_tasks_build_a_row_major_mesh(monkeypatch: pytest.MonkeyPatch) -> None:
    # A forkserver that has imported torch forks fresh ranks in ~1 s on 2 cores (spawn: 3-8 s),
    # and unlike plain fork they inherit neither this process's threads nor its process group.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", __name__])
    results = context.SimpleQueue()
    args = (_free_port(), results)
    mp.start_processes(_srun_task, args=args, nprocs=WORLD_SIZE, start_method="forkserver")
    by_rank = {}
    while not results.empty():
        rank, *rest = results.get()
        by_rank[rank] = rest
    assert sorted(by_rank) == list(range(WORLD_SIZE))
    for rank, (env, coordinate, names, sums) in by_rank.items():
        dp, domain = divmod(rank, 2)
        assert (env.launcher, env.rank, env.world_size, env.local_world_size) == (
            "slurm",
            rank,
            WORLD_SIZE,
            WORLD_SIZE,
        )
        assert coordinate == (dp, domain)
        assert names == ("dp", "domain")
        assert sums == {"domain": 2 * dp + 2 * dp + 1, "dp": domain + domain + 2}
