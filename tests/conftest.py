"""Session-wide fixtures and hooks for the test suite.

Kept light on purpose: nothing here imports torch at collection time. The rank pools of
``shardsci.testing`` are started lazily by the first test that needs them.
"""

from __future__ import annotations

import pytest


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop the rank pools that ``run_on_ranks`` kept alive for the session."""
    from shardsci.testing import shutdown_pools

    shutdown_pools()
