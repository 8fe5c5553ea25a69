"""Session-wide fixtures and hooks for the test suite.

Kept light on purpose: nothing here imports torch at collection time. The rank pools of
``shardsci.testing`` are started lazily by the first test that needs them.
"""

from __future__ import annotations

import sys

import pytest


def pytest_collection_finish(session: pytest.Session) -> None:
    """Where the collected tests use the rank pools: their ranks start with the training
    command imported (``preload_in_ranks``), which the recipe's rank bodies and every test
    module importing ``shardsci.train`` would otherwise import on each rank of each pool; and
    with what a selected test's module names in ``RANKS_IMPORT`` (its ranks' own slow
    imports, paid once in the zygote instead of once a rank)."""
    pool = sys.modules.get("shardsci.testing._pool")
    if pool is not None:
        modules = {
            m
            for item in session.items
            for m in getattr(getattr(item, "module", None), "RANKS_IMPORT", ())
        }
        pool.preload_in_ranks("shardsci.train", *sorted(modules))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Each test is told of its gathers: the guard says each (op, call site) once per process
    (NOTE [Gathers an op was not asked to make]), so without this a test would pass in the
    suite because an earlier test in this process had already been told. The rank pool does
    the same before each rank body (``_pool._run_request``)."""
    guard = sys.modules.get("shardsci.tensor._gather_guard")
    if guard is not None:
        guard.forget_warnings()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop the rank pools that ``run_on_ranks`` kept alive for the session."""
    from shardsci.testing import shutdown_pools

    shutdown_pools()
