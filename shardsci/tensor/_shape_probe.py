"""Shape probes: torch's own op run on a ``meta`` tensor to learn a result's shape.

# NOTE [Shape probes hold no memory]
Handlers learn an op's global output shape, and raise torch's own error for bad arguments on
every rank before any collective, by running torch's op on a ``meta`` tensor of the global
shape. Such a tensor holds no memory, but it is as large as the whole field: a memory tracker
that counts ``meta`` tensors (the dry run's, whose simulated shards are ``meta`` too; NOTE
[What the memory figures count]) must skip it. So every probe runs inside ``shape_probe()``
and trackers skip what is created while ``probing()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["probing", "shape_probe"]

_depth = [0]


@contextlib.contextmanager
def shape_probe() -> Iterator[None]:
    """Mark the tensors created inside the block as shape probes."""
    _depth[0] += 1
    try:
        yield
    finally:
        _depth[0] -= 1


def probing() -> bool:
    """Whether a shape probe is running."""
    return _depth[0] > 0
