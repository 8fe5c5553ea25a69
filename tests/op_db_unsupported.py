"""What the op-database sweep (``tests/test_op_db.py``, ``tests/op_db_sweep.py``) accepts
short of a correct result. Keys are OpInfo names (``name`` or ``name.variant``), as in
``torch.testing._internal.common_methods_invocations.op_db``.
"""

from collections.abc import Callable

_ADAPTIVE = (
    "an output size that does not divide a sharded dim's extent: adaptive windows of "
    "different lengths that overlap (the error says which output sizes work)"
)
_CHUNKED_LOSS = "a torch_nn custom op without a decomposition; no handler yet"
_LOW_RANK = (
    "batched samples: aten.linalg_solve_triangular on a sharded batch gets shard sizes from "
    "DTensor's rule that its kernel does not produce; no handler yet"
)

#: Ops that may raise an error on sharded input: the same error on every rank, naming the op.
#: The value says why. The sweep fails on an error of an op not listed here, and
#: ``test_every_op_listed_as_unsupported_still_raises`` on a listed op that no longer raises.
UNSUPPORTED: dict[str, str] = {
    "nn.functional.adaptive_avg_pool1d": _ADAPTIVE,
    "nn.functional.adaptive_avg_pool2d": _ADAPTIVE,
    "nn.functional.adaptive_avg_pool3d": _ADAPTIVE,
    "nn.functional.adaptive_max_pool1d": _ADAPTIVE,
    "nn.functional.adaptive_max_pool2d": _ADAPTIVE,
    "nn.functional.adaptive_max_pool3d": _ADAPTIVE,
    "nn.functional.linear_cross_entropy.chunked": _CHUNKED_LOSS,
    "nn.functional.scaled_dot_product_attention": (
        "dropout_p > 0 (samples 2-15): each rank would draw its own dropout mask, so the result "
        "would depend on the layout; the error says so"
    ),
    "nn.functional.linear_cross_entropy.chunked_none": _CHUNKED_LOSS,
    "svd_lowrank": _LOW_RANK,
    "pca_lowrank": _LOW_RANK,
    "__getitem__": (
        "a boolean mask as the index (sample 14): the result's shard sizes depend on the values "
        "(aten.nonzero), which DTensor cannot propagate; no handler yet"
    ),
    "linalg.ldl_solve": (
        "a factorisation and a right-hand side of different extents sharded over the same axis "
        "(samples 4-5): they cannot be aligned shard by shard; no handler yet"
    ),
    "native_group_norm": (
        "torch.native_group_norm itself on an unevenly sharded batch (samples 16-19): DTensor's "
        "rule assumes even shards; F.group_norm, which models call, has its own handler"
    ),
    "nn.functional.group_norm": (
        "channels sharded unevenly (2x2 layout, samples 16-19): declined, then DTensor's rule "
        "assumes even shards; make the channels whole first"
    ),
    "masked.logsumexp": (
        "keepdim over an unsharded dim with the reduced dim's output of extent 1 sharded by "
        "DTensor's rule (samples 18-19, 4 ranks with an empty shard); no handler yet"
    ),
    "resize_": "changes the storage in place; a shard cannot grow into its neighbour's elements",
    "resize_as_": "changes the storage in place; a shard cannot grow into its neighbour's elements",
    "to_sparse": "ShardTensors shard strided tensors only",
}

#: Ops whose outputs are random or uninitialised: the sharded run draws other numbers than one
#: process does, so only shapes, dtypes and shard sizes are compared.
VALUES_NOT_COMPARED: dict[str, str] = {
    "bernoulli": "random",
    "cauchy": "random",
    "empty": "uninitialised",
    "empty_like": "uninitialised",
    "empty_permuted": "uninitialised",
    "empty_strided": "uninitialised",
    "exponential": "random",
    "geometric": "random",
    "log_normal": "random",
    "multinomial": "random",
    "new_empty": "uninitialised",
    "new_empty_strided": "uninitialised",
    "nn.functional.alpha_dropout": "random",
    "nn.functional.dropout": "random",
    "nn.functional.dropout2d": "random",
    "nn.functional.dropout3d": "random",
    "nn.functional.feature_alpha_dropout.with_train": "random",
    "nn.functional.rrelu": "random",
    "normal": "random",
    "normal.in_place": "random",
    "normal.number_mean": "random",
    "rand_like": "random",
    "randint": "random",
    "randint_like": "random",
    "randn": "random",
    "randn_like": "random",
    "uniform": "random",
}

#: Ops whose outputs are random in the samples a predicate picks (dropout inside): only those
#: samples' values go uncompared.
RANDOM_WHEN: dict[str, Callable[[object], bool]] = {
    "nn.functional.scaled_dot_product_attention": lambda s: s.kwargs.get("dropout_p", 0.0) > 0,
    # multi_head_attention_forward(query, key, value, ..., add_zero_attn, dropout_p, ...)
    "nn.functional.multi_head_attention_forward": (
        lambda s: s.kwargs.get("training", True) and s.args[9] > 0
    ),
}
