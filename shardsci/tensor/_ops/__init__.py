"""Shard-aware op handlers, one module per op family; importing registers them."""

from shardsci.tensor._ops import _reduction_ops  # noqa: F401
