"""PyTorch's OpInfo database on uneven and empty shards, against one process.

Every case must give the reference's result (forward and the sharded input's gradient) or
raise the same clear error on every rank, and an op may raise only if
``op_db_unsupported.py`` lists it (see ``tests/op_db_sweep.py``). The fast sweep, always on,
runs every op once: the first sample each layout can shard, the ops dealt out in turn to the
three layouts (about 3 minutes on 2 busy cores). The full sweep (``pytest -m slow
tests/test_op_db.py``) runs every sample of every op on every layout.
"""

from __future__ import annotations

import pytest

from tests.op_db_sweep import LAYOUTS, Expectations, counts, database, problems, stale, sweep

FAST_SAMPLES = 1
FULL_CHUNKS = 12


def _check(layout: str, chunk: int, chunks: int, limit: int | None, full: bool) -> None:
    expectations = Expectations.load()
    records = sweep(LAYOUTS[layout], (chunk, chunks), limit)
    found = problems(records, expectations)
    if full:
        found += [
            f"{op}: listed as unsupported but raised nothing" for op in stale(records, expectations)
        ]
    summary = counts(records)
    assert not found, f"{layout} {summary}: {len(found)} problems:\n" + "\n".join(found[:40])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_op_db(layout: str) -> None:
    _check(layout, list(LAYOUTS).index(layout), len(LAYOUTS), FAST_SAMPLES, full=False)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", range(FULL_CHUNKS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_op_db_every_sample(layout: str, chunk: int) -> None:
    _check(layout, chunk, FULL_CHUNKS, None, full=True)


def test_expectations_name_real_ops() -> None:
    expectations = Expectations.load()
    known = database()
    listed = [*expectations.unsupported, *expectations.unchecked_values, *expectations.random_when]
    assert not [k for k in listed if k not in known], "unknown OpInfo names in the list"
