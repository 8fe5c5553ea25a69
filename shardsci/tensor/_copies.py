"""ShardTensors that torch takes for views but that may be copies, and the writes into them.

# NOTE [A write into a view that is a copy]
Torch's view ops (``select``, ``view``, ``unfold``, ``unbind``, ``as_strided``, ``conj``, ...)
return tensors that share their input's storage, so an in-place op on the view writes into
the input. On a ShardTensor some of them cannot be views: a select along a split dim is a
row its owner broadcasts, a reshape that splits or merges a split dim moves cells between
ranks, a gathered fallback holds a replicated copy, a window may be cut from a halo. Autograd
still records the result as a view of its input, so gradients follow the write; only the
values would be lost, silently. So dispatch marks every ShardTensor a view op returns
(``mark_view``) with whether its shard shares its input shard's storage on this rank, and
an op that mutates a marked tensor (``before_write``):
- for a select's copy (``_ops/_index_ops.py``, NOTE [An in-place op on a select's copy
  writes through]), which its handler marks on every rank with the owner's row and its own
  shard (the buffer), writes through after the op (``after_write``): the owner copies the
  buffer into the row, and so up the chain when the select was taken of another select's
  copy; every rank ran the op on the same replicated values, so nothing moves;
- for any other view, first agrees over the mesh (one all-reduce of one flag) whether a
  shard holding cells is a copy on any rank, since a handler may cut a view on one rank and
  assemble a copy on another (a window inside one shard, another across a halo). If it is,
  every rank raises, naming the write and the op that copied (a general copy has no cheap
  way back into its input); if not, the write landed in the input (or, for a view of a
  select's copy, in its buffer, written through as above);
- for a view a function handler returns as a copy on every rank (``unfold`` along a split
  dim), which it marks so, raises on every rank with no collective; a handler whose output
  is a view on every rank (``slice``) marks it so, and a write into it asks nothing.
The agreement is one small collective per in-place op on a view's output; ops on other
tensors cost one attribute read.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from shardsci.tensor._collectives import all_reduce, axis_group
from shardsci.tensor._torch_compat import OpOverload, _get_dispatch_mode, _TorchDispatchModeKey
from shardsci.tensor._torch_compile import in_graph

__all__ = [
    "CopyOf",
    "after_write",
    "before_write",
    "local_view",
    "mark_moved",
    "mark_view",
    "returns_view",
    "select_copy",
]


class CopyOf(NamedTuple):
    """What made a ShardTensor that torch takes for a view, and where a write into it goes.

    Attributes
    ----------
    made_by : OpOverload
        The view op that made it (or the first in a chain that copied on this rank).
    copied : bool
        Whether, on this rank, its shard does not share the storage a write must reach.
    buffer : Tensor or None
        For a select's copy and its views: the copy's shard, which they share and which is
        written through to ``row``; else None.
    row : Tensor or None
        The owner's row of the selected tensor's shard; None on the other ranks.
    then : CopyOf or None
        The mark of the tensor a select's copy was taken of, when it has one.
    agreed : bool
        Whether every rank holds the same ``copied`` without asking (a select's copy, a
        copy a function handler returns).
    """

    made_by: OpOverload
    copied: bool
    buffer: torch.Tensor | None = None
    row: torch.Tensor | None = None
    then: CopyOf | None = None
    agreed: bool = False


def local_view(func: OpOverload) -> CopyOf:
    """The mark of a handler's output that is a view of its input's shard on every rank (a
    slice), so that a write into it needs no agreement (NOTE above)."""
    return CopyOf(func, False, agreed=True)


def select_copy(func: OpOverload, buffer: torch.Tensor, row: torch.Tensor | None) -> CopyOf:
    """The mark of a select's broadcast copy, written through on every rank (NOTE above)."""
    return CopyOf(func, False, buffer, row, agreed=True)


def mark_view(func: OpOverload, x: torch.Tensor, result: object, path: str) -> None:
    """Mark the ShardTensor outputs of view op ``func`` on ``x`` (NOTE above). ``path``:
    ``"handler"`` (a view or a copy, rank by rank), ``"copy"`` (a lazy view materialised, a
    copy on every rank), else the same local view on every rank (the op on the shards)."""
    mark = x._copy_of
    if mark is None and path not in ("handler", "copy"):
        return  # a view on every rank of a tensor that is no copy: nothing to mark
    if _tracing():
        return
    if path == "copy":
        mark_moved(func, result)
    agreed = path != "handler"
    outputs = result if isinstance(result, (list, tuple)) else (result,)
    for out in outputs:
        if type(out) is not type(x) or out is x:
            continue
        if out._copy_of is not None and out._copy_of.agreed:  # by a handler, or a move
            if mark is not None:
                out._copy_of = out._copy_of._replace(then=mark)
        elif mark is not None and mark.buffer is not None:  # a view of a select's copy
            copied = _copied(out._local, mark.buffer)
            out._copy_of = mark._replace(copied=copied, agreed=agreed and not copied)
        elif mark is not None:
            copied = mark.copied or _copied(out._local, x._local)
            made_by = mark.made_by if mark.copied else func
            out._copy_of = mark._replace(
                made_by=made_by, copied=copied, agreed=agreed and mark.agreed
            )
        elif not agreed:
            out._copy_of = CopyOf(func, _copied(out._local, x._local))


def mark_moved(func: OpOverload, result: object) -> None:
    """Mark the outputs of view op ``func`` as copies on every rank (run on its first
    argument moved to another layout, or a lazy view materialised; NOTE above)."""
    if _tracing():
        return
    for out in result if isinstance(result, (list, tuple)) else (result,):
        if isinstance(out, torch.Tensor) and hasattr(out, "_copy_of"):
            out._copy_of = CopyOf(func, True, agreed=True)


def before_write(func: OpOverload, x: torch.Tensor) -> None:
    """Raise, on every rank, if ``func`` would write into a copy it cannot write through."""
    chain = []
    mark = x._copy_of
    while mark is not None:
        chain.append(mark)
        mark = mark.then
    unsure = [m for m in chain if not m.agreed]
    copied = [m for m in chain if m.agreed and m.copied]
    if not copied and (not unsure or not _copied_anywhere(x, any(m.copied for m in unsure))):
        return
    made_by = (copied or unsure)[-1].made_by  # the first op of the chain that may copy
    raise NotImplementedError(
        f"shardsci: {func} writes into a tensor that {made_by} made from a "
        "ShardTensor; torch makes it a view, but on a ShardTensor it is a copy (its cells "
        "are not where the view would put them), so the write would be lost. Write into the "
        "tensor itself instead: x[key] = value, or the op's functional form assigned back "
        "(torch.slice_scatter, select_scatter, diagonal_scatter, x.copy_(y.reshape(x.shape)))"
    )


def after_write(x: torch.Tensor) -> None:
    """After an op mutated ``x``: each buffer in its mark's chain into its row, on the row's
    owner (NOTE above)."""
    mark = x._copy_of
    while mark is not None:
        if mark.row is not None:
            mark.row.copy_(mark.buffer)
        mark = mark.then


def _copied_anywhere(x: torch.Tensor, copied: bool) -> bool:
    """Whether any rank of ``x``'s mesh says ``copied`` (every rank asks, NOTE above)."""
    mesh = x._spec.mesh
    flag = torch.tensor([int(copied)], dtype=torch.int32, device=x._local.device)
    return bool(all_reduce(flag, axis_group(mesh, range(mesh.ndim)), "max").item())


def returns_view(func: OpOverload) -> bool:
    """Whether torch's ``func`` returns a view of an argument."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def _tracing() -> bool:
    """Whether torch.compile traces or propagates fake shards: there a write is made
    functional below these marks, and a fake shard has no storage to compare."""
    return in_graph() or _get_dispatch_mode(_TorchDispatchModeKey.FAKE) is not None


def _copied(out: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether shard ``out`` holds cells and does not share ``source``'s storage (an empty
    shard loses no write)."""
    return (
        out.numel() > 0 and out.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()
    )
