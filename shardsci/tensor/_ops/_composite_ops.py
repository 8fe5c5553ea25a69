"""Ops that DTensor has no rule for and torch decomposes only through prims (meant for
tracing, not for running on ShardTensors), composed here from ops that have rules or
handlers: the ``*_copy`` twins of views, ``rsub``, ``addr``, ``vdot``, ``linalg_cross``,
``trace``, ``rot90``,
``glu`` and its backward, ``count_nonzero``, ``norm`` with an optional
p and ``masked_fill`` with a tensor value.

Each op runs its parts on the ShardTensors, so every part plans its own layout and
communication (a view of a sharded dim, a reduction's all-reduce) exactly as when a user
writes the composition; autograd sees the original op and its own backward formula.
"""

from __future__ import annotations

import torch

from shardsci.tensor._binding import bind
from shardsci.tensor._ops._common import normalized_dims
from shardsci.tensor._registry import register_aten_handler
from shardsci.tensor._shape_probe import probe_on_meta

aten = torch.ops.aten


# ---------------------------------------------------------------------------- copies of views
_VIEW_OF_COPY = {
    aten.alias_copy.default: aten.alias.default,
    aten.diagonal_copy.default: aten.diagonal.default,
    aten.expand_copy.default: aten.expand.default,
    aten.narrow_copy.default: aten.narrow.default,
    aten.permute_copy.default: aten.permute.default,
    aten.select_copy.int: aten.select.int,
    aten.slice_copy.Tensor: aten.slice.Tensor,
    aten.split_copy.Tensor: aten.split.Tensor,
    aten.split_with_sizes_copy.default: aten.split_with_sizes.default,
    aten.squeeze_copy.default: aten.squeeze.default,
    aten.squeeze_copy.dim: aten.squeeze.dim,
    aten.squeeze_copy.dims: aten.squeeze.dims,
    aten.t_copy.default: aten.t.default,
    aten.transpose_copy.int: aten.transpose.int,
    aten.unbind_copy.int: aten.unbind.int,
    aten.unfold_copy.default: aten.unfold.default,
    aten.unsqueeze_copy.default: aten.unsqueeze.default,
    aten.view_copy.default: aten.view.default,
}


@register_aten_handler(*_VIEW_OF_COPY)
def _copy_of_view(func, args, kwargs):
    """``x.op_copy(...)`` is ``x.op(...)`` materialised, contiguous like torch's."""
    out = _VIEW_OF_COPY[func](*args, **kwargs)
    if isinstance(out, (list, tuple)):
        return [_contiguous_copy(o) for o in out]
    return _contiguous_copy(out)


def _contiguous_copy(t: torch.Tensor) -> torch.Tensor:
    return aten.clone.default(t, memory_format=torch.contiguous_format)


# ---------------------------------------------------------------------------- arithmetic
@register_aten_handler(aten.rsub.Tensor)
def _rsub(func, args, kwargs):
    a = bind(func, args, kwargs)
    return aten.sub.Tensor(a.other, a.self, alpha=a.alpha)


@register_aten_handler(aten.addr.default)
def _addr(func, args, kwargs):
    """``beta * x + alpha * outer(vec1, vec2)``; ``x`` is ignored (NaNs too) when beta is 0."""
    a = bind(func, args, kwargs)
    x, beta, alpha = a.self, a.beta, a.alpha
    outer = aten.mul.Tensor(aten.unsqueeze.default(a.vec1, 1), aten.unsqueeze.default(a.vec2, 0))
    if alpha != 1:
        outer = aten.mul.Scalar(outer, alpha)
    if beta == 0:
        return aten.expand.default(outer, list(x.shape)) if outer.shape != x.shape else outer
    scaled = x if beta == 1 else aten.mul.Scalar(x, beta)
    return aten.add.Tensor(scaled, outer)


@register_aten_handler(aten.vdot.default)
def _vdot(func, args, kwargs):
    a = bind(func, args, kwargs)
    x = aten.conj_physical.default(a.self) if a.self.dtype.is_complex else a.self
    return aten.sum.default(aten.mul.Tensor(x, a.other))


@register_aten_handler(aten.linalg_cross.default)
def _cross(func, args, kwargs):
    """``x x y`` along ``dim`` (``cross``, ``linalg.cross``; a vorticity ``curl`` of vector
    fields) as ``x[i + 1] * y[i + 2] - x[i + 2] * y[i + 1]``, its components rotated by an
    ``index_select`` with a replicated index: the fields keep their layout, and a split of the
    size-3 dim itself moves only the components each rank's rotated copy needs (an index of
    that dim's extent keeps its split, NOTE [A gather through a replicated index keeps the
    input's layout]). Broadcasting operands of another rank take the default path."""
    a = bind(func, args, kwargs)
    x, y = a.self, a.other
    if x.ndim != y.ndim or x.ndim == 0:
        return NotImplemented
    probe_on_meta(func, args, kwargs)  # torch's errors (a dim not of size 3), on every rank
    dim = a.dim % x.ndim

    def turned(t: torch.Tensor, shift: int) -> torch.Tensor:  # t[i + shift] at i
        index = torch.tensor([(k + shift) % 3 for k in range(3)], device=t.device)
        return aten.index_select.default(t, dim, index)

    return aten.sub.Tensor(
        aten.mul.Tensor(turned(x, 1), turned(y, 2)), aten.mul.Tensor(turned(x, 2), turned(y, 1))
    )


@register_aten_handler(aten.trace.default)
def _trace(func, args, kwargs):
    return aten.sum.default(aten.diagonal.default(bind(func, args, kwargs).self))


@register_aten_handler(aten.masked_fill.Tensor)
def _masked_fill_tensor(func, args, kwargs):
    a = bind(func, args, kwargs)
    x, value = a.self, a.value
    if value.dtype != x.dtype:
        value = aten._to_copy.default(value, dtype=x.dtype)
    return aten.where.self(a.mask, value, x)


@register_aten_handler(aten.norm.ScalarOpt_dim)
def _norm_with_optional_p(func, args, kwargs):
    a = bind(func, args, kwargs)
    p = 2 if a.p is None else a.p
    return aten.linalg_vector_norm.default(a.self, p, a.dim, bool(a.keepdim))


@register_aten_handler(aten.count_nonzero.default, aten.count_nonzero.dim_IntList)
def _count_nonzero(func, args, kwargs):
    a = bind(func, args, kwargs)
    x, dims = a.self, a.dim
    nonzero = aten.ne.Scalar(x, 0)
    if dims is None or (not isinstance(dims, int) and len(dims) == 0):
        return aten.sum.default(nonzero, dtype=torch.int64)
    return aten.sum.dim_IntList(nonzero, list(normalized_dims(dims, x.ndim)), dtype=torch.int64)


# ---------------------------------------------------------------------------- rearrangements
@register_aten_handler(aten.rot90.default)
def _rot90(func, args, kwargs):
    """torch's own composition: flips and a transpose of the two dims."""
    a = bind(func, args, kwargs)
    x, k = a.self, a.k % 4
    first, second = (d % x.ndim for d in a.dims)
    if k == 0:
        return _contiguous_copy(x)
    if k == 2:
        return aten.flip.default(x, [first, second])
    flipped = aten.flip.default(x, [second if k == 1 else first])
    return _contiguous_copy(aten.transpose.int(flipped, first, second))


# ---------------------------------------------------------------------------- glu
def _halves(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    half = x.shape[dim] // 2
    return aten.narrow.default(x, dim, 0, half), aten.narrow.default(x, dim, half, half)


@register_aten_handler(aten.glu.default)
def _glu(func, args, kwargs):
    a = bind(func, args, kwargs)
    first, second = _halves(a.self, a.dim % a.self.ndim)
    return aten.mul.Tensor(first, aten.sigmoid.default(second))


@register_aten_handler(aten.glu_backward.default)
def _glu_backward(func, args, kwargs):
    """d/da = g sigmoid(b), d/db = g a sigmoid(b) (1 - sigmoid(b)), side by side along dim."""
    bound = bind(func, args, kwargs)
    dim = bound.dim % bound.self.ndim
    a, b = _halves(bound.self, dim)
    gate = aten.sigmoid.default(b)
    grad_a = aten.mul.Tensor(bound.grad_output, gate)
    grad_b = aten.mul.Tensor(aten.mul.Tensor(grad_a, a), aten.add.Scalar(aten.neg.default(gate), 1))
    return aten.cat.default([grad_a, grad_b], dim)
