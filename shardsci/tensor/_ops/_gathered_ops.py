"""Ops computed on the whole tensor, gathered onto every rank: the documented fallback.

These ops have no layout a sharded input could keep: their output's size depends on the
values (``nonzero``, ``unique``, ``linalg.lstsq``; ``masked_select`` and ``masked_scatter``
where ``_masked_ops`` declines), or every output element
may depend on every input element in an order the shards do not follow (``as_strided``
views that are not views of the layout, pairwise distances,
histograms, a hash, segment reductions, ``block_diag``, bilinear forms, the margin and CTC
losses, embedding bags). Each sharded argument is gathered whole onto every rank (one
all-gather each), the op runs on whole tensors, and its outputs are replicated ShardTensors:
right on every layout, at the cost of the gather and of every rank holding the whole input.
For large fields, redistribute to the layout you want first, or reduce before such an op.
Their backward ops are gathered alike, and the input's gradient returns to its layout in the
backward of ``from_local`` (a slice, no communication).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate

from shardsci.tensor._api import ShardTensor, redistribute
from shardsci.tensor._redistribute import target_spec
from shardsci.tensor._registry import register_aten_handler
from shardsci.tensor._spec import replicated_spec
from shardsci.tensor._torch_compat import tree_leaves, tree_map

__all__ = ["GATHERED", "gathered"]

aten = torch.ops.aten

#: The ops computed on gathered inputs (forward and backward ops, by overload packet or name).
GATHERED = (
    # dynamic output shapes
    aten.nonzero,
    aten.nonzero_static,
    aten.masked_select_backward,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.linalg_lstsq,
    # flat indices and strides over the whole tensor
    aten.put,
    aten.take,
    aten.as_strided,
    aten.as_strided_copy,
    aten.as_strided_scatter,
    # every output from every input
    aten._pdist_forward,
    aten._pdist_backward,
    aten.hash_tensor,
    aten._histogramdd_bin_edges,
    aten._histogramdd_from_bin_cts,
    aten._histogramdd_from_bin_tensors,
    aten.segment_reduce,
    aten._segment_reduce_backward,
    aten.block_diag,
    aten._trilinear,
    aten._chunk_cat,
    aten.multi_margin_loss,
    aten.multi_margin_loss_backward,
    aten.multilabel_margin_loss_forward,
    aten.multilabel_margin_loss_backward,
    aten._ctc_loss,
    aten._ctc_loss_backward,
    aten._embedding_bag,
    aten._embedding_bag_forward_only,
    aten._embedding_bag_backward,
    aten._embedding_bag_dense_backward,
    aten._embedding_bag_per_sample_weights_backward,
    aten.fractional_max_pool2d_backward,
    aten.fractional_max_pool3d_backward,
)


@register_aten_handler(*GATHERED)
def gathered(func, args, kwargs):
    """Run ``func`` on whole tensors on every rank; outputs are replicated ShardTensors."""
    mesh = next(a._spec.mesh for a in tree_leaves((args, kwargs)) if isinstance(a, ShardTensor))
    whole = tree_map(_whole, (args, kwargs))
    out = func(*whole[0], **whole[1])
    return tree_map(
        lambda o: ShardTensor(o, replicated_spec(o, mesh)) if isinstance(o, torch.Tensor) else o,
        out,
    )


def _whole(value: object) -> object:
    if not isinstance(value, ShardTensor):
        return value
    spec = value._spec
    if not spec.shardings and not spec.partial:
        return value._local
    return redistribute(value, target_spec(spec, [Replicate()] * spec.mesh.ndim))._local
