"""Ops computed on the whole tensor, gathered onto every rank: the documented fallback.

These ops have no layout a sharded input could keep: their output's size depends on the
values (``nonzero``, ``masked_select``, ``unique``, ``linalg.lstsq``), or every output element
may depend on every input element in an order the shards do not follow (``put``/``take`` by
flat index, ``as_strided`` views that are not views of the layout, pairwise distances,
histograms, a hash, segment reductions, ``block_diag``, bilinear forms, the margin and CTC
losses, embedding bags). Each sharded argument is gathered whole onto every rank (one
all-gather each), the op runs on whole tensors, and its outputs are replicated ShardTensors:
right on every layout, at the cost of the gather and of every rank holding the whole input.
For large fields, redistribute to the layout you want first, or reduce before such an op.
Their backward ops are gathered alike, and the input's gradient returns to its layout in the
backward of ``from_local`` (a slice, no communication).

``as_strided`` and its copy and scatter address their input's storage (an offset and strides
into it). An input that is already whole is addressed in its own storage, as torch's op
addresses it, so that a view stays a view (``as_strided``'s backward writes through one). A
gathered input is a new tensor that may lie inside a larger buffer (an all-gather of uneven
shards is narrowed from a padded one, where an offset would read padding): it is addressed as a
contiguous tensor at the start of a storage of its own, as if the whole tensor had been created
in one process.
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
    aten.masked_select,
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
    aten.masked_scatter,
    aten.masked_scatter_backward,
    # every output from every input
    aten._pdist_forward,
    aten._pdist_backward,
    aten._cdist_forward,
    aten._cdist_backward,
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
    aten._unsafe_masked_index,
)

#: Ops whose result depends on where their input lies in its storage.
_STORAGE_ADDRESSING = {aten.as_strided, aten.as_strided_copy, aten.as_strided_scatter}


@register_aten_handler(*GATHERED)
def gathered(func, args, kwargs):
    """Run ``func`` on whole tensors on every rank; outputs are replicated ShardTensors."""
    mesh = next(a._spec.mesh for a in tree_leaves((args, kwargs)) if isinstance(a, ShardTensor))
    own_storage = func.overloadpacket in _STORAGE_ADDRESSING
    whole = tree_map(lambda value: _whole(value, own_storage), (args, kwargs))
    out = func(*whole[0], **whole[1])
    return tree_map(
        lambda o: ShardTensor(o, replicated_spec(o, mesh)) if isinstance(o, torch.Tensor) else o,
        out,
    )


def _whole(value: object, own_storage: bool) -> object:
    """``value`` whole on this rank: its local tensor if it is already whole, else gathered
    (``own_storage``: into a contiguous tensor at the start of a storage of its own)."""
    if not isinstance(value, ShardTensor):
        return value
    spec = value._spec
    if not spec.shardings and not spec.partial:
        return value._local
    whole = redistribute(value, target_spec(spec, [Replicate()] * spec.mesh.ndim))._local
    return whole.clone(memory_format=torch.contiguous_format) if own_storage else whole
