"""The multi-rank harness: results, meshes, failures, timeouts, recovery, collective asserts.

Rank bodies are module-level functions (``_``-prefixed so pytest does not collect them): they
are pickled by reference and imported by the ranks from ``tests.test_harness``.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

from shardsci import GatherWarning
from shardsci.testing import (
    RankFailure,
    _pool,
    assert_all_ranks,
    assert_close_all_ranks,
    assert_raises_all_ranks,
    current_world_size,
    get_mesh,
    run_local_tensor,
    run_on_ranks,
)
from shardsci.testing._pool import RankPool

# ---------------------------------------------------------------------------------------------
# Rank bodies
# ---------------------------------------------------------------------------------------------


def _rank_and_sum() -> tuple[int, float]:
    value = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(value)
    return dist.get_rank(), value.item()


def _mesh_view(
    shape: tuple[int, ...], names: tuple[str, ...]
) -> tuple[tuple[int, ...], list[Any], bool, int]:
    mesh = get_mesh(shape, names)
    cached = mesh is get_mesh(shape, names)
    return mesh.get_coordinate(), mesh.mesh.tolist(), cached, current_world_size()


def _raise_on_rank(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    return dist.get_rank()


def _raise_on_rank_0_before_all_reduce() -> None:
    if dist.get_rank() == 0:
        raise RuntimeError("rank 0 gives up before the all_reduce")
    dist.all_reduce(torch.ones(1))


def _skip_all_reduce_on_rank_0() -> None:
    if dist.get_rank() != 0:
        dist.all_reduce(torch.ones(1))


def _kill_rank_1() -> None:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)


def _exit_rank_1_after_answering() -> None:
    if dist.get_rank() == 1:
        threading.Timer(0.1, os._exit, (3,)).start()


def _return_unpicklable() -> Callable[[], None]:
    return lambda: None


def _random_draw() -> list[float]:
    return torch.rand(3).tolist()


def _message_of(check: Callable[..., Any], *args: Any, **kwargs: Any) -> str | None:
    """Run a collective check and return its assertion message, or None if it passed.

    Every rank then enters a barrier: a check that let one rank run ahead would hang here.
    """
    try:
        check(*args, **kwargs)
    except AssertionError as exc:
        message: str | None = str(exc)
    else:
        message = None
    dist.barrier()
    return message


def _check_all_ranks(bad_rank: int | None) -> str | None:
    rank = dist.get_rank()
    return _message_of(assert_all_ranks, rank != bad_rank, f"rank {rank} disagrees")


def _fail_uncaught_on_rank_3() -> None:
    assert_all_ranks(dist.get_rank() != 3, "rank 3 is odd")


def _compare_field(bad_rank: int | None, wrong_shape: bool) -> str | None:
    expected = torch.arange(6.0).view(2, 3)
    actual = expected.clone()
    if dist.get_rank() == bad_rank:
        actual = actual[:, :2] if wrong_shape else actual + torch.tensor([0.0, 0.0, 0.5])
    return _message_of(assert_close_all_ranks, actual, expected, atol=1e-6, rtol=0, what="field")


def _raise_value_error_except_on(spared_rank: int | None) -> None:
    if dist.get_rank() != spared_rank:
        raise ValueError(f"bad halo size on rank {dist.get_rank()}")


def _check_raises(spared_rank: int | None, match: str) -> str | None:
    return _message_of(
        assert_raises_all_ranks, ValueError, match, _raise_value_error_except_on, spared_rank
    )


def _caught_by_assert_raises() -> str:
    exc = assert_raises_all_ranks(ValueError, r"halo size", _raise_value_error_except_on, None)
    return str(exc)


def _send_count(src: int, dst: int) -> int:
    """Rows that rank ``src`` sends to rank ``dst``: 0-2, and none at all from rank 0."""
    return 0 if src == 0 else (src + dst) % 3


def _tagged_rows(src: int, dst: int) -> torch.Tensor:
    """The ``(n, 2)`` rows ``src`` sends to ``dst``, each holding ``[src, dst]``."""
    return torch.tensor([[float(src), float(dst)]]).repeat(_send_count(src, dst), 1)


def _uneven_all_to_all() -> int:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    peers = range(world_size)
    sent = torch.cat([_tagged_rows(rank, dst) for dst in peers])
    expected = torch.cat([_tagged_rows(src, rank) for src in peers])
    received = torch.empty_like(expected)
    dist.all_to_all_single(
        received,
        sent,
        output_split_sizes=[_send_count(src, rank) for src in peers],
        input_split_sizes=[_send_count(rank, dst) for dst in peers],
    )
    assert_close_all_ranks(received, expected, atol=0, rtol=0, what="received rows")
    return received.shape[0]


def _double_even_shards(shape: tuple[int, ...]) -> torch.Tensor:
    """Double an ``(8, 4)`` field sharded evenly over every mesh axis; return the local shard."""
    field = torch.randn(8, 4)
    sharded = distribute_tensor(field, get_mesh(shape), [Shard(dim) for dim in range(len(shape))])
    doubled = sharded * 2
    assert_close_all_ranks(doubled.full_tensor(), 2 * field, atol=1e-6, rtol=0, what="field")
    return doubled.to_local()


def _nest_run_local_tensor() -> list[Any]:
    return run_local_tensor(2, _random_draw)


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_all_reduce_sums_over_ranks_and_results_come_in_rank_order(world_size: int) -> None:
    total = world_size * (world_size + 1) / 2
    assert run_on_ranks(world_size, _rank_and_sum) == [(r, total) for r in range(world_size)]


@pytest.mark.parametrize("shape", [(2, 2), (4, 2)])
def test_mesh_coordinates_follow_the_row_major_rank_grid(shape: tuple[int, int]) -> None:
    world_size = math.prod(shape)
    grid = torch.arange(world_size).view(shape)
    results = run_on_ranks(world_size, _mesh_view, shape, ("dp", "sp"))
    for rank, (coordinate, mesh, cached, reported_world_size) in enumerate(results):
        assert tuple(coordinate) == tuple((grid == rank).nonzero()[0].tolist())
        assert mesh == grid.tolist()
        assert cached
        assert reported_world_size == world_size


def test_mesh_that_does_not_cover_the_world_is_rejected() -> None:
    with pytest.raises(RankFailure, match=r"mesh shape \(3,\) holds 3 ranks; this body runs on 2"):
        run_on_ranks(2, _mesh_view, (3,), ("x",))


def test_failure_on_one_rank_reports_its_traceback_and_the_pool_recovers() -> None:
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(4, _raise_on_rank, 2)
    message = str(failure.value)
    assert "Failed ranks, in order of failure: [2]." in message
    assert "First failure, rank 2:\nTraceback" in message
    assert "in _raise_on_rank" in message
    assert "ValueError: deliberate failure on rank 2" in message
    assert "did not answer" not in message
    assert run_on_ranks(4, _rank_and_sum) == [(r, 10.0) for r in range(4)]


def test_rank_failing_before_a_collective_is_reported_with_the_stuck_ranks() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(4, _raise_on_rank_0_before_all_reduce, timeout_s=20)
    assert time.monotonic() - start < 20
    message = str(failure.value)
    assert "RuntimeError: rank 0 gives up before the all_reduce" in message
    assert "did not answer within" in message
    assert "[1, 2, 3]" in message
    assert run_on_ranks(4, _rank_and_sum) == [(r, 10.0) for r in range(4)]


def test_ranks_stuck_without_any_failure_time_out_and_the_pool_recovers() -> None:
    with pytest.raises(RankFailure, match=r"did not answer within [\d.]+ s: \[1\]"):
        run_on_ranks(2, _skip_all_reduce_on_rank_0, timeout_s=2)
    assert run_on_ranks(2, _rank_and_sum) == [(0, 3.0), (1, 3.0)]


def test_collective_timeout_turns_a_hang_into_errors_on_the_waiting_ranks() -> None:
    pool = RankPool(2, collective_timeout_s=1.0)
    try:
        with pytest.raises(RankFailure) as failure:
            pool.run(_raise_on_rank_0_before_all_reduce, timeout_s=20)
    finally:
        pool.close()
    message = str(failure.value)
    assert "Failed ranks, in order of failure: [0, 1]." in message
    assert "did not answer" not in message


def test_dead_rank_is_reported_with_its_signal() -> None:
    with pytest.raises(RankFailure, match="rank 1:\nthe rank process was killed by SIGKILL"):
        run_on_ranks(2, _kill_rank_1)


def test_rank_that_died_between_calls_is_reported_by_the_next_call() -> None:
    run_on_ranks(2, _exit_rank_1_after_answering)
    _wait_until_rank_exits(world_size=2, rank=1)
    with pytest.raises(RankFailure, match=r"rank 1:\nthe rank process exited \(exit code 3\)"):
        run_on_ranks(2, _rank_and_sum)
    assert run_on_ranks(2, _rank_and_sum) == [(0, 3.0), (1, 3.0)]


def _wait_until_rank_exits(world_size: int, rank: int, timeout_s: float = 60.0) -> None:
    """Block until a pool rank's process has exited (its exit is asynchronous: a timer)."""
    process = _pool._pools[world_size]._processes[rank]
    process.join(timeout_s)
    assert not process.is_alive(), f"rank {rank} did not exit within {timeout_s} s"


def _record_pid_and_sleep(directory: str) -> None:
    """A long body: note this rank's pid, then sleep for longer than the test waits."""
    (Path(directory) / f"rank{dist.get_rank()}").write_text(str(os.getpid()))
    time.sleep(300)


# A pytest-like owner of a pool, killed while its ranks run a long body.
_OWNER = """
import sys
from shardsci.testing._pool import RankPool
from tests.test_harness import _record_pid_and_sleep
RankPool(2).run(_record_pid_and_sleep, (sys.argv[1],), timeout_s=600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process states from /proc")
def test_ranks_running_a_body_die_with_the_process_that_started_the_pool(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, str(tmp_path)], cwd=root, env=env)
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("rank*"))) < 2:
            assert owner.poll() is None and time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.2)
        ranks = [int(path.read_text()) for path in tmp_path.glob("rank*")]
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        alive = [pid for pid in ranks if _alive(pid)]
    finally:
        owner.kill()
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"ranks {alive} outlived the killed owner of their pool by 10 s"


def test_unpicklable_body_or_result_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match="must be a module-level function"):
        run_on_ranks(2, lambda: None)
    with pytest.raises(RankFailure, match="returned a value that cannot be pickled"):
        run_on_ranks(2, _return_unpicklable)


def test_world_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="world_size must be positive, got 0"):
        run_on_ranks(0, _rank_and_sum)


def test_every_call_starts_from_the_same_seed_on_every_rank() -> None:
    first, second = run_on_ranks(2, _random_draw), run_on_ranks(2, _random_draw)
    assert first[0] == first[1] == second[0]


def test_assert_all_ranks_passes_when_every_rank_agrees() -> None:
    assert run_on_ranks(4, _check_all_ranks, None) == [None] * 4


def test_assert_all_ranks_fails_on_every_rank_when_one_rank_is_false() -> None:
    messages = run_on_ranks(4, _check_all_ranks, 1)
    assert messages == [messages[0]] * 4
    assert messages[0] == "assertion failed on 1 of 4 ranks [1]:\n  rank 1: rank 1 disagrees"


def test_uncaught_collective_assert_fails_the_call_on_every_rank() -> None:
    with pytest.raises(RankFailure, match="rank 3: rank 3 is odd") as failure:
        run_on_ranks(4, _fail_uncaught_on_rank_3)
    assert "did not answer" not in str(failure.value)


@pytest.mark.parametrize(
    ("bad_rank", "wrong_shape", "expected"),
    [
        (None, False, None),
        (2, False, "rank 2: field: Tensor-likes are not close!"),
        (2, False, "Greatest absolute difference: 0.5 at index (0, 2)"),
        (1, True, "rank 1: field: The values for attribute 'shape' do not match"),
    ],
)
def test_assert_close_all_ranks(
    bad_rank: int | None, wrong_shape: bool, expected: str | None
) -> None:
    messages = run_on_ranks(4, _compare_field, bad_rank, wrong_shape)
    assert messages == [messages[0]] * 4
    if expected is None:
        assert messages[0] is None
    else:
        assert expected in messages[0]


@pytest.mark.parametrize(
    ("spared_rank", "match", "expected"),
    [
        (None, "bad halo", None),
        (1, "bad halo", "rank 1: expected ValueError matching 'bad halo', but"),
        (None, "good halo", "got ValueError: bad halo size on rank 0"),
    ],
)
def test_assert_raises_all_ranks(spared_rank: int | None, match: str, expected: str | None) -> None:
    messages = run_on_ranks(2, _check_raises, spared_rank, match)
    assert messages == [messages[0]] * 2
    if expected is None:
        assert messages[0] is None
    else:
        assert expected in messages[0]


def test_assert_raises_all_ranks_returns_the_exception() -> None:
    assert run_on_ranks(2, _caught_by_assert_raises) == [
        "bad halo size on rank 0",
        "bad halo size on rank 1",
    ]


def test_uneven_all_to_all_single_with_zero_splits() -> None:
    received_rows = run_on_ranks(4, _uneven_all_to_all)
    assert received_rows == [sum(_send_count(src, dst) for src in range(4)) for dst in range(4)]


@pytest.mark.parametrize("shape", [(4,), (2, 2)])
def test_local_tensor_mode_matches_real_ranks_on_even_shards(shape: tuple[int, ...]) -> None:
    world_size = math.prod(shape)
    simulated = run_local_tensor(world_size, _double_even_shards, shape)
    real = run_on_ranks(world_size, _double_even_shards, shape)
    assert len(simulated) == world_size
    for simulated_shard, real_shard in zip(simulated, real):
        torch.testing.assert_close(simulated_shard, real_shard, atol=0, rtol=0)


def test_run_local_tensor_refuses_a_process_with_a_process_group() -> None:
    with pytest.raises(RuntimeError, match="this one has a 'fake' group of 2 ranks"):
        run_local_tensor(2, _nest_run_local_tensor)


def _warn_a_gather() -> int:
    warnings.warn("a gather the test did not ask for", GatherWarning, stacklevel=1)
    return 1


def _gather_at_one_call_site() -> int:
    import shardsci

    mesh = get_mesh((2,))
    x = shardsci.distribute_tensor(torch.arange(12.0).reshape(6, 2), mesh, [Shard(0)])
    torch.cdist(x, x)  # both point sets split by one axis: cdist gathers them
    return 1


def test_a_rank_body_is_told_of_a_gather_an_earlier_body_was_told_of() -> None:
    """The guard says each (op, call site) once per process; the pool forgets before each
    body, so a body is told even where an earlier body on the same ranks was (the last call:
    a failure closes the pool)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GatherWarning)
        assert run_on_ranks(2, _gather_at_one_call_site) == [1, 1]
    with warnings.catch_warnings():
        warnings.simplefilter("error", GatherWarning)
        with pytest.raises(RankFailure, match="GatherWarning"):
            run_on_ranks(2, _gather_at_one_call_site)


def test_a_rank_body_runs_under_the_callers_warning_filters() -> None:
    """pytest's ``error::shardsci.GatherWarning`` reaches the ranks, which are forked from a
    zygote that never saw it (the last call: a failure closes the pool)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GatherWarning)
        assert run_on_ranks(2, _warn_a_gather) == [1, 1]
    with warnings.catch_warnings():
        warnings.simplefilter("error", GatherWarning)
        with pytest.raises(RankFailure, match="GatherWarning: a gather the test did not ask"):
            run_on_ranks(2, _warn_a_gather)
