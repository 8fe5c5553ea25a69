"""Multi-rank test harness: run a test body on N gloo ranks, assert on all ranks together.

``run_on_ranks(world_size, fn, *args)`` runs a module-level function on every rank of a
persistent pool of gloo processes (one per world size, kept for the pytest session) and returns
the per-rank results; ``RankFailure`` reports a failing rank's traceback. Inside a body,
``get_mesh`` gives a cached device mesh and the ``assert_*_all_ranks`` helpers make every rank
fail together instead of leaving the others waiting in a collective. ``run_local_tensor`` runs
a body once, in-process, on simulated ranks (``LocalTensorMode``): fast, for even shards only.
``check_against_reference`` compares a sharded computation, forward and gradients, with a
single-process run on the same global data, output layouts included. ``count_traffic`` counts
the bytes of every collective issued, at the dispatcher, independently of shardsci's own
``comm_counter``; ``counted_comm`` runs both and fails when they disagree.
"""

from shardsci.testing._collective_asserts import (
    assert_all_ranks,
    assert_close_all_ranks,
    assert_raises_all_ranks,
)
from shardsci.testing._pool import (
    RankFailure,
    current_world_size,
    get_mesh,
    preload_in_ranks,
    run_local_tensor,
    run_on_ranks,
    shutdown_pools,
)
from shardsci.testing._reference import ExpectedLayout, Layout, check_against_reference
from shardsci.testing._traffic import Span, Traffic, count_traffic, counted_comm

__all__ = [
    "ExpectedLayout",
    "Layout",
    "RankFailure",
    "Span",
    "Traffic",
    "assert_all_ranks",
    "assert_close_all_ranks",
    "assert_raises_all_ranks",
    "check_against_reference",
    "count_traffic",
    "counted_comm",
    "current_world_size",
    "get_mesh",
    "preload_in_ranks",
    "run_local_tensor",
    "run_on_ranks",
    "shutdown_pools",
]
