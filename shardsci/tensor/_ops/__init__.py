"""Shard-aware op handlers, one module per op family; importing registers them."""

from shardsci.tensor._ops import (
    _attention_ops,  # noqa: F401
    _batched_ops,  # noqa: F401
    _bilinear_ops,  # noqa: F401
    _cdist_ops,  # noqa: F401
    _composite_ops,  # noqa: F401
    _conv_ops,  # noqa: F401
    _diagonal_ops,  # noqa: F401
    _elementwise_ops,  # noqa: F401
    _embedding_ops,  # noqa: F401
    _factory_ops,  # noqa: F401
    _fft_ops,  # noqa: F401
    _fractional_pool_ops,  # noqa: F401
    _gather_scatter_ops,  # noqa: F401
    _gathered_ops,  # noqa: F401
    _gradient_ops,  # noqa: F401
    _index_ops,  # noqa: F401
    _interpolate_ops,  # noqa: F401
    _loss_ops,  # noqa: F401
    _masked_ops,  # noqa: F401
    _matmul_ops,  # noqa: F401
    _norm_ops,  # noqa: F401
    _pad_ops,  # noqa: F401
    _plain_destination_ops,  # noqa: F401
    _pool_ops,  # noqa: F401
    _reduction_ops,  # noqa: F401
    _scalar_ops,  # noqa: F401
    _scan_ops,  # noqa: F401
    _search_ops,  # noqa: F401
    _slice_scatter_ops,  # noqa: F401
    _softmax_ops,  # noqa: F401
    _unpool_ops,  # noqa: F401
    _view_ops,  # noqa: F401
)
