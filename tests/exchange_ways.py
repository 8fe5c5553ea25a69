"""Switch the rule that sends an exchange every member of a group joins as messages or as one
all-to-all (NOTE [An exchange of messages as one all-to-all where messages are slow]), so that
the tests of halos and of the ring (``_ops/_ring``) run both ways on gloo."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import shardsci
from shardsci.tensor import _collectives

WAYS = ("messages", "all_to_all")


@contextmanager
def exchanges_as(way: str) -> Iterator[None]:
    """Exchanges every member joins go ``way`` (``"messages"`` or ``"all_to_all"``) inside the
    block, whatever the rule says of this backend: axis groups made afresh with the rule
    replaced."""
    if way not in WAYS:
        raise ValueError(f"way {way!r}: expected one of {WAYS}")
    shardsci.tensor.clear_caches()
    rule = mock.patch.object(
        _collectives, "messages_in_one_collective", lambda backend, size: way == "all_to_all"
    )
    try:
        with rule:
            yield
    finally:
        shardsci.tensor.clear_caches()
