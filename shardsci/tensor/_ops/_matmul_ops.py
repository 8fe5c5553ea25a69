"""linear, matmul, mm, bmm and einsum on the operands' shards.

Each product runs on the local shards, with the output laid out from the operands' letters
(einsum letters; matmul and friends are written as einsums). For each letter sharded over
some mesh axes (in every ShardTensor operand that shards it, over the same axes with the same
shard sizes):
- a letter the output keeps (a batch dim, the rows) stays sharded in the output. DTensor
  instead reshapes matmul's batch dims together, which moves a sharding on an inner batch dim
  (an all-to-all) and changes the output layout;
- a letter the product sums over (the contracted dim sharded in both operands, with the same
  boundaries) leaves each rank a partial sum: the output is ``Partial`` over its axes, summed
  when the next op needs it (no data moves here); where one rank holds the letter whole, that
  rank keeps the output instead (NOTE [A sum over a dim one rank holds stays with that rank]
  in ``_common``);
- an operand whose dim one rank holds whole (a held letter) is multiplied on that rank, the
  others computing nothing, and the output stays with it (NOTE [A product of held operands
  runs on their holder]);
- a replicated operand (plain tensor or replicated ShardTensor) that contains a sharded letter
  is sliced to this rank's shard of it; its local gradient is the part its shard of the output
  contributes, so it is read as ``Partial`` over the mesh axes that shard the output and
  summed once, in ``from_local``'s backward (NOTE [Autograd interaction between torch.Tensor
  and ShardTensor]);
- two operands sharding different letters over the same mesh axes follow the NOTE below.
Anything else declines to the default path: operands sharding one letter with different
boundaries (it realigns them), a letter sharded over different axes, several such conflicts,
Partial inputs, ``...`` in an equation.

NOTE [A product of token-sharded operands is sharded by query rows]
When two operands shard different letters over the same mesh axes (``q @ k^T`` and
``einsum("blxd,blyd->blxy", q, k)`` with tokens sharded in both; ``attn @ v`` with attn's rows
and v's tokens sharded; ``x.t() @ x`` with x's columns sharded), the output keeps the rows of
one operand, sharded as in that operand (its placements and shard sizes), and holds the other
letter whole: the rows of the operand whose letter the output keeps, the first operand's
(q's) when it keeps both. Every rank meets every block of the other operand (k, v) by the ring
or the all-gather of NOTE [Ring product], chosen by the cost rule of NOTE [Ring or all-gather]
(``shardsci.attention_exchange``): no rank gathers it by a redistribution, and in the ring
none holds it whole. Declined (default path): a letter the staying operand has sharded
elsewhere, the staying rows in the moving operand, a letter twice in one subscript, more
than two operands, both letters summed over.
"""

from __future__ import annotations

import functools
import itertools
import math
import string
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from shardsci.tensor._api import ShardTensor, _as_placed, from_local_spec, redistribute
from shardsci.tensor._binding import bind
from shardsci.tensor._caches import cached
from shardsci.tensor._collectives import axis_group
from shardsci.tensor._dispatch import local_of
from shardsci.tensor._ops._autocast import autocast_dtype
from shardsci.tensor._ops._common import (
    Held,
    accepts,
    connected_empty,
    held_by_one,
    held_local,
    held_on,
    replicated_local,
    sharding_axes,
    without_held,
)
from shardsci.tensor._ops._linear_node import LinearPlan, linear_node
from shardsci.tensor._ops._ring import Blocks, ring_chosen, sum_around
from shardsci.tensor._ops._ring_product import ProductPlan, ring_product
from shardsci.tensor._promotion import promote_replicated
from shardsci.tensor._redistribute import largest_receive
from shardsci.tensor._registry import register_aten_handler, register_function_handler
from shardsci.tensor._shape_probe import probe_on_meta
from shardsci.tensor._spec import (
    DimSharding,
    ShardTensorSpec,
    index_over_axes,
    merged_hints,
    mesh_coordinate,
    nested_chunk_sizes,
)
from shardsci.tensor._torch_compile import in_graph

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
    if bias is None and _pending_sum_of_wholes(x) and _whole_matrix(weight):
        return _linear_of_pending_sum(x, weight)
    if not isinstance(x, ShardTensor) or x.ndim == 0 or not accepts(x, weight):
        return NotImplemented
    equation = _LINEAR_EQUATIONS[x.ndim]
    keys = (_Operand(x), _Operand(weight))
    layout = _product_layout(equation, keys)
    if layout is None:
        return NotImplemented
    folded = bias is not None and _bias_folds(layout, bias)
    if bias is None or folded:
        plan = _one_node_plan(equation, keys)
        if plan is not None and not in_graph() and autocast_dtype(x) is None:
            composed = functools.partial(_composed_linear, layout=layout, folded=folded)
            return linear_node(x, weight, bias, plan, composed)
    return _composed_linear(x, weight, bias, layout, folded)


_LINEAR_EQUATIONS = {
    n: f"{string.ascii_lowercase[: n - 1]}i,oi->{string.ascii_lowercase[: n - 1]}o"
    for n in range(1, 27)
}


def _composed_linear(
    x: ShardTensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    layout: _ProductLayout,
    folded: bool,
) -> ShardTensor:
    """``F.linear`` laid out as ``layout``, composed of the operands' local views and torch's
    linear (NOTE [A linear layer runs torch's linear on the shards])."""
    local_bias = replicated_local(bias, layout.output.mesh, layout.output_axes) if folded else None
    out = _product(
        _LINEAR_EQUATIONS[x.ndim],
        [x, weight],
        layout,
        lambda x_local, w_local: F.linear(x_local, w_local, local_bias),
    )
    return out if bias is None or folded else out + bias


@cached("one-node linear plans", 256)
def _one_node_plan(equation: str, operands: tuple[_Operand, _Operand]) -> LinearPlan | None:
    """The layouts of the linear of ``operands`` as one autograd node, where each rank
    multiplies its own rows by the whole weight (NOTE [A linear layer is one autograd node]);
    None elsewhere."""
    layout = _product_layout(equation, operands)
    x, weight = operands
    if (
        layout is None
        or layout.ring is not None
        or layout.held
        or x.spec.partial
        or {"i", "o"} & layout.letters.keys()
        or (weight.spec is not None and not _is_replicated(weight.spec))
    ):
        return None
    output_axes = layout.output_axes
    weight_grad = tuple(
        Partial() if a in output_axes else Replicate() for a in range(x.spec.mesh.ndim)
    )
    input_grad = _as_placed(x.spec, tuple(_grad_placements(x.spec, output_axes)))
    return LinearPlan(layout.output, input_grad, weight_grad)


def _bias_folds(layout: _ProductLayout, bias: torch.Tensor) -> bool:
    """Whether each rank adds ``bias`` to its own output rows inside the local ``linear``
    (NOTE [A linear layer runs torch's linear on the shards]): whole output rows (the output
    features unsharded, no pending sum) and a bias every rank holds whole."""
    out = layout.output
    whole = not isinstance(bias, ShardTensor) or not (bias._spec.shardings or bias._spec.partial)
    return (
        layout.ring is None
        and whole
        and not out.partial
        and out.ndim - 1 not in out.sharding_by_dim
    )


# NOTE [A linear layer of a pending sum runs on each rank's term]
# ``F.linear(x, w)`` without a bias is linear in ``x``: where ``x`` is a pending sum of whole
# tensors (Partial over some mesh axes, no dim split: Transolver's slice tokens, sums over
# the points), each rank applies torch's linear to its own term and the output is the same
# pending sum, as the default path's rule gives (``Partial @ Replicate``), without its
# decomposition (a transpose, views and a matrix product dispatched on ShardTensors, each
# planned, and again in backward), in one autograd node (NOTE [A linear layer is one
# autograd node] in ``_linear_node``). The gradient of ``x`` is whole on every rank (a pending
# sum's gradient is replicated); the weight's, this rank's term times the whole output
# gradient, is a partial sum over the pending axes, summed like every weight's (NOTE [Where
# the gradient of a replicated parameter is summed]). With a bias the default path adds it
# to one term only, so such calls stay there.
def _pending_sum_of_wholes(x: object) -> bool:
    if type(x) is not ShardTensor or x.ndim == 0:
        return False
    spec = x._spec
    return (
        spec.partial
        and not spec.shardings
        and all(
            type(p) is Replicate or (type(p) is Partial and p.reduce_op == "sum")
            for p in spec.placements
        )
    )


def _whole_matrix(weight: object) -> bool:
    """A 2-D weight every rank holds whole: a plain tensor or a replicated ShardTensor."""
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        return False
    return not isinstance(weight, ShardTensor) or _is_replicated(weight._spec)


def _linear_of_pending_sum(x: ShardTensor, weight: torch.Tensor) -> ShardTensor:
    plan = _pending_plan(_Operand(x), weight.shape[0])
    if in_graph() or autocast_dtype(x) is not None:
        return _composed_pending_linear(x, weight, None, plan)
    composed = functools.partial(_composed_pending_linear, plan=plan)
    return linear_node(x, weight, None, plan, composed)


def _composed_pending_linear(
    x: ShardTensor, weight: torch.Tensor, bias: None, plan: LinearPlan
) -> ShardTensor:
    """The linear of pending sum ``x`` composed of the operands' local views and torch's
    linear (``bias`` is None: the signature of ``linear_node``'s composition)."""
    mesh = x._spec.mesh
    pending = {a for a, p in enumerate(plan.weight_grad) if isinstance(p, Partial)}
    local_weight = replicated_local(weight, mesh, pending)
    local_x = x.to_local(grad_placements=plan.input_grad.placements)
    out = F.linear(local_x, local_weight)
    return from_local_spec(out, plan.output.with_dtype(out.dtype))


@cached("pending linear layouts", 256)
def _pending_plan(operand: _Operand, features: int) -> LinearPlan:
    """The layouts of the linear of pending sum ``operand`` with ``features`` outputs: the
    output pending as the input, the input's gradient whole, the weight's pending over the
    input's pending axes."""
    spec = operand.spec
    shape = (*spec.shape[:-1], features)
    output = ShardTensorSpec.build(spec.mesh, spec.placements, shape, spec.dtype, hints=spec.hints)
    input_grad = _as_placed(spec, (Replicate(),) * spec.mesh.ndim)
    weight_grad = tuple(
        Partial() if isinstance(p, Partial) else Replicate() for p in spec.placements
    )
    return LinearPlan(output, input_grad, weight_grad)


def _matmul_operator(input, other):
    """The parameters of ``x @ y`` (``Tensor.__matmul__``, a builtin slot)."""


def _matrix_product(input, mat2, out_dtype=None, *, out=None):
    """The parameters of ``torch.mm`` and ``torch.bmm``: builtins with two aten schemas, with
    and without an output dtype."""


_MATMUL_SIGNATURES = {torch.Tensor.__matmul__: _matmul_operator}


@register_function_handler(
    torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__
)
def _matmul(func, args, kwargs):
    """``x @ y`` as an einsum. ``Tensor.__rmatmul__`` (``y.__rmatmul__(x)``, ``x @ y`` with a
    plain ``x``) is taken here too: left to its default, it calls ``at::matmul``, which folds
    a batched ``y``'s dims for a vector ``x`` and brings a split of ``y``'s columns back on
    the batch dim."""
    a = bind(func, args, kwargs, signature=_MATMUL_SIGNATURES.get(func))
    if getattr(a, "out", None) is not None:
        return NotImplemented
    x, y = (a.other, a.self) if func is torch.Tensor.__rmatmul__ else (a.input, a.other)
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        return NotImplemented
    equation = _matmul_as_einsum(x, y)
    if equation is None:
        return NotImplemented
    return _sharded_einsum(equation, [x, y])


@register_function_handler(torch.mm, torch.Tensor.mm)
def _mm(func, args, kwargs):
    a = bind(func, args, kwargs, signature=_matrix_product)
    if a.out_dtype is not None or a.out is not None:
        return NotImplemented
    return _sharded_einsum("nk,km->nm", [a.input, a.mat2])


@register_function_handler(torch.bmm, torch.Tensor.bmm)
def _bmm(func, args, kwargs):
    a = bind(func, args, kwargs, signature=_matrix_product)
    if a.out_dtype is not None or a.out is not None:
        return NotImplemented
    return _sharded_einsum("bnk,bkm->bnm", [a.input, a.mat2])


@register_aten_handler(aten.bmm.default)
def _aten_bmm(func, args, kwargs):
    """``bmm`` reached below ``__torch_function__`` (inside ``F.multi_head_attention_forward``,
    and in the backward of every product): as ``torch.bmm``, or summed around the ring into
    the layout of an operand (NOTE [A backward product over a dim both operands split is
    summed around the ring]), an operand whose split disagrees realigned first (NOTE [A
    product realigns the operand whose split disagrees]). DTensor's rule gathered a
    row-sharded operand with an empty shard."""
    a = bind(func, args, kwargs)
    operands = [a.self, a.mat2]
    if not accepts(*operands):
        return NotImplemented
    operands = _realigned(_BMM, operands)
    keys = tuple(map(_Operand, operands))
    scattered = _scattered_sum(_BMM, keys)
    if scattered is not None and not _records_graph(operands):
        return _summed_around(_BMM, operands, scattered)
    return _sharded_einsum(_BMM, operands)


_BMM = "bnk,bkm->bnm"


# NOTE [A backward product over a dim both operands split is summed around the ring]
# The backward of a product of token-sharded operands (``F.multi_head_attention_forward``'s
# ``bmm`` with ``need_weights=True``, below ``__torch_function__``, so not the ring product's
# own backward) contracts the tokens, split alike in both operands: the gradient of the keys
# ``q^T @ grad_scores``, of the values ``attn^T @ grad_out``. As a pending sum (the rule of
# the module docstring) each rank would hold the whole key-sized gradient, to be
# reduce-scattered into the keys' layout when it reaches them. Where the output has the shape
# of an operand split along another dim over the contracted letter's axes with the same
# sizes (self-attention: keys as long as the queries, laid out alike), each rank instead
# computes its term of every rank's block of that dim in turn and the blocks' accumulators
# pass around the ring (``sum_around``), each arriving at its owner summed: the output is
# laid out like that operand, and no rank holds more than two blocks of it (its own and one in
# flight), the bytes of the reduce-scatter it replaces. Only where no graph is recorded (a
# backward without ``create_graph``): that sum has no adjoint here.
@dataclass(frozen=True)
class _Scattered:
    """A product's pending sum over ``blocks``' axes returned as the blocks of ``dim`` of
    ``output`` (the output's letter ``letter``)."""

    output: ShardTensorSpec
    letter: str
    axes: tuple[int, ...]
    sizes: tuple[int, ...]
    dim: int


@cached("products summed around the ring", 256)
def _scattered_sum(equation: str, operands: tuple[_Operand, ...]) -> _Scattered | None:
    """How a product pending over one letter's axes is summed into the layout of an operand
    of its shape (NOTE [A backward product over a dim both operands split is summed around
    the ring]); None where it is not."""
    layout = _product_layout(equation, operands)
    output = equation.split("->")[1]
    if layout is None or layout.ring is not None or layout.held:
        return None
    contracted = [c for c in layout.letters if c not in output]
    if len(contracted) != 1:
        return None
    summed = layout.letters[contracted[0]]
    spec = layout.output
    pending = {a for a, p in enumerate(spec.placements) if isinstance(p, Partial)}
    if pending != set(summed.axes):
        return None
    for operand in operands:
        if operand.spec is None or tuple(operand.shape) != tuple(spec.shape):
            continue
        for s in operand.spec.shardings:
            if (s.axes, s.sizes) != (summed.axes, summed.sizes) or output[s.dim] in layout.letters:
                continue
            placements = [
                Shard(s.dim) if a in pending else p for a, p in enumerate(spec.placements)
            ]
            kept = {t.dim: t for t in spec.shardings} | {s.dim: s}
            scattered = spec.relaid(
                placements,
                {d: t.sizes for d, t in kept.items()},
                order={d: t.axes for d, t in kept.items()},
            )
            if scattered.layout_key == operand.spec.with_dtype(spec.dtype).layout_key:
                return _Scattered(scattered, output[s.dim], s.axes, s.sizes, s.dim)
    return None


def _records_graph(operands: list) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(o, torch.Tensor) and o.requires_grad for o in operands
    )


def _summed_around(equation: str, operands: list, scattered: _Scattered) -> ShardTensor:
    """The product of ``operands``, each rank's terms of every block of ``scattered.dim``
    summed around the ring onto the block's owner."""
    layout = _product_layout(equation, tuple(map(_Operand, operands)))
    mesh = layout.output.mesh
    subscripts = layout.subscripts
    locals_ = [
        _local_operand(o, s, layout.sliced, layout.output_axes, mesh)
        for o, s in zip(operands, subscripts)
    ]
    blocks = Blocks(axis_group(mesh, scattered.axes), scattered.sizes, scattered.dim)
    letter = scattered.letter

    def contribution(owner: int) -> torch.Tensor:
        start, size = blocks.starts[owner], blocks.sizes[owner]
        parts = [
            t.narrow(s.index(letter), start, size) if letter in s else t
            for t, s in zip(locals_, subscripts)
        ]
        return torch.einsum(equation, *parts)

    like = torch.empty(scattered.output.local_shape(), device="meta")
    out = sum_around(like, blocks, contribution)
    return from_local_spec(out, scattered.output.with_dtype(out.dtype))


def _einsum_parameters(equation, *operands):
    """The parameters of ``torch.einsum``, whose operands may also come as one list."""


@register_function_handler(torch.einsum)
def _einsum(func, args, kwargs):
    a = bind(func, args, kwargs, signature=_einsum_parameters)
    operands = list(a.operands)
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    equation = _explicit(a.equation, operands)
    if equation is None:
        return NotImplemented
    return _sharded_einsum(equation, operands)


def _explicit(equation: str, operands: list) -> str | None:
    """``equation`` with its output written out (torch's implicit form: the ``...`` dims, then
    the letters used once, in alphabetical order) and each ``...`` replaced by letters the
    equation does not use, aligned from the right; None for an equation torch would reject."""
    equation = equation.replace(" ", "")
    inputs, arrow, output = equation.partition("->")
    subscripts = inputs.split(",")
    if len(subscripts) != len(operands) or not all(isinstance(o, torch.Tensor) for o in operands):
        return None
    if not arrow:
        counts = Counter(c for c in inputs if c.isalpha())
        once = "".join(sorted(c for c, n in counts.items() if n == 1))
        output = ("..." if "..." in inputs else "") + once
    widths = [o.ndim - len(s) + 3 if "..." in s else 0 for s, o in zip(subscripts, operands)]
    if min(widths) < 0 or ("..." in output and "..." not in inputs):
        return None
    unused = "".join(c for c in string.ascii_letters if c not in equation)
    dims = unused[: max(widths)]
    subscripts = [s.replace("...", dims[len(dims) - w :]) for s, w in zip(subscripts, widths)]
    equation = ",".join(subscripts) + "->" + output.replace("...", dims)
    return (
        equation if all(c.isalpha() for c in equation.replace(",", "").replace("->", "")) else None
    )


def _matmul_as_einsum(x: torch.Tensor, y: torch.Tensor) -> str | None:
    """``x @ y`` as an einsum: batch dims aligned from the right (a dim of size 1 broadcasts,
    in einsum as in matmul); None when they do not broadcast (torch's error on the default
    path)."""
    if x.ndim == 0 or y.ndim == 0:
        return None
    x_batch, y_batch = x.shape[:-2], y.shape[:-2]
    try:
        batch = string.ascii_uppercase[: len(torch.broadcast_shapes(x_batch, y_batch))]
    except RuntimeError:
        return None
    rows, columns = ("n" if x.ndim > 1 else ""), ("m" if y.ndim > 1 else "")
    x_letters, y_letters = batch[len(batch) - len(x_batch) :], batch[len(batch) - len(y_batch) :]
    return f"{x_letters}{rows}k,{y_letters}k{columns}->{batch}{rows}{columns}"


# ---------------------------------------------------------------------------- the product
# NOTE [A product's layout is worked out once per value]
# Which letters are sharded, whether a ring resolves a conflict, which operands are cut to
# which shards and the output's layout depend on the equation and the operands' layouts (a
# ShardTensor's spec, a plain tensor's shape), not on their values: ``_product_layout`` works
# them out once per value of those (NOTE [Caches are keyed by value]) and every later call
# only cuts and multiplies its shards. What depends on the call stays per call: whether an
# operand requires grad (``replicated_local``), the ring-or-gather choice of a ring product
# (its gather policy sees every gather), and torch's own error for operands that do not fit.
#
# NOTE [A linear layer runs torch's linear on the shards]
# ``F.linear`` is the einsum ``...i,oi->...o`` laid out as above, but its local product is
# torch's ``linear`` of the local operands (one kernel, as the model on one process runs it),
# not ``torch.einsum``, and its bias is added inside that kernel wherever each rank holds
# whole output rows: the bias enters as a replicated operand (``replicated_local``), whose
# gradient, a partial sum over the ranks' rows, is summed like a weight's. Elsewhere (output
# features sharded, a pending sum over the input features) the bias is added to the sharded
# output afterwards. Where each rank multiplies its own rows by the whole weight, the call is
# one autograd node (NOTE [A linear layer is one autograd node] in ``_linear_node``).
class _Operand:
    """An operand's value for the product's layout: a ShardTensor's spec, a plain tensor's
    shape."""

    __slots__ = ("_key", "shape", "spec")

    def __init__(self, operand: torch.Tensor | ShardTensorSpec) -> None:
        spec = operand._spec if isinstance(operand, ShardTensor) else operand
        if isinstance(spec, ShardTensorSpec):
            self.spec, self.shape = spec, spec.shape
            self._key: object = spec.key
        else:
            self.spec, self.shape = None, operand.shape
            self._key = tuple(operand.shape)

    def whole(self) -> _Operand:
        """This operand with its held axes taken off (NOTE [A dim one rank holds is whole on
        that rank])."""
        return self if self.spec is None else _Operand(without_held(self.spec)[0])

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        return type(other) is _Operand and self._key == other._key


@dataclass(frozen=True)
class _ProductLayout:
    """How a product runs on the shards (NOTE [A product's layout is worked out once per
    value]).

    Attributes
    ----------
    subscripts : tuple of str
        Each operand's letters.
    ring : _Ring or None
        The ring product resolving the operands' conflict, if any.
    letters : dict
        Every sharded letter -> its sharding.
    sliced : dict
        The letters each operand is cut to its shard of (all but the ring's moving letter).
    output_axes : frozenset of int
        Mesh axes that shard the output or hold its pending sum.
    output : ShardTensorSpec
        The output's layout, with the first ShardTensor operand's dtype.
    held : tuple of _HeldLetters
        The operands' held axes, each with its holder and letters (NOTE [A product of held
        operands runs on their holder]).
    """

    subscripts: tuple[str, ...]
    ring: _Ring | None
    letters: dict[str, _Letter]
    sliced: dict[str, _Letter]
    output_axes: frozenset[int]
    output: ShardTensorSpec
    held: tuple[_HeldLetters, ...]


def _sharded_einsum(equation: str, operands: list):
    if not accepts(*operands):
        return NotImplemented
    operands = _realigned(equation, operands)
    layout = _product_layout(equation, tuple(map(_Operand, operands)))
    if layout is None:
        return NotImplemented
    return _product(equation, operands, layout, functools.partial(torch.einsum, equation))


# NOTE [A product realigns the operand whose split disagrees]
# Two operands may split their letters so that no product layout fits, though one all-to-all
# of one operand would make them fit. In the backward of ``F.multi_head_attention_forward``
# with ``need_weights=True`` on a 2x2 mesh (batch on one axis, tokens on the other), the
# output's gradient comes back from the views that merged batch and tokens with its tokens
# split over both axes, nested, while the values split the batch over one of them; DTensor's
# rule then gathers the gradient over an axis. Instead the operand that disagrees moves: each
# letter it shares with the other is split as the other splits it, and each of its other
# letters keeps the axes left to it (a nested split losing its inner axes keeps its outer
# blocks, each the sum of the inner blocks it held, so those rows stay where they are; else
# the sizes a hint remembers for those axes; else torch.chunk's). Taken only where the moved
# operand still splits over every axis it split (a realignment, each rank holding a like
# share: an all-to-all, never a gather) and the product then has a layout. Where either
# operand could move, the one whose product leaves the busiest rank the smaller output does
# (moving the other may leave a pending sum held whole: attention weights split like the
# gradient's nested tokens, the batch whole), then the one whose busiest rank receives fewer
# bytes (``largest_receive``, the bytes the box exchange moves).
def _realigned(equation: str, operands: list) -> list:
    """``operands`` with the one whose split disagrees realigned to the other (NOTE [A
    product realigns the operand whose split disagrees]); unchanged where they agree or no
    realignment makes them fit."""
    keys = tuple(map(_Operand, operands))
    plan = _realignment(equation, keys)
    if plan is None:
        return operands
    moved, spec = plan
    operands = list(operands)
    operands[moved] = redistribute(operands[moved], spec)
    return operands


@cached("product realignments", 256)
def _realignment(
    equation: str, operands: tuple[_Operand, ...]
) -> tuple[int, ShardTensorSpec] | None:
    """Which operand moves, and to which layout; None where none does."""
    if len(operands) != 2 or _product_layout(equation, operands) is not None:
        return None
    subscripts = equation.split("->")[0].split(",")
    best = None
    for moved in (0, 1):
        spec = _agreeing_spec(subscripts, operands, moved)
        if spec is None:
            continue
        stays = operands[1 - moved]
        keys = (_Operand(spec), stays) if moved == 0 else (stays, _Operand(spec))
        layout = _product_layout(equation, keys)
        if layout is None:
            continue
        cost = (_largest_shard(layout.output), largest_receive(operands[moved].spec, spec))
        if best is None or cost < best[0]:
            best = (cost, moved, spec)
    return None if best is None else best[1:]


def _largest_shard(spec: ShardTensorSpec) -> int:
    """Elements of the largest shard of ``spec`` (a pending sum's, held whole per rank)."""
    coordinates = itertools.product(*(range(n) for n in spec.mesh.shape))
    return max(math.prod(spec.local_shape(c)) for c in coordinates)


def _agreeing_spec(
    subscripts: list[str], operands: tuple[_Operand, ...], moved: int
) -> ShardTensorSpec | None:
    """Operand ``moved`` split as the other splits their shared letters, its own other
    letters on the axes left (NOTE [A product realigns the operand whose split disagrees]);
    None where either is not a ShardTensor without a pending sum, or the move would drop an
    axis."""
    src, other = operands[moved].spec, operands[1 - moved].spec
    if src is None or other is None or src.partial or other.partial or _is_replicated(src):
        return None
    mine, theirs = subscripts[moved], subscripts[1 - moved]
    wanted: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for s in other.shardings:
        c = theirs[s.dim]
        if c in mine and src.shape[mine.index(c)] == s.extent:
            wanted[mine.index(c)] = (s.axes, s.sizes)
    taken = {a for axes, _ in wanted.values() for a in axes}
    for s in src.shardings:
        kept = tuple(a for a in s.axes if a not in taken)
        if s.dim in wanted or not kept:
            continue
        wanted[s.dim] = (kept, _kept_sizes(src, s, kept))
        taken.update(kept)
    if {a for s in src.shardings for a in s.axes} - taken:
        return None
    placements: list[Placement] = [Replicate()] * src.mesh.ndim
    for dim, (axes, _) in wanted.items():
        for axis in axes:
            placements[axis] = Shard(dim)
    spec = src.relaid(
        placements,
        {d: sizes for d, (_, sizes) in wanted.items()},
        order={d: axes for d, (axes, _) in wanted.items()},
    )
    return None if spec.same_layout(src) else spec


def _kept_sizes(spec: ShardTensorSpec, s: DimSharding, kept: tuple[int, ...]) -> tuple[int, ...]:
    """The sizes of dim ``s.dim`` split over ``kept``, a subset of its axes ``s.axes``."""
    shape = spec.mesh.shape
    if kept == s.axes[: len(kept)]:
        inner = math.prod(shape[a] for a in s.axes[len(kept) :])
        return tuple(sum(s.sizes[k : k + inner]) for k in range(0, len(s.sizes), inner))
    for hint in reversed(spec.hints):
        if hint.axes == kept and hint.extent == s.extent:
            return hint.sizes
    return nested_chunk_sizes(s.extent, [shape[a] for a in kept])


@cached("product layouts", 1024)
def _product_layout(equation: str, operands: tuple[_Operand, ...]) -> _ProductLayout | None:
    """None when the product declines to the default path (module docstring)."""
    inputs, output = equation.split("->")
    subscripts = inputs.split(",")
    if len(subscripts) != len(operands) or any(
        len(s) != len(o.shape) for s, o in zip(subscripts, operands)
    ):
        return None
    sharded = [o.spec for o in operands if o.spec is not None]
    mesh = sharded[0].mesh
    if any(spec.mesh != mesh for spec in sharded):
        return None
    held = _held_letters(subscripts, operands)
    if held is None:
        return None
    operands = tuple(o.whole() for o in operands)
    ring = _ring_pair(subscripts, output, operands)
    letters = _sharded_letters(subscripts, operands, ring)
    if letters is None:
        return None
    held_axes = frozenset(a for axes in held for a in axes)
    output_axes = frozenset(a for letter in letters.values() for a in letter.axes) | held_axes
    sliced = {c: s for c, s in letters.items() if ring is None or c != ring.letter}
    spec = _output_spec(output, sliced, sharded[0].dtype, operands, subscripts, mesh)
    spec = _held_output(spec, output, held)
    holders = tuple(
        _HeldLetters(axes, holder, frozenset(c for _, c in found))
        for axes, (holder, found) in held.items()
    )
    return _ProductLayout(tuple(subscripts), ring, letters, sliced, output_axes, spec, holders)


@dataclass(frozen=True)
class _HeldLetters:
    """Mesh ``axes`` along which the rank at index ``holder`` holds all of ``letters``."""

    axes: tuple[int, ...]
    holder: int
    letters: frozenset[str]


# NOTE [A product of held operands runs on their holder]
# Operands with held axes (NOTE [A dim one rank holds is whole on that rank] in ``_common``:
# along them one rank holds all of a dim, the others nothing) are multiplied as if those dims
# were whole, on the holder: the holder's row of ranks computes the product of what it holds
# (laid out by the rules above, from the operands with their held axes taken off), and every
# other rank along the held axes, whose shards are empty along a held letter, an output of
# nothing (connected to its inputs, so that it takes part in their backward). The output
# keeps the held axes, nested outermost, on the dim of a held letter it keeps (the largest
# operand's: the field rather than the few tokens it meets), else on its first dim no axis
# splits, else its first dim: the holder holds the output whole along them. A held letter
# summed over is so kept by its holder (NOTE [A sum over a dim one rank holds stays with that
# rank]); a 0-d output has no dim for the axes and is pending a sum over them, the others'
# terms zeros. The other ranks run the local product on their operands cut to nothing along
# the held letters (a weight's rows too), so that every operand, a bias inside ``linear``
# included, takes part in the backward, and their output is cut to their empty shard of it.
# Operands held along one axis by different ranks, or held along an axis that another
# operand splits, decline to the default path.
def _held_letters(
    subscripts: list[str], operands: tuple[_Operand, ...]
) -> dict[tuple[int, ...], tuple[int, list[tuple[int, str]]]] | None:
    """Held mesh axes -> (their holder, (operand size, letter) per operand holding a letter
    along them) (NOTE [A product of held operands runs on their holder]); None when the
    operands disagree on a holder or another operand splits a held axis."""
    held: dict[tuple[int, ...], tuple[int, list[tuple[int, str]]]] = {}
    for subscript, operand in zip(subscripts, operands):
        if operand.spec is None:
            continue
        for h in without_held(operand.spec)[1]:
            holder, found = held.setdefault(h.axes, (h.holder, []))
            if holder != h.holder:
                return None
            found.append((math.prod(operand.shape), subscript[h.dim]))
    axes = [a for group in held for a in group]
    if len(axes) != len(set(axes)):
        return None
    for operand in operands:
        if operand.spec is not None and sharding_axes(operand.whole().spec) & set(axes):
            return None
    return held


def _held_output(
    spec: ShardTensorSpec,
    output: str,
    held: dict[tuple[int, ...], tuple[int, list[tuple[int, str]]]],
) -> ShardTensorSpec:
    """``spec`` with the held axes kept by their holder (NOTE [A product of held operands
    runs on their holder])."""
    taken = set(spec.sharding_by_dim)
    kept, pending = [], []
    for axes, (holder, found) in held.items():
        letters = [(n, c) for n, c in found if c in output]
        if letters:
            dim = output.index(max(letters, key=lambda t: t[0])[1])
        elif spec.ndim:
            dim = next((d for d in range(spec.ndim) if d not in taken), 0)
        else:
            pending.extend(axes)
            continue
        taken.add(dim)
        kept.append(Held(dim, axes, holder))
    if pending:
        placements = [Partial() if a in pending else p for a, p in enumerate(spec.placements)]
        spec = spec.relaid(
            placements,
            {s.dim: s.sizes for s in spec.shardings},
            order={s.dim: s.axes for s in spec.shardings},
        )
    return held_on(spec, kept) if kept else spec


def _not_held(held: tuple[_HeldLetters, ...], mesh) -> frozenset[str]:
    """The held letters of which this rank holds nothing."""
    coordinate = mesh_coordinate(mesh)
    return frozenset(
        c
        for h in held
        if index_over_axes(coordinate, h.axes, mesh.shape) != h.holder
        for c in h.letters
    )


def _cut(local: torch.Tensor, subscript: str, letters: frozenset[str]) -> torch.Tensor:
    """``local`` with nothing along ``letters``."""
    for d, c in enumerate(subscript):
        if c in letters:
            local = local.narrow(d, 0, 0)
    return local


def _fitted(out: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A rank's output of nothing (``_cut`` operands) in its empty shard's ``shape``."""
    for d, n in enumerate(shape):
        if out.shape[d] > n:
            out = out.narrow(d, 0, n)
    return out.reshape(shape)


def _product(
    equation: str, operands: list, layout: _ProductLayout, local_product: Callable
) -> ShardTensor:
    """The product of ``operands`` laid out by ``layout``: ``local_product`` of the local
    operands, or the ring product."""
    mesh, ring, subscripts = layout.output.mesh, layout.ring, layout.subscripts
    if ring is not None:
        _check_on_meta(equation, operands)
    locals_ = [
        _local_operand(o, s, layout.sliced, layout.output_axes, mesh)
        for o, s in zip(operands, subscripts)
    ]
    empty = _not_held(layout.held, mesh) if layout.held else frozenset()
    if empty and ring is not None:
        out = connected_empty(list(layout.output.local_shape()), locals_[0], *locals_)
    elif empty:
        locals_ = [_cut(t, s, empty) for t, s in zip(locals_, subscripts)]
        out = _fitted(local_product(*locals_), layout.output.local_shape())
    elif ring is None:
        out = local_product(*locals_)
    else:
        output = equation.split("->")[1]
        plan = _product_plan(ring, list(subscripts), output, operands, layout.letters)
        out = ring_product(locals_[ring.staying], locals_[ring.moving], plan)
    return from_local_spec(out, layout.output.with_dtype(out.dtype))


@dataclass(frozen=True)
class _Ring:
    """Two operands sharding different letters over the same mesh axes (NOTE [A product of
    token-sharded operands is sharded by query rows])."""

    staying: int
    moving: int
    rows: str
    letter: str
    axes: tuple[int, ...]


def _ring_pair(subscripts: list[str], output: str, operands: tuple[_Operand, ...]) -> _Ring | None:
    """The ring product resolving the operands' one conflict over a group of mesh axes;
    None when they have none, or it is not one a ring product resolves."""
    if len(operands) != 2 or any(o.spec is None for o in operands):
        return None
    by_axes = [
        {s.axes: subscript[s.dim] for s in o.spec.shardings}
        for subscript, o in zip(subscripts, operands)
    ]
    conflicts = [
        (axes, letter, by_axes[1][axes])
        for axes, letter in by_axes[0].items()
        if axes in by_axes[1] and by_axes[1][axes] != letter
    ]
    if len(conflicts) != 1 or any(len(set(s)) != len(s) for s in subscripts):
        return None
    axes, first, second = conflicts[0]
    if first not in output and second not in output:
        return None
    staying = 0 if first in output else 1
    moving = 1 - staying
    rows, letter = (first, second) if staying == 0 else (second, first)
    if rows in subscripts[moving] or _broadcasts(letter, subscripts, operands, staying, moving):
        return None
    return _Ring(staying, moving, rows, letter, axes)


def _broadcasts(
    letter: str, subscripts: list[str], operands: tuple[_Operand, ...], a: int, b: int
) -> bool:
    """Whether operand ``a`` has ``letter`` at size 1 against operand ``b``'s extent."""
    if letter not in subscripts[a]:
        return False
    extent = operands[b].shape[subscripts[b].index(letter)]
    return operands[a].shape[subscripts[a].index(letter)] != extent


def _sharded_letters(
    subscripts: list[str], operands: tuple[_Operand, ...], ring: _Ring | None
) -> dict[str, _Letter] | None:
    """Letter -> its sharding; None when operands disagree on a letter's sharding, letters
    share a mesh axis (other than ``ring``'s two), or a sharded operand has a letter whole
    that another shards (other than ``ring``'s staying operand, which has the moving
    operand's letter whole)."""
    letters: dict[str, _Letter] = {}
    for subscript, operand in zip(subscripts, operands):
        if operand.spec is None:
            continue
        for s in operand.spec.shardings:
            letter = _Letter(s.axes, s.sizes)
            if letters.setdefault(subscript[s.dim], letter) != letter:
                return None
    owners: dict[int, str] = {}
    for c, letter in letters.items():
        for axis in letter.axes:
            owner = owners.setdefault(axis, c)
            if owner != c and (ring is None or {owner, c} != {ring.rows, ring.letter}):
                return None
    for i, (subscript, operand) in enumerate(zip(subscripts, operands)):
        if operand.spec is not None and not _is_replicated(operand.spec):
            whole = {subscript[d] for d in _sliceable(subscript, operand, letters)}
            whole -= {subscript[s.dim] for s in operand.spec.shardings}
            if ring is not None and i == ring.staying:
                whole.discard(ring.letter)
            if whole:
                return None
    return letters


def _sliceable(
    subscript: str, operand: torch.Tensor | _Operand, letters: dict[str, _Letter]
) -> dict:
    """Dim -> sharding, for the dims of ``operand`` along a sharded letter (not those of size
    1 that broadcast against it)."""
    return {
        d: letters[c]
        for d, c in enumerate(subscript)
        if c in letters and operand.shape[d] == sum(letters[c].sizes)
    }


def _check_on_meta(equation: str, operands: list) -> None:
    """Raise torch's error for operands that do not fit ``equation`` on every rank, before
    any rank starts exchanging blocks."""
    probe_on_meta(torch.einsum, (equation, *operands))


def _product_plan(
    ring: _Ring, subscripts: list[str], output: str, operands: list, letters: dict
) -> ProductPlan:
    moving = operands[ring.moving]
    sharding = letters[ring.letter]
    dim = subscripts[ring.moving].index(ring.letter)
    gathered = list(moving._local.shape)
    gathered[dim] = moving.shape[dim]
    return ProductPlan(
        staying=subscripts[ring.staying],
        moving=subscripts[ring.moving],
        output=output,
        moving_first=ring.moving == 0,
        letter=ring.letter,
        blocks=Blocks(axis_group(moving._spec.mesh, ring.axes), sharding.sizes, dim),
        ring=ring_chosen(
            math.prod(gathered) * moving._local.element_size(),
            [(moving._spec, dim)],
            "the moving operand of a product",
        ),
    )


def _is_replicated(spec: ShardTensorSpec) -> bool:
    return all(isinstance(p, Replicate) for p in spec.placements)


def _local_operand(
    operand: torch.Tensor,
    subscript: str,
    letters: dict[str, _Letter],
    output_axes: frozenset[int],
    mesh,
) -> torch.Tensor:
    """This rank's part of one operand, with the gradient placements of the module docstring."""
    if isinstance(operand, ShardTensor) and not _is_replicated(operand._spec):
        return operand.to_local(grad_placements=_grad_placements(operand._spec, output_axes))
    wanted = _sliceable(subscript, operand, letters)
    if not isinstance(operand, ShardTensor):
        if not wanted:
            return replicated_local(operand, mesh, output_axes)
        operand = promote_replicated(operand, mesh)
    if wanted:
        operand = redistribute(operand, _sliced_spec(operand._spec, wanted))
    return operand.to_local(grad_placements=_grad_placements(operand._spec, output_axes))


def _grad_placements(spec: ShardTensorSpec, output_axes: frozenset[int]) -> list[Placement]:
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
    dtype: torch.dtype,
    operands: tuple[_Operand, ...],
    subscripts: list[str],
    mesh,
) -> ShardTensorSpec:
    """Sharded along the letters the output keeps, Partial over the axes of those it sums."""
    extents: dict[str, int] = {}
    for o, subscript in zip(operands, subscripts):
        for d, c in enumerate(subscript):
            if extents.get(c, 1) == 1:  # a dim of size 1 broadcasts, to any size, 0 included
                extents[c] = o.shape[d]
    placements: list[Placement] = [Replicate()] * mesh.ndim
    shardings = {}
    for c, letter in letters.items():
        if c not in output:
            for axis in letter.axes:
                placements[axis] = Partial()
    for position, c in enumerate(output):
        if c in letters:
            for axis in letters[c].axes:
                placements[axis] = Shard(position)
            shardings[position] = letters[c]
    return ShardTensorSpec.build(
        mesh,
        placements,
        [extents[c] for c in output],
        dtype,
        {d: letter.sizes for d, letter in shardings.items()},
        order={d: letter.axes for d, letter in shardings.items()},
        hints=merged_hints(
            *(o.spec.hints + o.spec.shardings for o in operands if o.spec is not None)
        ),
    )


# NOTE [A row-sharded product keeps its rows]
# ``aten.mm`` and ``aten.addmm`` reach dispatch, below the function handlers above, from
# composites that run with torch functions disabled (``F.multi_head_attention_forward``
# flattens (L, B, E) tokens into rows sharded over both mesh axes, then ``linear``) and from
# autograd (the input gradient ``grad @ W``). Rows sharded over any mesh axes, in any nesting,
# times a replicated matrix need no data from another rank: each rank multiplies its rows and
# the output keeps them where they are (the rows' placements, order and sizes). DTensor's rule
# instead replicates one nested axis of the rows.
def _row_sharded(x: object, other: object) -> bool:
    """Whether ``x @ other`` is a ShardTensor sharded on its rows alone times a replicated
    matrix (NOTE [A row-sharded product keeps its rows])."""
    return (
        isinstance(x, ShardTensor)
        and x.ndim == 2
        and tuple(s.dim for s in x._spec.shardings) == (0,)
        and accepts(x, replicated=[other])
    )


def _rows_kept(x: ShardTensor, out: torch.Tensor, columns: int) -> ShardTensor:
    rows = x._spec.shardings[0]
    spec = ShardTensorSpec.build(
        x._spec.mesh,
        x._spec.placements,
        (x.shape[0], columns),
        out.dtype,
        {0: rows.sizes},
        order={0: rows.axes},
        hints=merged_hints(x._spec.hints + x._spec.shardings),
    )
    return ShardTensor(out, spec)


# NOTE [A product over sharded columns is a pending sum]
# ``aten.mm(x, w)`` with ``x``'s columns (the contracted dim) sharded and ``w`` replicated, as
# ``linalg.multi_dot`` and autograd reach it: each rank multiplies its columns by the rows of
# ``w`` they meet, and the output is pending a sum over the axes that shard the columns
# (its rows keep theirs), moving nothing, or kept by the one rank that holds the columns
# (NOTE [A sum over a dim one rank holds stays with that rank]); DTensor's rule gathers
# ``x`` instead.
def _columns_sharded(x: object, other: object) -> bool:
    """Whether ``x @ other`` is a ShardTensor sharded on its columns, and perhaps its rows,
    times a replicated matrix (NOTE [A product over sharded columns is a pending sum])."""
    return (
        isinstance(x, ShardTensor)
        and x.ndim == 2
        and 1 in x._spec.sharding_by_dim
        and accepts(x, replicated=[other])
    )


def _columns_summed(x: ShardTensor, other: torch.Tensor) -> ShardTensor:
    spec = x._spec
    columns = spec.sharding_by_dim[1]
    start, count = spec.local_offsets()[1], spec.local_shape()[1]
    out = aten.mm.default(x._local, local_of(other).narrow(0, start, count))
    placements = [
        Partial() if axis in columns.axes else p for axis, p in enumerate(spec.placements)
    ]
    rows = spec.sharding_by_dim.get(0)
    out_spec, held = held_by_one(
        ShardTensorSpec.build(
            spec.mesh,
            placements,
            (x.shape[0], other.shape[1]),
            out.dtype,
            {0: rows.sizes} if rows else {},
            order={0: rows.axes} if rows else {},
            hints=merged_hints(spec.hints + spec.shardings),
        ),
        ((columns.axes, columns.sizes),),
    )
    return ShardTensor(held_local(out, out_spec, held), out_spec)


@register_aten_handler(aten.mm.default)
def _sharded_mm(func, args, kwargs):
    a = bind(func, args, kwargs)
    if _columns_sharded(a.self, a.mat2):
        return _columns_summed(a.self, a.mat2)
    if _row_sharded(a.self, a.mat2):
        out = aten.mm.default(a.self._local, local_of(a.mat2))
        return _rows_kept(a.self, out, a.mat2.shape[1])
    if _any_held(a.self, a.mat2) or _contracted_in_both(a.self, a.mat2):
        return _sharded_einsum("nk,km->nm", [a.self, a.mat2])
    return NotImplemented


def _contracted_in_both(x: object, other: object) -> bool:
    """Whether ``x @ other`` contracts a dim both ShardTensors split (a weight's gradient
    ``grad^T @ x`` over token-split rows): a pending sum by the module docstring's rule,
    where DTensor's rule gathers an uneven or empty split."""
    return (
        isinstance(x, ShardTensor)
        and isinstance(other, ShardTensor)
        and 1 in x._spec.sharding_by_dim
        and 0 in other._spec.sharding_by_dim
    )


# NOTE [A backward product of held operands stays on their holder]
# A product one rank holds (NOTE [A product of held operands runs on their holder]) reaches
# ``aten.mm`` again in its backward with held operands on both sides or beside a replicated
# one (the weight's gradient ``x^T @ grad``, both held by the holder; then ``b^T @ grad`` of
# a plain ``b`` it came from), which neither rule above serves: it is laid out as that
# einsum, kept by the holder, rather than declined to DTensor's rule, which replicates the
# held operand onto every rank.
def _any_held(x: object, other: object) -> bool:
    """Whether an operand of ``x @ other`` is a ShardTensor with held axes."""
    return any(isinstance(t, ShardTensor) and without_held(t._spec)[1] for t in (x, other))


@register_aten_handler(aten.addmm.default)
def _row_sharded_addmm(func, args, kwargs):
    """``beta self + alpha mat1 @ mat2``, with ``self`` broadcast along the rows."""
    a = bind(func, args, kwargs)
    bias = a.self
    along_rows = bias.ndim == 2 and bias.shape[0] != 1
    if along_rows or not _row_sharded(a.mat1, a.mat2) or not accepts(a.mat1, replicated=[bias]):
        return NotImplemented
    out = aten.addmm.default(
        local_of(bias), a.mat1._local, local_of(a.mat2), beta=a.beta, alpha=a.alpha
    )
    return _rows_kept(a.mat1, out, a.mat2.shape[1])


# NOTE [A sharded bias keeps its blocks]
# ``addmm(bias, mat1, mat2)`` with the bias sharded as a whole (rows, columns or blocks) and
# both matrices replicated: each rank computes only its block of the product, the rows of
# mat1 and the columns of mat2 its bias block spans, so the output keeps the bias's layout
# and nothing moves. The matrices' gradients are partial sums over the bias's sharding axes.
@register_function_handler(torch.addmm, torch.Tensor.addmm)
def _sharded_bias_addmm(func, args, kwargs):
    a = bind(func, args, kwargs, signature=_addmm_signature)
    bias, mat1, mat2 = a.input, a.mat1, a.mat2
    if a.get("out") is not None or not isinstance(bias, ShardTensor) or bias.ndim != 2:
        return NotImplemented
    if tuple(bias.shape) != (mat1.shape[0], mat2.shape[1]) or not accepts(
        bias, replicated=[mat1, mat2]
    ):
        return NotImplemented
    spec = bias._spec
    axes = sharding_axes(spec)
    (row, col), (rows, cols) = spec.local_offsets(), spec.local_shape()
    mat1 = replicated_local(mat1, spec.mesh, axes).narrow(0, row, rows)
    mat2 = replicated_local(mat2, spec.mesh, axes).narrow(1, col, cols)
    out = torch.addmm(bias.to_local(), mat1, mat2, beta=a.beta, alpha=a.alpha)
    return from_local_spec(out, spec.with_dtype(out.dtype))


def _addmm_signature(input, mat1, mat2, *, beta=1, alpha=1, out=None):
    """``torch.addmm``'s parameters (its dense and sparse overloads share them)."""


@register_aten_handler(aten.addbmm.default, aten.baddbmm.default)
def _add_batched_product(func, args, kwargs):
    """``beta input + alpha sum_b batch1[b] @ batch2[b]`` (addbmm) or ``beta input + alpha
    batch1 @ batch2`` (baddbmm: ``F.multi_head_attention_forward``'s masked scores, row-sharded
    queries against whole keys), from ops with rules: the bias is added to the product's
    shards, never the product gathered to the bias's layout."""
    a = bind(func, args, kwargs)
    product = aten.bmm.default(a.batch1, a.batch2)
    if func is aten.addbmm.default:
        product = aten.sum.dim_IntList(product, [0])
    product = aten.mul.Scalar(product, a.alpha)
    if a.beta == 0:  # input ignored, NaN included
        return aten.add.Tensor(aten.zeros_like.default(a.self), product)
    return aten.add.Tensor(aten.mul.Scalar(a.self, a.beta), product)
