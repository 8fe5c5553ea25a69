"""PyTorch's OpInfo database on uneven and empty shards, against one process.

Every case must give the reference's result (forward and the sharded input's gradient) or
raise the same clear error on every rank, and an op may raise only if
``op_db_unsupported.py`` lists it (see ``tests/op_db_sweep.py``). The fast sweep, always on,
runs every op once: the first sample each layout can shard, the ops dealt out in turn to the
three layouts (about 3 minutes on 2 busy cores). The full sweep (``pytest -m slow
tests/test_op_db.py``) runs every sample of every op on every layout.
"""

from __future__ import annotations

import re

import pytest

from tests.op_db_sweep import LAYOUTS, Expectations, counts, database, problems, stale, sweep

FAST_SAMPLES = 1
FULL_CHUNKS = 12


def _check(layout: str, chunk: int, chunks: int, limit: int | None) -> None:
    records = sweep(LAYOUTS[layout], (chunk, chunks), limit)
    found = problems(records, Expectations.load())
    summary = counts(records)
    assert not found, f"{layout} {summary}: {len(found)} problems:\n" + "\n".join(found[:40])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_op_db(layout: str) -> None:
    _check(layout, list(LAYOUTS).index(layout), len(LAYOUTS), FAST_SAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", range(FULL_CHUNKS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_op_db_every_sample(layout: str, chunk: int) -> None:
    _check(layout, chunk, FULL_CHUNKS, None)


@pytest.mark.slow
def test_every_op_listed_as_unsupported_still_raises() -> None:
    """The list stays honest: each op in ``op_db_unsupported.UNSUPPORTED`` still raises its
    clear error on some sample of some layout (every sample, every layout; an op may raise on
    one layout only, as adaptive pooling does where its windows straddle shards)."""
    expectations = Expectations.load()
    listed = "^(" + "|".join(re.escape(op) for op in expectations.unsupported) + ")$"
    records = [r for layout in LAYOUTS.values() for r in sweep(layout, pattern=listed)]
    found = problems(records, expectations)
    found += [
        f"{op}: listed as unsupported but raised nothing" for op in stale(records, expectations)
    ]
    assert not found, "\n".join(found)


def test_expectations_name_real_ops() -> None:
    expectations = Expectations.load()
    known = database()
    listed = [*expectations.unsupported, *expectations.unchecked_values, *expectations.random_when]
    assert not [k for k in listed if k not in known], "unknown OpInfo names in the list"
