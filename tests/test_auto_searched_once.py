"""``parallel=auto`` searches once per job (NOTE [One rank searches for a launched job]).

The command runs the CFD recipe on a tiny file with ``tests/counted_run.py``'s counters (the
search and the decomposition each process runs, wrapped from outside): ranks forked by
``train.py`` take the launcher's choice; under torchrun rank 0 searches and every rank runs its
choice (both ``-m slow``: 17 s and more). The hand-over itself runs on the rank pool: the search runs on rank 0
only, and its refusal is raised on every rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from shardsci.distributed import LaunchEnv
from shardsci.planning._choose import Decomposition, searched_once
from shardsci.testing import assert_all_ranks, assert_raises_all_ranks, run_on_ranks
from shardsci.training import ConfigError
from tests.test_planned_once import _counted_run, dataset  # noqa: F401  (a fixture)


def _env(rank: int) -> LaunchEnv:
    return LaunchEnv(rank, 2, rank, 2, "127.0.0.1", 29500, "torchrun")


def _hand_over_body() -> int:
    import torch.distributed as dist

    rank = dist.get_rank()
    searches = []

    def search() -> Decomposition:
        searches.append(rank)
        return Decomposition(1, ((0, 2),))

    chosen = searched_once(search, _env(rank), timeout_s=60)
    assert_all_ranks(chosen == Decomposition(1, ((0, 2),)), f"rank {rank} took {chosen}")

    def refuse() -> Decomposition:
        raise ConfigError("parallel=auto: nothing fits")

    assert_raises_all_ranks(
        ConfigError, "parallel=auto: nothing fits", lambda: searched_once(refuse, _env(rank), 60)
    )
    return len(searches)


def test_rank_zero_searches_and_every_rank_takes_its_choice_or_refusal() -> None:
    assert run_on_ranks(2, _hand_over_body) == [1, 0]


def _searches_and_choices(per_process: dict, ranks: list) -> tuple[int, list[set[str]]]:
    """Searches in the whole job, and the decompositions each of ``ranks`` (pids) ran."""
    searches = sum(counts["search"] for counts in per_process.values())
    return searches, [{w for w in per_process[pid] if w.startswith("chose ")} for pid in ranks]


@pytest.mark.slow
def test_forked_ranks_take_the_launchers_choice(dataset: Path, tmp_path: Path) -> None:  # noqa: F811
    """mesh=2 with parallel=auto: the launcher searches once and chooses; its 2 forked ranks
    take the plan as it is (no search, no choice of their own)."""
    per_process = _counted_run(dataset, tmp_path / "run", sys.executable, mesh="2")
    launcher = next(pid for pid, counts in per_process.items() if counts["launcher"])
    ranks = [pid for pid in per_process if pid != launcher]
    searches, choices = _searches_and_choices(per_process, ranks)
    assert searches == 1 and per_process[launcher]["search"] == 1, per_process
    assert len(choices) == 2 and all(not c for c in choices), per_process


@pytest.mark.slow
def test_torchrun_searches_once_and_every_rank_runs_the_choice(
    dataset: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """mesh=-1 under torchrun (2 ranks): one search in the whole job, and both ranks run the
    same decomposition."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    per_process = _counted_run(
        dataset, tmp_path / "run", *torchrun, "--no-python", sys.executable, mesh="-1"
    )
    ranks = [pid for pid, counts in per_process.items() if counts["launcher"]]
    searches, choices = _searches_and_choices(per_process, ranks)
    assert searches == 1, per_process
    assert len(choices) == 2 and len(choices[0]) == 1 and choices[0] == choices[1], per_process
