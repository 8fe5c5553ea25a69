"""linear, matmul, mm, bmm and einsum with the sharded dims in batch positions.

When every sharded dim of every operand is a batch dim (it appears in the output and is not
summed over), each rank computes its block of the output from its shards alone. DTensor
instead reshapes matmul's batch dims together, which moves a sharding on an inner batch dim
(an all-to-all) and changes the output layout. Here the product runs on the local shards:
- ShardTensor operands sharded on the same letter must agree on its shard sizes (else the
  default path realigns them);
- a replicated operand (plain tensor or replicated ShardTensor) that contains a sharded letter
  is sliced to this rank's shard of it;
- a replicated operand's local gradient is the part its shard of the output contributes, so it
  is read as ``Partial`` over the mesh axes that shard the output and summed once, in
  ``from_local``'s backward (NOTE [Autograd interaction between torch.Tensor and
  ShardTensor]).
Anything else (a sharded contracted dim, broadcasting batch dims, Partial inputs) declines
to the default path.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from shardsci.tensor._api import ShardTensor, from_local_spec, redistribute
from shardsci.tensor._binding import bind
from shardsci.tensor._ops._common import accepts
from shardsci.tensor._promotion import promote_replicated
from shardsci.tensor._registry import register_aten_handler, register_function_handler
from shardsci.tensor._spec import ShardTensorSpec, merged_hints

aten = torch.ops.aten


@dataclass(frozen=True)
class _Letter:
    """How one einsum letter is sharded: over which mesh axes, with which sizes."""

    axes: tuple[int, ...]
    sizes: tuple[int, ...]


# ---------------------------------------------------------------------------- handlers
@register_function_handler(F.linear)
def _linear(func, args, kwargs):
    a = bind(func, args, kwargs)
    x, weight, bias = a.input, a.weight, a.bias
    if x.ndim == 0 or not accepts(x, partial=True):
        return NotImplemented
    batch = string.ascii_lowercase[: x.ndim - 1]
    equation = f"{batch}i,oi->{batch}o"
    out = _local_einsum(equation, [x, weight])
    if out is NotImplemented or bias is None:
        return out
    return out + bias


def _matmul_operator(input, other):
    """The parameters of ``x @ y`` (``Tensor.__matmul__``, a builtin slot)."""


def _matrix_product(input, mat2, out_dtype=None, *, out=None):
    """The parameters of ``torch.mm`` and ``torch.bmm``: builtins with two aten schemas, with
    and without an output dtype."""


_MATMUL_SIGNATURES = {torch.Tensor.__matmul__: _matmul_operator}


@register_function_handler(torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)
def _matmul(func, args, kwargs):
    a = bind(func, args, kwargs, signature=_MATMUL_SIGNATURES.get(func))
    x, y = a.input, a.other
    equation = _matmul_equation(x.ndim, y.ndim, x.shape, y.shape)
    if equation is None:
        return NotImplemented
    return _local_einsum(equation, [x, y])


@register_function_handler(torch.mm, torch.Tensor.mm)
def _mm(func, args, kwargs):
    a = bind(func, args, kwargs, signature=_matrix_product)
    return _local_einsum("nk,km->nm", [a.input, a.mat2])


@register_function_handler(torch.bmm, torch.Tensor.bmm)
def _bmm(func, args, kwargs):
    a = bind(func, args, kwargs, signature=_matrix_product)
    return _local_einsum("bnk,bkm->bnm", [a.input, a.mat2])


def _einsum_parameters(equation, *operands):
    """The parameters of ``torch.einsum``, whose operands may also come as one list."""


@register_function_handler(torch.einsum)
def _einsum(func, args, kwargs):
    a = bind(func, args, kwargs, signature=_einsum_parameters)
    equation, operands = a.equation, list(a.operands)
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if "->" not in equation or "." in equation:
        return NotImplemented
    return _local_einsum(equation.replace(" ", ""), operands)


def _matmul_equation(
    a_ndim: int, b_ndim: int, a_shape: torch.Size, b_shape: torch.Size
) -> str | None:
    """The einsum form of ``a @ b`` when no batch dims broadcast, else None."""
    letters = iter(string.ascii_lowercase[:20])
    if a_ndim == 0 or b_ndim == 0:
        return None
    if b_ndim == 1:
        batch = "".join(next(letters) for _ in range(a_ndim - 1))
        return f"{batch}k,k->{batch}" if a_ndim > 1 else "k,k->"
    if a_ndim == 1:
        batch = "".join(next(letters) for _ in range(b_ndim - 2))
        return f"k,{batch}km->{batch}m"
    if b_ndim == 2:
        batch = "".join(next(letters) for _ in range(a_ndim - 2))
        return f"{batch}nk,km->{batch}nm"
    if a_ndim != b_ndim or a_shape[:-2] != b_shape[:-2]:
        return None
    batch = "".join(next(letters) for _ in range(a_ndim - 2))
    return f"{batch}nk,{batch}km->{batch}nm"


# ---------------------------------------------------------------------------- the local product
def _local_einsum(equation: str, operands: list):
    inputs, output = equation.split("->")
    subscripts = inputs.split(",")
    if len(subscripts) != len(operands) or any(
        len(s) != o.ndim for s, o in zip(subscripts, operands)
    ):
        return NotImplemented
    if not accepts(*operands):
        return NotImplemented
    sharded = [o for o in operands if isinstance(o, ShardTensor)]
    mesh = sharded[0]._spec.mesh
    if any(o._spec.mesh != mesh for o in sharded):
        return NotImplemented
    letters = _sharded_letters(subscripts, operands)
    if letters is None or any(letter not in output for letter in letters):
        return NotImplemented
    output_axes = {a for letter in letters.values() for a in letter.axes}
    locals_ = [
        _local_operand(o, s, letters, output_axes, mesh) for o, s in zip(operands, subscripts)
    ]
    out = torch.einsum(equation, *locals_)
    return from_local_spec(out, _output_spec(output, letters, out, operands, subscripts, mesh))


def _sharded_letters(subscripts: list[str], operands: list) -> dict[str, _Letter] | None:
    """Letter -> its sharding, or None when operands disagree on a letter's sharding."""
    letters: dict[str, _Letter] = {}
    for subscript, operand in zip(subscripts, operands):
        if not isinstance(operand, ShardTensor):
            continue
        for s in operand._spec.shardings:
            letter = _Letter(s.axes, s.sizes)
            if letters.setdefault(subscript[s.dim], letter) != letter:
                return None
    for subscript, operand in zip(subscripts, operands):
        if isinstance(operand, ShardTensor):
            unsharded = set(subscript) - {subscript[s.dim] for s in operand._spec.shardings}
            if any(letter in letters for letter in unsharded) and not _is_replicated(operand):
                return None
    return letters


def _is_replicated(t: ShardTensor) -> bool:
    return all(isinstance(p, Replicate) for p in t._spec.placements)


def _local_operand(
    operand: torch.Tensor,
    subscript: str,
    letters: dict[str, _Letter],
    output_axes: set[int],
    mesh,
) -> torch.Tensor:
    """This rank's part of one operand, with the gradient placements of the NOTE above."""
    if isinstance(operand, ShardTensor) and not _is_replicated(operand):
        return operand.to_local(grad_placements=_grad_placements(operand._spec, output_axes))
    if not isinstance(operand, ShardTensor):
        if not operand.requires_grad and not any(c in letters for c in subscript):
            return operand
        operand = promote_replicated(operand, mesh)
    wanted = {d: letters[c] for d, c in enumerate(subscript) if c in letters}
    if wanted:
        operand = redistribute(operand, _sliced_spec(operand._spec, wanted))
    return operand.to_local(grad_placements=_grad_placements(operand._spec, output_axes))


def _grad_placements(spec: ShardTensorSpec, output_axes: set[int]) -> list[Placement]:
    return [
        p if isinstance(p, Shard) else Partial() if a in output_axes else p
        for a, p in enumerate(spec.placements)
    ]


def _sliced_spec(spec: ShardTensorSpec, wanted: dict[int, _Letter]) -> ShardTensorSpec:
    placements = list(spec.placements)
    for dim, letter in wanted.items():
        for axis in letter.axes:
            placements[axis] = Shard(dim)
    return ShardTensorSpec.build(
        spec.mesh,
        placements,
        spec.shape,
        spec.dtype,
        {dim: letter.sizes for dim, letter in wanted.items()},
        stride=spec.stride,
        order={dim: letter.axes for dim, letter in wanted.items()},
    )


def _output_spec(
    output: str,
    letters: dict[str, _Letter],
    out: torch.Tensor,
    operands: list,
    subscripts: list[str],
    mesh,
) -> ShardTensorSpec:
    extents = {c: o.shape[d] for o, s in zip(operands, subscripts) for d, c in enumerate(s)}
    placements: list[Placement] = [Replicate()] * mesh.ndim
    shardings = {}
    for position, c in enumerate(output):
        if c in letters:
            for axis in letters[c].axes:
                placements[axis] = Shard(position)
            shardings[position] = letters[c]
    return ShardTensorSpec.build(
        mesh,
        placements,
        [extents[c] for c in output],
        out.dtype,
        {d: letter.sizes for d, letter in shardings.items()},
        order={d: letter.axes for d, letter in shardings.items()},
        hints=merged_hints(
            *(o._spec.hints + o._spec.shardings for o in operands if isinstance(o, ShardTensor))
        ),
    )


@register_aten_handler(aten.addbmm.default)
def _addbmm(func, args, kwargs):
    """``beta input + alpha sum_b batch1[b] @ batch2[b]``, from ops with rules."""
    a = bind(func, args, kwargs)
    product = aten.bmm.default(a.batch1, a.batch2)
    product = aten.mul.Scalar(aten.sum.dim_IntList(product, [0]), a.alpha)
    if a.beta == 0:  # input ignored, NaN included
        return aten.add.Tensor(aten.zeros_like.default(a.self), product)
    return aten.add.Tensor(aten.mul.Scalar(a.self, a.beta), product)
