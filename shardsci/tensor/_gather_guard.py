"""The gather guard: what a rank may be made to hold of a tensor without asking.

# NOTE [Gathers an op was not asked to make]
What counts. A redistribution *gathers* when it leaves the tensor split into fewer pieces: the
product of the sizes of the mesh axes that shard its dims shrinks (a dim sharded over an axis
becomes replicated over it, and no other axis splits the tensor in its place). Every rank then
holds a larger share of it: the whole sharded extent on a 1-D mesh, half instead of a quarter
on a 2x2 mesh going to slabs. It counts whatever its size; messages give the bytes so that the
user can judge. Not gathers: a move that keeps the number of pieces (``Shard(i) -> Shard(j)``,
a 2x2 block to slabs split over both axes, a rebalance of uneven sizes: each rank's share
stays), a pending reduction done (``Partial -> Replicate``: an all-reduce of what each rank
holds), a slice (``Replicate -> Shard``), and collectives on data that is not a sharded extent
of an operand (the statistics a norm or a scan exchanges, a halo, the rows an index reaches
while no rank gets all of them).
The rows an index reaches count when some rank gets them all: a gather or selection through an
index (``x[idx]``, ``index_select``, ``gather``, ``take``, an aten ``index`` or
``_unsafe_masked_index``) fetches onto each rank the remote rows of the indexed dim its part of
the index names (NOTE [Gathers along a sharded dim go through a cached halo plan] in
``_gather_plan``). A read whose output is replicated over the axes that split the indexed dim
(a replicated index whose entries' owners go back, so that no split of the output holds each
entry where its row lies: ``x[[5, 0]]``) counts whatever rows it reaches: every rank fetches
every row the index names and holds the whole read, a layout split into fewer pieces than the
input's, as if read from the input gathered (:func:`check_replicated_read`), in a forward
(a read through an index split over other axes, ``x[idx]`` with ``idx`` split where ``x`` is
whole, keeps as many pieces as the input: only its fetch counts, as below). In a backward
such a read is a formula's gradient of a scatter's source through that index (or the values
it compares with that source: ``scatter_reduce``'s ``amax``), replicated over those axes as
the forward held that source: a scatter through a replicated index takes a source split over
them only where the gather through that index keeps them split, and its read is then not
replicated (NOTE [Scatters through a replicated index write where they land]). It
holds the layout of a forward input, chosen in the forward, as the backward of a
redistribution returns (``tests/test_scatter_replicated_index.py``: aten-level scatters from
a plain source that needs a gradient, under ``"error"``). Where a fetch
leaves a rank holding every row of the dim, at least half of
them fetched, the rank holds what the dim made ``Replicate`` over its axes gives it, at least
twice what it held: a gather on that rank, whatever its size (:func:`check_fetch`, before the
rows move; an output that keeps the input's split, or is split like a sharded index, may
still read from everywhere: ``index_select`` of a permutation swapping two shards;
``gather`` and ``take_along_dim`` fetch only the cells they read, at most their output's
part, and never count: NOTE [A cell-wise read moves cells] in ``_gather_plan``). Not
counted there: a fetch of fewer rows, which are rows the rank's own part of the output reads (a window's halo, a graph partition's boundary: memory the output's size
chose), and a rank that held most of the dim fetching the rest (an uneven split: ``(4, 1)``
rows, a permutation sending the fifth row to the first rank): less than double what it held, as
a halo as wide as its shard would leave it. Which rows a rank reaches is data: the fetch's
plan holds every rank's counts (exchanged when the index is sharded, computed by each rank
from a replicated one), so every rank decides alike.
A pending sum held whole counts too: a redistribution that reduces a ``Partial`` axis into a
``Shard`` (a reduce-scatter) finds every rank holding the sum's whole extent along the dim the
target splits, since the op that left it pending; the memory per rank was a gather's before
the collective although no earlier redistribution gathered. (Reducing it to ``Replicate``
is not: the tensor is split on neither side.) And a pending sum held whole is seen where it is
made, since it may never be reduced: an op whose output is pending over a mesh axis that
shards an operand, each rank's part at least that whole operand (``A @ x`` with a plain ``A``
contracting the dim of ``x`` the axis splits) counts as it returns (``_dispatch`` calls
:func:`check_result`); a reduction's pending result (``x.sum(2)``) holds less than what it
reduced and does not; nor, in a backward, does one no larger than a replicated tensor the running
autograd node holds anyway: a parameter whose gradient it returns (the weight's gradient
``grad_out^T @ x`` of an aten-level ``addmm`` over token-split rows, larger than a rank's rows
only while they are few), or a forward input it saved (the values of a whole memory, whose
gradient ``attn^T @ grad_out`` contracts the split queries): every rank holds that tensor,
and its gradient, whole anyway, and no layout avoids it. So does a gradient built whole: a backward formula that makes a plain
tensor of its input's global shape (``zeros(sizes)``, scattered into) has every rank hold the
whole extent of a sharded tensor's gradient before it is sliced back to that tensor's layout; no
collective runs, so no redistribution sees it, and the backward of ``from_local`` or of a
redistribution, which receives it, calls :func:`check_built_whole` (whatever the op stack:
nobody asks for it).

Who asked. A gather counts when an op makes it, as its fallback: while an op is dispatched (an
aten or function handler runs, the pointwise fast path runs, or the default path moves operands
to the placements DTensor's rule wants, which covers a handler's decline that ends in a
replicated output). Not counted:
- ``x.full_tensor()``, ``x.redistribute(...)`` and ``x.to_dtensor()`` called outside any op:
  the user asked;
- an op whose result is one Python value for the whole tensor (``x.item()``): the user asked;
- an in-place op's operands moved to its destination's layout, and its result copied into
  it (``buffer.copy_(x)`` into a replicated buffer: the user chose the destination, which
  every rank holds whole already);
- the backward of a redistribution and of shardsci's autograd Functions, run by the autograd
  engine outside any op: they return gradients to the layouts of their forward inputs, which
  were chosen in the forward; so does an aten backward handler returning the gradient of a
  forward input it had realigned to that input's layout (the fused attention's key and value
  gradients to a replicated memory's projections: ``_attention_ops._returned``), which no
  rank held less of in the forward. Backward *ops* (``index_add``, ``masked_select_backward``) are
  dispatched like any op and counted.
Attention's keys and values are the one sharded extent gathered by a collective of its own
rather than by a redistribution: an all-gather chosen by ``attention_exchange("auto")`` counts
(each rank holds all of K and V until the backward); under ``"error"`` the ring is taken
instead (same result, no gather); ``attention_exchange("all_gather")`` is asked for.

Where it is decided. ``_redistribute.redistribute_local``, which every layout change passes
through, calls :func:`check_redistribution` before any data moves; ``_dispatch`` and
``_function_dispatch`` push the op being dispatched on a per-thread stack around every route
it may take (handlers, the pointwise fast path, whose one move, a 0-d operand's pending sum
reduced, gathers nothing today, and the default path); attention asks
:func:`may_gather_blocks` (so does a product of two token-sharded operands). The verdict reads only specs, the op stack and the policy,
which all ranks share (the policy must be set alike on every rank: the environment variable or
the same code), so under ``"error"`` every rank raises the same :class:`GatherError` at the
same redistribution, before its collective, and none is left waiting. A fetch through an index
is decided where its rows are about to move (``_ops/_gather_scatter_ops``), from the rows every
rank holds after it, which its plan states alike on every rank (a sharded index's plan learns
them in its exchange of counts, which every rank runs before any decides).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import sys
import threading
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Literal

import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from shardsci.tensor._caches import cached
from shardsci.tensor._spec import ShardTensorSpec
from shardsci.tensor._torch_compat import Module_call_impl, OpOverload, _current_autograd_node

__all__ = [
    "ENVIRONMENT_VARIABLE",
    "Gather",
    "GatherError",
    "GatherWarning",
    "asked_for",
    "check_built_whole",
    "check_fetch",
    "check_redistribution",
    "check_replicated_read",
    "check_result",
    "dispatching",
    "gather_policy",
    "gathers",
    "may_gather_blocks",
    "pending_whole",
    "record_gathers",
    "reduces_whole_pending_sum",
]

Policy = Literal["allow", "warn", "error"]
_POLICIES = ("allow", "warn", "error")
ENVIRONMENT_VARIABLE = "SHARDSCI_GATHER"


class GatherError(RuntimeError):
    """An op would gather a sharded tensor under ``gather_policy("error")``; raised on every
    rank before the collective."""


class GatherWarning(UserWarning):
    """An op gathered a sharded tensor under ``gather_policy("warn")``; said once per op and
    call site."""


# ---------------------------------------------------------------------------- the policy
def _checked(mode: object, source: str) -> Policy:
    if mode not in _POLICIES:
        raise ValueError(f"{source} must be 'allow', 'warn' or 'error', got {mode!r}")
    return mode  # type: ignore[return-value]


def _from_environment() -> Policy:
    value = os.environ.get(ENVIRONMENT_VARIABLE, "").strip().lower()
    return _checked(value, f"the environment variable {ENVIRONMENT_VARIABLE}") if value else "warn"


_POLICY: list[Policy] = [_from_environment()]


class gather_policy:  # lower case: called like a function, as torch.no_grad
    """What an op may do when it would gather a sharded tensor that the user did not ask for.

    ``gather_policy(mode)`` sets the policy for the process at once; used as a context manager
    (``with gather_policy("error"): ...``), it restores the previous policy on exit, so blocks
    nest. The initial policy comes from the environment variable ``SHARDSCI_GATHER``, else
    ``"warn"``. What counts as a gather: NOTE [Gathers an op was not asked to make] in
    ``shardsci/tensor/_gather_guard.py``; in short, a redistribution made by an op (not by
    ``full_tensor()`` or ``redistribute()``) that leaves a tensor split into fewer pieces, so
    that each rank holds more of it.

    Parameters
    ----------
    mode : {"allow", "warn", "error"}
        ``"allow"``: gather silently. ``"warn"``: gather, and say once per op and call site
        which op gathered how many bytes of which tensor, in which module and source line
        (a :class:`GatherWarning`). ``"error"``: raise that as a :class:`GatherError` on every
        rank before the collective runs (and take attention's ring rather than gather its
        keys and values).

    Examples
    --------
    >>> with shardsci.gather_policy("error"):  # doctest: +SKIP
    ...     loss = model(x).square().mean()  # raises where an op would gather
    """

    def __init__(self, mode: Policy) -> None:
        self._previous = _POLICY[0]
        _POLICY[0] = _checked(mode, "gather_policy's mode")

    def __enter__(self) -> gather_policy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        _POLICY[0] = self._previous

    @staticmethod
    def current() -> Policy:
        """The policy in force."""
        return _POLICY[0]


# ---------------------------------------------------------------------------- ops in dispatch
class _Dispatching(threading.local):
    def __init__(self) -> None:
        self.ops: list[object] = []


_THREAD = _Dispatching()
# On the op stack: what follows is asked for (``asked_for``).
_ASKED = object()


def dispatching() -> list[object]:
    """This thread's stack of ops being dispatched, innermost last: dispatch pushes an op
    before its handler or default path runs and pops it after (NOTE [Gathers an op was not
    asked to make])."""
    return _THREAD.ops


@contextmanager
def asked_for() -> Iterator[None]:
    """Redistributions inside the block are the user's request, not an op's fallback (into
    an in-place op's destination layout)."""
    ops = _THREAD.ops
    ops.append(_ASKED)
    try:
        yield
    finally:
        ops.pop()


# Ops whose result is one Python value for the whole tensor: reading it is the user's request.
_VALUE_READS = frozenset({torch.ops.aten._local_scalar_dense.default})


# ---------------------------------------------------------------------------- records
@dataclass(frozen=True)
class Gather:
    """One gather an op made, or would have made, without being asked.

    Attributes
    ----------
    op : str
        The op that gathered, e.g. ``"aten.index_select.default"``.
    within : str or None
        The outermost op being dispatched when it is another (``F.interpolate`` running
        ``aten._unsafe_index``), else None.
    module : str or None
        The ``nn.Module`` whose forward was running, as a path from the outermost one with the
        innermost's class, e.g. ``"ViT.blocks.0.attention (Attention)"``; None outside modules.
    backward_of : str or None
        The autograd node whose backward ran the op, e.g. ``"IndexSelectBackward0"``.
    call_site : str or None
        ``"path:line"`` of the innermost frame outside torch and shardsci's library (the zoo,
        ``shardsci.models``, counts as the user's code).
    what : str
        What was gathered: ``"a tensor"``, ``"a pending sum"`` (a sum each rank held whole
        along a dim the target splits, reduced by a reduce-scatter: the rank held the whole
        extent before the collective, not after it), ``"a pending result"`` (the op's output
        is such a sum, each rank's part at least the whole operand ``source``; said where it
        is made, as it may never be reduced), ``"a gradient built whole"`` (a backward
        formula's plain tensor of the global shape, ``source`` replicated, to be sliced to
        ``target``), ``"the rows an index reads"`` (every row of the indexed dim fetched onto
        some rank, ``target`` that dim whole), ``"a read through an index"`` (``target`` the
        read's layout, replicated where ``source`` split the indexed dim; ``total_bytes`` and
        ``bytes_per_rank`` the read's) or ``"the keys and values"`` (attention's; the
        shape and layout are the keys').
    source, target : ShardTensorSpec
        The layout before and after.
    total_bytes : int
        Bytes of the whole tensor (of keys and values together for attention).
    bytes_per_rank : int
        Bytes the most loaded rank holds after the gather (or the reduction).
    bytes_per_rank_before : int
        Bytes the most loaded rank held before it (of a pending sum: all of its extent along
        the dims the target splits).
    """

    op: str
    within: str | None
    module: str | None
    backward_of: str | None
    call_site: str | None
    what: str
    source: ShardTensorSpec
    target: ShardTensorSpec
    total_bytes: int
    bytes_per_rank: int
    bytes_per_rank_before: int

    def message(self, refused: bool) -> str:
        """One line: which op gathers how many bytes of which tensor, where, and what to do."""
        src = self.source
        op = self.op if self.within is None else f"{self.op} (inside {self.within})"
        described = f"{_dtype_name(src.dtype)} tensor of shape {tuple(src.shape)}"
        if self.what == "a tensor":
            verb, described = ("would gather", "gathered"), f"a {described}"
        elif self.what == "a pending result":
            # The op's own output: a sum left pending, each rank holding all of it.
            verb, described = (
                ("would make", "made"),
                f"a pending sum, held whole, from a {described}",
            )
        elif self.what == "a gradient built whole":
            # No collective: a backward formula made it at the global shape on every rank.
            verb, described = (("would build", "built"), f"a gradient whole, a {described},")
        elif self.what == "the rows an index reads":
            # No redistribution: the fetch brought some rank every row of the indexed dim.
            verb, described = (
                ("would fetch", "fetched"),
                f"every row of the indexed dim of a {described}, through an index,",
            )
        elif self.what == "a read through an index":
            # The read, replicated: every rank holds all of it, from every rank's rows.
            verb, described = (
                ("would replicate", "replicated"),
                f"its read through an index of a {described},",
            )
        elif self.what == "a pending sum":
            # Held whole since the op that left the sum pending; the reduction splits it.
            verb, described = (
                ("would reduce", "reduced"),
                f"a pending sum, held whole, of a {described}",
            )
        else:
            verb, described = ("would gather", "gathered"), f"{self.what} (keys: {described})"
        where = "".join(
            f"{label}{value}"
            for label, value in (
                (" in module ", self.module),
                (" in the backward of ", self.backward_of),
                (", called from ", self.call_site),
            )
            if value is not None
        )
        head = (
            f"{op} {verb[0] if refused else verb[1]} {described} laid out "
            f"{_layout(src)} into {_layout(self.target)}: each rank "
            f"{'would hold' if refused else 'holds'} up to {_bytes(self.bytes_per_rank)}, up "
            f"to {_bytes(self.bytes_per_rank_before)} before ({_bytes(self.total_bytes)} in "
            f"all){where}"
        )
        if refused:
            return (
                f"shardsci refused a gather (gather policy 'error'): {head}. Redistribute the "
                f"tensor yourself before the op if you mean it (x.redistribute(...) and "
                f"x.full_tensor() are never refused), or allow it with "
                f"shardsci.gather_policy('warn' or 'allow') or {ENVIRONMENT_VARIABLE}"
            )
        return (
            f"shardsci: {head}. Said once per op and call site; "
            f"shardsci.gather_policy('error') or {ENVIRONMENT_VARIABLE}=error refuses such "
            f"gathers, 'allow' silences them"
        )


_RECORDERS: list[list[Gather]] = []


@contextmanager
def record_gathers() -> Iterator[list[Gather]]:
    """Collect every :class:`Gather` an op makes inside the block, whatever the policy (under
    ``"error"`` the gather that raises is recorded first). For tools that list gathers per
    layer (a dry run) and for tests.

    Examples
    --------
    >>> with shardsci.gather_policy("allow"), shardsci.record_gathers() as gathers:  # doctest: +SKIP
    ...     model(x)
    >>> [(g.op, g.module, g.bytes_per_rank) for g in gathers]  # doctest: +SKIP
    """
    gathers: list[Gather] = []
    _RECORDERS.append(gathers)
    try:
        yield gathers
    finally:
        _RECORDERS.remove(gathers)


# ---------------------------------------------------------------------------- the checks
def check_redistribution(src: ShardTensorSpec, dst: ShardTensorSpec) -> None:
    """Apply the policy to a layout change about to run (``redistribute_local``, before any
    data moves): nothing unless an op is being dispatched and the change gathers."""
    ops = _THREAD.ops
    if not ops or (_POLICY[0] == "allow" and not _RECORDERS):
        return
    if ops[-1] is _ASKED or ops[-1] in _VALUE_READS:
        return
    if gathers(src, dst):
        what = "a tensor"
    elif reduces_whole_pending_sum(src, dst):
        what = "a pending sum"
    else:
        return
    total = _bytes_of(src)
    _enforce(ops, what, src, dst, total, _largest_shard(src), _largest_shard(dst))


def check_result(operands: Sequence[object], result: object) -> None:
    """Apply the policy to an op's result (``_dispatch``, as the op returns): nothing unless
    an output is a pending sum each rank holds whole (:func:`pending_whole`). Raised after the
    op's own collectives, before any later one, on every rank alike (specs only)."""
    ops = _THREAD.ops
    if not ops or (_POLICY[0] == "allow" and not _RECORDERS):
        return
    if ops[-1] is _ASKED or ops[-1] in _VALUE_READS:
        return
    for out in result if isinstance(result, (tuple, list)) else (result,):
        spec = getattr(out, "_spec", None)
        if spec is None or not spec.partial:
            continue
        source = pending_whole(operands, spec)
        if source is not None and not _within_a_parameter(spec):
            held = _largest_shard(spec)
            before = _largest_shard(source)
            _enforce(ops, "a pending result", source, spec, _bytes_of(spec), before, held)


def check_built_whole(spec: ShardTensorSpec) -> None:
    """Apply the policy to a gradient built plain at the global shape of a tensor laid out as
    ``spec``, before it is sliced to ``spec``: nothing unless each rank then holds more of
    it than ``spec``'s largest shard."""
    if _POLICY[0] == "allow" and not _RECORDERS:
        return
    total = _bytes_of(spec)
    held = _largest_shard(spec)
    if total > held:
        whole = ShardTensorSpec.build(
            spec.mesh, [Replicate()] * spec.mesh.ndim, spec.shape, spec.dtype
        )
        ops = _THREAD.ops or ["a backward formula"]
        _enforce(ops, "a gradient built whole", whole, spec, total, held, total)


def check_fetch(spec: ShardTensorSpec, dim: int, rows: Iterable[tuple[int, int]]) -> None:
    """Apply the policy to the rows of ``dim`` (sharded) of a tensor laid out as ``spec`` that
    an index fetches, before they move: nothing unless some rank then holds every row of
    ``dim``, at least half of them fetched (NOTE [Gathers an op was not asked to make]).

    Parameters
    ----------
    rows : iterable of (int, int)
        ``(rows owned, rows held after the fetch)`` of ``dim`` on every rank, the same on
        every rank; read only when the policy is not ``"allow"`` or a recorder listens.
    """
    ops = _THREAD.ops
    if not ops or (_POLICY[0] == "allow" and not _RECORDERS):
        return
    if ops[-1] is _ASKED or ops[-1] in _VALUE_READS or math.prod(spec.shape) == 0:
        return
    extent = spec.shape[dim]
    if any(held == extent >= 2 * owned for owned, held in rows):
        whole = _whole_along(spec, dim)
        before, after = _largest_shard(spec), _largest_shard(whole)
        _enforce(ops, "the rows an index reads", spec, whole, _bytes_of(spec), before, after)


def check_replicated_read(source: ShardTensorSpec, read: ShardTensorSpec) -> bool:
    """Apply the policy to a read through an index from a tensor laid out as ``source`` whose
    output, laid out as ``read``, is replicated over the axes that split the indexed dim,
    before its rows move: nothing unless the read holds elements, is split into fewer pieces
    than ``source`` and is made in a forward (NOTE [Gathers an op was not asked to make]: a
    backward formula's read is the gradient of a scatter's source, which the forward held
    replicated over those axes). Returns whether the policy was applied (False under
    ``"allow"`` with no recorder)."""
    ops = _THREAD.ops
    if not ops or (_POLICY[0] == "allow" and not _RECORDERS):
        return False
    if ops[-1] is _ASKED or ops[-1] in _VALUE_READS or math.prod(read.shape) == 0:
        return False
    if _current_autograd_node() is not None:
        return False
    if _pieces(read) >= _pieces(source):
        return False
    before, after = _largest_shard(source), _largest_shard(read)
    _enforce(ops, "a read through an index", source, read, _bytes_of(read), before, after)
    return True


def pending_whole(operands: Sequence[object], spec: ShardTensorSpec) -> ShardTensorSpec | None:
    """The spec of an operand that makes the result laid out as ``spec`` a whole pending
    one, else None: ``spec`` is pending (Partial) over mesh axes that shard the operand, and
    each rank's part of it is more than the operand's largest shard and at least as much as
    a rank would hold of the operand gathered over those axes. (A reduction's pending result
    is smaller than what it reduced: ``x.sum(2)`` of a field split along H holds one row; and
    an operand with no element, empty on every rank, gathers nothing: ``x.sum()`` of a
    sequence no rank has holds one zero.) Counted in elements, not bytes: a result of a wider
    dtype than its operand (the int64 count of a bool mask, as in ``amax``'s backward) holds
    no more of its extent."""
    held = _largest_elements(spec)
    pending = tuple(a for a, p in enumerate(spec.placements) if isinstance(p, Partial))
    for operand in operands:
        for t in operand if isinstance(operand, (tuple, list)) else (operand,):
            source = getattr(t, "_spec", None)
            if (
                source is not None
                and any(a in pending for s in source.shardings for a in s.axes)
                and math.prod(source.shape) > 0
                and held > _largest_elements(source)
                and held >= _largest_elements(source, gathered_over=pending)
            ):
                return source
    return None


def _within_a_parameter(spec: ShardTensorSpec) -> bool:
    """Whether ``spec``, a pending result made in a backward, holds on each rank no more than
    a replicated tensor every rank holds whole anyway: a leaf whose gradient the running
    autograd node returns, through a chain of one-input nodes (``W.t()``, a promotion), or a
    forward input the node saved (NOTE [Gathers an op was not asked to make])."""
    node = _current_autograd_node()
    if node is None:
        return False
    held = _largest_elements(spec)
    return any(
        _is_replicated(t) and t.numel() >= held
        for t in itertools.chain(_leaves_fed(node), _saved(node))
    )


def _saved(node: object) -> Iterator[torch.Tensor]:
    """The tensors ``node`` saved in the forward (``_saved_self``, ``_saved_mat2``, ...)."""
    for name in dir(node):
        if name.startswith("_saved_"):
            try:
                value = getattr(node, name)
            except RuntimeError:  # freed, or not a tensor's slot
                continue
            if isinstance(value, torch.Tensor):
                yield value


def _leaves_fed(node: object, depth: int = 4) -> Iterator[torch.Tensor]:
    """The leaves whose gradients ``node`` returns, directly or through one-input nodes."""
    for fn, _ in node.next_functions:
        for _ in range(depth):
            if fn is None or hasattr(fn, "variable"):
                break
            following = [f for f, _ in fn.next_functions if f is not None]
            fn = following[0] if len(following) == 1 else None
        if fn is not None and hasattr(fn, "variable"):
            yield fn.variable


def _is_replicated(t: torch.Tensor) -> bool:
    spec = getattr(t, "_spec", None)
    return spec is None or all(isinstance(p, Replicate) for p in spec.placements)


def may_gather_blocks(
    operands: Sequence[tuple[ShardTensorSpec, int]], what: str, nbytes: int
) -> bool:
    """Whether an automatic exchange (attention's keys and values, a product's moving
    operand: NOTE [Ring or all-gather] in ``_ops/_ring``) may all-gather ``operands``, each
    a spec and the dim it is sharded along, ``nbytes`` of them per rank once gathered: not
    under ``"error"``, where the ring runs instead; otherwise yes, reported as any gather."""
    policy = _POLICY[0]
    if policy == "error":
        return False
    if policy == "warn" or _RECORDERS:
        spec, dim = operands[0]
        before = sum(_largest_shard(o) for o, _ in operands)
        total = sum(_bytes_of(o) for o, _ in operands)
        _enforce(_THREAD.ops, what, spec, _whole_along(spec, dim), total, before, nbytes)
    return True


@cached("gathered layouts", 1024)
def _whole_along(spec: ShardTensorSpec, dim: int) -> ShardTensorSpec:
    """``spec`` with ``dim`` whole on every rank, its other shardings kept."""
    axes = spec.sharding_by_dim[dim].axes
    placements = [Replicate() if a in axes else p for a, p in enumerate(spec.placements)]
    kept = [s for s in spec.shardings if s.dim != dim]
    return ShardTensorSpec.build(
        spec.mesh,
        placements,
        spec.shape,
        spec.dtype,
        {s.dim: s.sizes for s in kept},
        order={s.dim: s.axes for s in kept},
    )


def _enforce(
    ops: list[object],
    what: str,
    src: ShardTensorSpec,
    dst: ShardTensorSpec,
    total: int,
    before: int,
    after: int,
) -> None:
    """Report a gather to the recorders and apply the policy to it. Under ``"warn"`` with no
    recorder, a gather already said at this call site costs the op's name and a walk to the
    call site: not the report's module path, which searches every running module's children
    (a step repeats the same gathers, e.g. attention's under the default policy)."""
    frame = sys._getframe()
    named = [o for o in ops if o is not _ASKED]
    op = _op_name(named[-1]) if named else "an op"
    call_site = _call_site(frame)
    policy = _POLICY[0]
    if policy == "warn" and not _RECORDERS and (op, call_site) in _WARNED:
        return
    within = _op_name(named[0]) if len(named) > 1 and named[0] is not named[-1] else None
    node = _current_autograd_node()
    gather = Gather(
        op,
        within,
        _module_path(frame),
        None if node is None else node.name(),
        call_site,
        what,
        src,
        dst,
        total,
        after,
        before,
    )
    _record(gather)
    if policy == "error":
        raise GatherError(gather.message(refused=True))
    if policy == "warn":
        _warn_once(gather)


def _record(gather: Gather) -> None:
    # Tapped by the dry run's observer (NOTE [How a dry run observes the library]).
    for recorder in _RECORDERS:
        recorder.append(gather)


# (op, call site) pairs warned about: finite (ops times source lines), so unbounded.
_WARNED: set[tuple[str, str | None]] = set()


def _warn_once(gather: Gather) -> None:
    key = (gather.op, gather.call_site)
    if key in _WARNED:
        return
    _WARNED.add(key)
    message = gather.message(refused=False)
    if gather.call_site is None:
        warnings.warn(message, GatherWarning, stacklevel=2)
        return
    filename, _, line = gather.call_site.rpartition(":")
    warnings.warn_explicit(message, GatherWarning, filename, int(line))


def forget_warnings() -> None:
    """Warn again about every (op, call site): for tests."""
    _WARNED.clear()


# ---------------------------------------------------------------------------- sizes
def gathers(src: ShardTensorSpec, dst: ShardTensorSpec) -> bool:
    """Whether moving a tensor from layout ``src`` to ``dst`` gathers it: fewer pieces after,
    and elements to hold (views of empty tensors replicate them, moving nothing)."""
    return _pieces(dst) < _pieces(src) and math.prod(src.shape) > 0


def reduces_whole_pending_sum(src: ShardTensorSpec, dst: ShardTensorSpec) -> bool:
    """Whether moving a tensor from ``src`` to ``dst`` reduces a pending sum that each rank
    holds whole along a dim the target splits: a mesh axis Partial in ``src`` shards a dim
    in ``dst`` (a reduce-scatter), and the most loaded rank holds more before than after (not
    so where one rank's target shard is the whole extent anyway)."""
    return any(
        isinstance(p, Partial) and isinstance(q, Shard)
        for p, q in zip(src.placements, dst.placements)
    ) and _largest_shard(src) > _largest_shard(dst)


def _pieces(spec: ShardTensorSpec) -> int:
    """How many pieces the mesh splits the tensor into."""
    return math.prod(len(s.sizes) for s in spec.shardings)


def _largest_shard(spec: ShardTensorSpec, gathered_over: tuple[int, ...] = ()) -> int:
    """Bytes of the largest shard of ``spec`` on any rank (:func:`_largest_elements`)."""
    return _largest_elements(spec, gathered_over) * spec.dtype.itemsize


@cached("largest shards", 4096)
def _largest_elements(spec: ShardTensorSpec, gathered_over: tuple[int, ...] = ()) -> int:
    """Elements of the largest shard of ``spec`` on any rank (a mesh axis shards at most one
    dim, so the largest extents of different dims meet on one rank); with a dim whole where
    one of the mesh axes ``gathered_over`` shards it. Cached per layout: every op with a
    pending result asks (``check_result``)."""
    elements = 1
    for dim, extent in enumerate(spec.shape):
        sharding = spec.sharding_by_dim.get(dim)
        whole = sharding is None or any(a in gathered_over for a in sharding.axes)
        elements *= extent if whole else max(sharding.sizes)
    return elements


def _bytes_of(spec: ShardTensorSpec) -> int:
    return math.prod(spec.shape) * spec.dtype.itemsize


# ---------------------------------------------------------------------------- where
# Where a user finds the torch functions that have function handlers, by their public names
# (``F.scaled_dot_product_attention`` is defined in torch._C._nn, ``torch.fft.rfftn`` is named
# ``fft_rfftn`` there); filled on the first gather reported.
_NAMESPACES = {
    "torch.nn.functional": torch.nn.functional,
    "torch": torch,
    "torch.Tensor": torch.Tensor,
    "torch.fft": torch.fft,
    "torch.linalg": torch.linalg,
    "torch.special": torch.special,
}
_PUBLIC_NAMES: dict[object, str] = {}


def _op_name(op: object) -> str:
    if isinstance(op, str):
        return op
    if isinstance(op, OpOverload):
        return str(op)
    if not _PUBLIC_NAMES:
        for prefix, namespace in reversed(_NAMESPACES.items()):
            for name in dir(namespace) if namespace is torch.Tensor else vars(namespace):
                value = getattr(namespace, name)
                if callable(value) and (not name.startswith("_") or name.startswith("__")):
                    with contextlib.suppress(TypeError):  # unhashable
                        _PUBLIC_NAMES[value] = f"{prefix}.{name}"
    try:
        return _PUBLIC_NAMES[op]
    except (KeyError, TypeError):
        return f"{getattr(op, '__module__', None) or '?'}.{getattr(op, '__qualname__', op)}"


_CALL_IMPL = Module_call_impl.__code__


def _module_path(frame: FrameType | None) -> str | None:
    """The modules whose forward is running, outermost first, as a dotted path of their
    names in their parents, ending with the innermost's class."""
    modules: list[nn.Module] = []
    while frame is not None:
        if frame.f_code is _CALL_IMPL:
            module = frame.f_locals.get("self")
            if isinstance(module, nn.Module):
                modules.append(module)
        frame = frame.f_back
    if not modules:
        return None
    modules.reverse()
    names = [type(modules[0]).__name__]
    for parent, child in itertools.pairwise(modules):
        name = next((n for n, m in parent.named_modules() if m is child and n), None)
        names.append(name or f"<{type(child).__name__}>")
    return f"{'.'.join(names)} ({type(modules[-1]).__name__})"


_TORCH_DIR = os.path.realpath(os.path.dirname(torch.__file__)) + os.sep
_SHARDSCI_DIR = os.path.realpath(os.path.join(os.path.dirname(__file__), os.pardir)) + os.sep
# The zoo is model code written for one device, like a user's (installed as shardsci.models).
_ZOO_DIR = os.path.join(_SHARDSCI_DIR, "models") + os.sep
_LIBRARY_FILE: dict[str, bool] = {}


def _in_library(filename: str) -> bool:
    known = _LIBRARY_FILE.get(filename)
    if known is None:
        path = os.path.realpath(filename)
        known = path.startswith(_TORCH_DIR) or (
            path.startswith(_SHARDSCI_DIR) and not path.startswith(_ZOO_DIR)
        )
        _LIBRARY_FILE[filename] = known
    return known


def _call_site(frame: FrameType | None) -> str | None:
    """``"path:line"`` of the innermost frame outside torch and shardsci's library, the path
    relative to the working directory when under it."""
    while frame is not None and _in_library(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return None
    return f"{_shown_path(frame.f_code.co_filename, os.getcwd())}:{frame.f_lineno}"


@cached("call site paths", 1024)
def _shown_path(filename: str, cwd: str) -> str:
    """A source file's real path, relative to the working directory ``cwd`` when under it
    (resolved once per file and directory: ``realpath`` asks the file system)."""
    path = os.path.realpath(filename)
    relative = os.path.relpath(path, cwd)
    return path if relative.startswith(os.pardir) else relative


# ---------------------------------------------------------------------------- text
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _layout(spec: ShardTensorSpec) -> str:
    placements = "(" + "".join(f"{_placement(p)}, " for p in spec.placements)[:-2]
    placements += ",)" if len(spec.placements) == 1 else ")"
    sizes = "; ".join(
        f"dim {s.dim} in {'/'.join(map(str, s.sizes))}" for s in spec.shardings if len(s.sizes) > 1
    )
    return f"{placements} [{sizes}]" if sizes else placements


def _placement(placement: object) -> str:
    return f"Shard({placement.dim})" if isinstance(placement, Shard) else repr(placement)


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
