"""Shard-aware op handlers, one module per op family; importing registers them."""

from shardsci.tensor._ops import (
    _loss_ops,  # noqa: F401
    _reduction_ops,  # noqa: F401
    _view_ops,  # noqa: F401
)
