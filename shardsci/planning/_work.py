"""What a step asks of its device and its host: FLOPs and aten ops, counted as they run.

Counted below ShardTensor: its handlers run on local shards, so the ops seen here are each
rank's own (a convolution of a quarter of the field counts a quarter of the FLOPs), the halo
exchange's and the shape probes' included. FLOPs follow ``torch.utils.flop_counter``'s
formulas (matmuls, convolutions, attention), plus two it lacks: the fused CPU attention kernel,
counted as torch counts the GPU's, and FFTs, counted apart (``fft_flops``) because a device
runs them at a rate of their own (NOTE [FFT FLOPs are counted apart]); matmuls of complex
tensors (an FNO's spectral contraction) are counted apart too (``complex_matmul_flops``, NOTE
[Complex matmuls are counted apart]). Elementwise ops count no FLOPs; every op's memory
traffic is counted (``memory_bytes``), and that of the ops without FLOPs apart
(``flop_free_bytes``, NOTE [Kernels without FLOPs]). Everything is read from shapes, so it
works on ``meta`` tensors in a dry run as on real ones. A shape probe (NOTE [Shape probes
hold no memory]) is an op but no work: it runs torch's meta function on a stand-in of the
whole field's shape, never a kernel, so its FLOPs are not counted (counted, they grew a split
FNO's FFT FLOPs per rank with its ranks: 1.2x on 2 ranks of a domain, 1.9x on 8). Nor is an
op dispatched on ShardTensors work: ShardTensor runs it as ops on local shards, counted as
they run (NOTE [Work on local shards]).

# NOTE [Work on local shards]
A dispatch mode is off inside its own ``__torch_dispatch__``: a mode that passed an op on
ShardTensors on (``func(*args)``) saw none of the local kernels ShardTensor ran for it. So on
the fast and propagation paths (and in aten handlers) ``WorkCounter`` counted no FLOPs or
bytes (``x + x``, GELU and ``mean`` of a ``(1, 4, 64, 64)`` field: 393,232 bytes on the plain
tensor, 0 on a 1-rank ShardTensor), unless a mode below it happened to hand the op back (the
traffic counter of a test does; the dry run entered ``WorkCounter`` last, above them), and a
domain-split candidate of ``parallel=auto`` lacked work a data-parallel one counted. Every
other mode here returns ``NotImplemented`` for such an op, so that torch runs ShardTensor's
``__torch_dispatch__`` with it on; ``WorkCounter`` runs that ``__torch_dispatch__`` itself with
the mode pushed again (the modes below it hand the op on alike), so every kernel on a plain
tensor is counted once, wherever it is dispatched from (a function handler's at the top, an
aten handler's or a path's inside the op); an op on ShardTensors never is. Nor do ops
on fake tensors (DTensor's sharding propagation) or a plan's checks of local shapes on
``meta`` stand-ins (shape probes, NOTE [Shape probes hold no memory]) count work. The ops
inside a ShardTensor op are work but not ``ops``: ``ops`` and
``communication_ops`` count what the step dispatches at the top, the figure
``host_us_per_op`` was measured against (NOTE [One price per op] in ``_machine``).

# NOTE [FFT FLOPs are counted apart]
A complex transform of ``n`` points costs ``5 n log2 n`` FLOPs (the radix-2 count every FFT
library quotes), a real one (``r2c``, ``c2r``) half of that; a multi-dimensional transform of
``n = n_1 ... n_k`` points per batch costs the same as one of length ``n``. torch's flop
counter has no formula for FFTs, so an FNO's spectral layers counted nothing, and on this
machine its step's kernels took 4x the projected compute. An FFT is also not a GEMM: CPU
libraries run it several times below the convolutions' rate, and cuFFT is bound by memory
bandwidth, so the ``Machine`` prices ``fft_flops`` at ``fft_flops_per_s``, not at
``sustained_flops``.

# NOTE [Complex matmuls are counted apart]
The FNO's spectral contraction (``einsum`` of the retained modes with a complex weight: a
complex ``bmm``, one small matrix product per mode) is a matmul to torch's flop counter, but
no device runs it at a GEMM's rate: on this machine's CPU it ran at 0.42 GFLOP/s against 28
for the same step's 1x1 convolutions
(``benchmarks/records/2026-11-29-cost-model/fno_kernels_0640.jsonl``), a copy per mode;
on a GPU its small per-mode products read each mode's weight once, bound by memory.
So the FLOPs of every matmul-family call with a complex operand are counted in
``complex_matmul_flops`` (at torch's formula, ``2 m n k`` per product: the count the rates
were measured at), not in ``flops``, and the ``Machine`` prices them at
``complex_matmul_flops_per_s``.

# NOTE [Kernels without FLOPs]
A step's kernels run one after another, each bound by its FLOPs or by its bytes (a roofline
per kernel), so the step's compute is the sum over kernels of the longer of the two, not the
longer of the step's two sums: that hides every kernel that counts no FLOPs (GELU and its
backward, the residual adds, the FFTs' pads and copies, zeros) under the FLOP-bound ones. The
FNO's plain step at 128² on one core (2026-11-29 09:12 UTC, load 5.5; each aten op's thread
CPU time): 25 ms of its 96 in kernels that count no FLOPs, 300 MB of traffic, priced at 0
while its FLOP time (43 ms) exceeded its whole traffic's (24 ms). So ``WorkCounter`` counts
the bytes every non-view op reads and writes (``memory_bytes``: kernels unfused; an
alias torch does not mark a view, ``ALIASES``, moves none) and of those
the ops ``counts_flops`` rejects apart (``flop_free_bytes``); a collective's buffers are not
memory traffic (its bytes are its communication's). ``_machine.compute_s`` prices them, for the
dry run's ``parallel=auto`` and ``benchmarks/cost_model.py`` alike: the flop-free bytes at
``memory_bytes_per_s`` added to the longer of the FLOPs' time and the rest of the traffic's.
On an H100 the FNO's compute, bound by its traffic, barely moves (its FLOP-bound kernels'
bytes still take longer than their FLOPs).
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from shardsci.tensor import ShardTensor
from shardsci.tensor._dispatch import tally_paths
from shardsci.tensor._registry import function_handler_for
from shardsci.tensor._shape_probe import probing
from shardsci.tensor._torch_compat import (
    TorchDispatchMode,
    _pop_mode,
    _push_mode,
    is_fake,
    tree_leaves,
)

__all__ = [
    "ALIASES",
    "COMMUNICATION_MODULES",
    "COPIES",
    "FLOP_FREE_FAMILIES",
    "MATMULS",
    "WorkCounter",
    "contiguous_runs",
    "counts_flops",
    "fft_flops",
    "flop_free_family",
]

COMMUNICATION_MODULES = frozenset(
    f"shardsci.tensor.{name}"
    for name in (
        "_box_packing",
        "_collectives",
        "_gather_plan",
        "_halo",
        "_intervals",
        "_layout_inference",
        "_redistribute",
        "_scatter",
    )
)
"""The modules that move pieces between ranks: the ops they dispatch (slicing, packing and
unpacking each peer's piece, halos) are communication ops (NOTE [One price per op])."""

aten = torch.ops.aten

# NOTE [Strided copies]
# A copy that reads or writes a tensor whose elements are not one contiguous block moves it
# run by run: a piece of a ``(B, C, H, W)`` field narrowed along W (a W split's pack, unpack
# and concatenation) is ``B C H`` runs of ``W / n`` elements, the same bytes narrowed along H
# ``B C`` runs of ``H W / n``. On this machine a run costs a few ns more than its bytes
# (``benchmarks.calibrate``: the same bytes copied from a W-narrowed and an H-narrowed
# piece), so ``WorkCounter`` counts the runs of every copy's non-contiguous tensors
# (``strided_runs``), and both projections price them at ``Machine.strided_copy_s_per_run``
# as compute (``strided_copy_s``).
COPIES = frozenset({aten.copy_, aten.clone, aten.cat, aten.stack, aten._to_copy})
"""The aten ops that copy: those whose strided tensors count runs (NOTE [Strided copies])."""


COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional"})
"""The aten namespaces of collectives: their buffers are communication, not memory traffic
(NOTE [Kernels without FLOPs])."""


ALIASES = frozenset({aten._unsafe_view.default})
"""Aten ops that return an alias of their input though torch does not mark them views
(``is_view`` is False): they move no bytes (``aten._unsafe_view``: a matmul's result reshaped,
67.5 MB a Transolver step at 128² counted as traffic for 0.4 ms measured,
``benchmarks/records/2026-11-30-flop-free-families``)."""


MATMULS = frozenset({aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.matmul})
"""The matmul-family aten ops whose complex calls are counted apart (NOTE [Complex matmuls are
counted apart])."""


# NOTE [Kernels without FLOPs by family]
# One bandwidth does not price a step's kernels without FLOPs: inside the Transolver's plain step
# at 128² on this machine (``benchmarks/records/2026-11-30-flop-free-families``, one thread,
# each op's own thread CPU time) strided pointwise ops ran at 3.9 GB/s, reductions and
# normalizations 4.7, broadcasting pointwise 7.3, contiguous pointwise 9.5 and copies 7.9
# (``_unsafe_view`` left out, ``ALIASES``), and priced at one rate the step's flop-free time came
# out at 0.37 of measured. So ``WorkCounter`` counts the flop-free bytes by family
# (``flop_free_family``, the record's classification), and ``compute_s`` prices each family at
# its ``Machine`` rate (``FLOP_FREE_FAMILIES`` names the fields). A family is read from the op
# and its tensors' shapes and strides only, so it works on ``meta`` tensors.
FLOP_FREE_FAMILIES = (
    "pointwise_contiguous",
    "pointwise_broadcast",
    "pointwise_strided",
    "reduction",
    "copy",
)
"""The families of kernels without FLOPs, each priced at its own rate (NOTE [Kernels without
FLOPs by family]); ``Machine`` has a ``<family>_bytes_per_s`` field for each."""

REDUCTIONS = frozenset(
    getattr(aten, name)
    for name in (
        "sum", "mean", "amax", "amin", "max", "min", "var", "std", "var_mean", "norm",
        "native_layer_norm", "native_layer_norm_backward", "native_group_norm",
        "native_group_norm_backward", "native_batch_norm", "native_batch_norm_backward",
        "_softmax", "_softmax_backward_data", "_log_softmax", "_log_softmax_backward_data",
        "logsumexp",
    )
)  # fmt: skip
"""Reductions and normalizations: the ``reduction`` family."""

INDEXING = frozenset(
    getattr(aten, name)
    for name in (
        "index", "index_select", "gather", "scatter", "scatter_add", "index_add", "index_put",
        "slice_backward", "select_backward",
    )
)  # fmt: skip
"""Ops that move elements to other places (indexing, scatters, a view's backward): with
``COPIES``, the ``copy`` family."""


def flop_free_family(func: Any, args: Any, out: Any) -> str:
    """The family of a kernel without FLOPs (``FLOP_FREE_FAMILIES``, NOTE [Kernels without
    FLOPs by family]): ``copy`` (``COPIES``, ``INDEXING``), ``reduction`` (``REDUCTIONS``),
    else a pointwise op: ``pointwise_broadcast`` where an input has fewer elements than the
    largest output, ``pointwise_strided`` where a tensor is not contiguous, else
    ``pointwise_contiguous``."""
    packet = func._overloadpacket
    if packet in COPIES or packet in INDEXING:
        return "copy"
    if packet in REDUCTIONS:
        return "reduction"
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    ins = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
    largest = max((t.numel() for t in outs), default=0)
    if any(t.numel() < largest for t in ins):
        return "pointwise_broadcast"
    if any(not t.is_contiguous() for t in ins + outs):
        return "pointwise_strided"
    return "pointwise_contiguous"


def _complex_operand(args: tuple) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_complex() for t in tree_leaves(args))


def contiguous_runs(tensor: torch.Tensor) -> int:
    """Runs of consecutive elements in memory that ``tensor`` is made of: 1 for a contiguous
    tensor (0 for an empty one), ``B C H`` for a ``(B, C, H, W)`` one narrowed along W."""
    if tensor.numel() == 0:
        return 0
    run = 1
    for size, stride in zip(reversed(tensor.shape), reversed(tensor.stride())):
        if size == 1:
            continue
        if stride != run:
            break
        run *= size
    return tensor.numel() // run


def _transformed_points(shape: torch.Size, dims: list[int]) -> int:
    return math.prod(shape[d] for d in dims)


FFTS = frozenset({aten._fft_c2c, aten._fft_r2c, aten._fft_c2r})
"""The aten FFTs, whose FLOPs are counted apart (NOTE [FFT FLOPs are counted apart])."""


def fft_flops(func: Any, args: tuple, out: Any) -> float:
    """FLOPs of one aten FFT call (NOTE [FFT FLOPs are counted apart]); 0 for any other op."""
    packet = func._overloadpacket
    if packet is aten._fft_c2c:
        x, dims = args[0], args[1]
        return 5.0 * x.numel() * math.log2(max(_transformed_points(x.shape, dims), 1))
    if packet is aten._fft_r2c:
        x, dims = args[0], args[1]
        return 2.5 * x.numel() * math.log2(max(_transformed_points(x.shape, dims), 1))
    if packet is aten._fft_c2r:
        dims = args[1]
        return 2.5 * out.numel() * math.log2(max(_transformed_points(out.shape, dims), 1))
    return 0.0


def _cpu_attention_flops(query, key, value, *args, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_attention_backward_flops(grad_out, query, key, value, *args, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


_FORMULAS: dict[Any, Callable[..., int]] = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward_flops,
}


def counts_flops(func: Any) -> bool:
    """Whether ``WorkCounter`` counts FLOPs of the aten op ``func`` (a formula of torch's flop
    counter or of ours, or an FFT): elementwise ops, copies and pads count none."""
    packet = func._overloadpacket
    return packet in _FORMULAS or packet in flop_registry or packet in FFTS


class WorkCounter(TorchDispatchMode):
    """While active, count the aten ops dispatched (``ops``), those of them dispatched by a
    communication module (``communication_ops``, NOTE [One price per op] in ``_machine``),
    their FLOPs (``flops``), their FFTs' FLOPs (``fft_flops``, not in ``flops``), their
    complex matmuls' FLOPs (``complex_matmul_flops``, not in ``flops``, NOTE [Complex matmuls
    are counted apart]), the bytes its non-view ops read and write and those of them without
    FLOPs (``memory_bytes``, ``flop_free_bytes``, NOTE [Kernels without FLOPs]; the latter by
    family in ``flop_free_bytes_by_family``, NOTE [Kernels without FLOPs by family]) and the
    runs of the strided tensors their copies read and write
    (``strided_runs``, NOTE [Strided copies]); a shape probe's are no work. And the aten ops
    on ShardTensors by the dispatch path they took (``path_ops``: ``fast``, ``propagation``,
    ``handler``; nested ones included, NOTE [Dispatch paths]) and the calls of function
    handlers (``function_calls``): what a ShardTensor op costs the host depends on them (NOTE
    [Host time by dispatch path] in ``benchmarks/calibrate_dispatch.py``)."""

    def __init__(self) -> None:
        super().__init__()
        self.path_ops: Counter[str] = Counter()
        self._function_calls = _FunctionHandlerCalls()
        self._paths = ExitStack()
        self.ops = 0
        self.communication_ops = 0
        self.flops = 0
        self.fft_flops = 0
        self.complex_matmul_flops = 0
        self.strided_runs = 0
        self.memory_bytes = 0
        self.flop_free_bytes = 0
        self.flop_free_bytes_by_family: Counter[str] = Counter()
        self._inside_shard_tensor_ops = 0

    @property
    def function_calls(self) -> int:
        """Calls of torch functions with a registered function handler on ShardTensors, the
        outermost ones (a handler's own calls are inside its cost)."""
        return self._function_calls.calls

    @property
    def dispatch_calls(self) -> dict[str, int]:
        """The ShardTensor calls by the way they took (``DISPATCH_PATHS`` in ``_machine``):
        ``path_ops`` and, as ``function``, ``function_calls``; what ``ops_host_s`` prices
        (NOTE [Host time by dispatch path])."""
        return {**self.path_ops, "function": self.function_calls}

    def __enter__(self) -> WorkCounter:
        self.path_ops = self._paths.enter_context(tally_paths()).ops
        self._paths.enter_context(self._function_calls)
        return super().__enter__()

    def __exit__(self, *exc_info: object) -> None:
        try:
            super().__exit__(*exc_info)
        finally:
            self._paths.close()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:  # type: ignore[override]
        kwargs = kwargs or {}
        if not self._inside_shard_tensor_ops:
            self.ops += 1
            if _called_from(COMMUNICATION_MODULES):
                self.communication_ops += 1
        if _on_shard_tensors((args, kwargs)):
            return self._on_local_shards(func, types, args, kwargs)
        out = func(*args, **kwargs)
        if probing() or _on_fake_tensors((args, kwargs, out)):
            return out
        self._count_traffic(func, args, kwargs, out)
        packet = func._overloadpacket
        if packet in COPIES:
            self.strided_runs += _strided_runs((args, kwargs, out))
        formula = _FORMULAS.get(packet) or flop_registry.get(packet)
        if formula is not None:
            flops = int(formula(*args, **kwargs, out_val=out))
            if packet in MATMULS and _complex_operand(args):
                self.complex_matmul_flops += flops
            else:
                self.flops += flops
        else:
            self.fft_flops += int(fft_flops(func, args, out))
        return out

    def _on_local_shards(self, func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
        """Run an op on ShardTensors with this mode on (NOTE [Work on local shards])."""
        self._inside_shard_tensor_ops += 1
        _push_mode(self)
        try:
            return ShardTensor.__torch_dispatch__(func, types, args, kwargs)
        finally:
            _pop_mode()
            self._inside_shard_tensor_ops -= 1

    def _count_traffic(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if func.is_view or func in ALIASES or func.namespace in COLLECTIVE_NAMESPACES:
            return
        tensors = tree_leaves((args, kwargs, out))
        moved = sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))
        self.memory_bytes += moved
        if not counts_flops(func):
            self.flop_free_bytes += moved
            self.flop_free_bytes_by_family[flop_free_family(func, (args, kwargs), out)] += moved


class _FunctionHandlerCalls(TorchFunctionMode):
    """While active, count the calls of torch functions on ShardTensors that have a registered
    function handler (``calls``); not those made inside one (a mode is off in its own
    ``__torch_function__``)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None) -> Any:  # type: ignore[override]
        kwargs = kwargs or {}
        if function_handler_for(func) is not None and _on_shard_tensors((args, kwargs)):
            self.calls += 1
        return func(*args, **kwargs)


def _on_shard_tensors(arguments: Any) -> bool:
    """Whether an op is dispatched on ShardTensors: an op but no kernel, as ShardTensor runs it
    as ops on local shards, which are counted (counted at both levels, an elementwise op's
    bytes were those of its whole field and of its shard again: 1.2 GB of traffic without
    FLOPs a rank in the FNO's step at 64² on slabs of 8 ranks, 0.45 on 8 replicas)."""
    return any(isinstance(t, ShardTensor) for t in tree_leaves(arguments))


def _on_fake_tensors(tensors: Any) -> bool:
    """Whether an op runs on (or makes) fake tensors: DTensor's sharding propagation learning
    an output's metadata inside a ShardTensor op, no kernel (NOTE [Work on local shards])."""
    return any(isinstance(t, torch.Tensor) and is_fake(t) for t in tree_leaves(tensors))


def _strided_runs(tensors: Any) -> int:
    runs = (contiguous_runs(t) for t in tree_leaves(tensors) if isinstance(t, torch.Tensor))
    return sum(r for r in runs if r > 1)


def _called_from(modules: frozenset[str]) -> bool:
    """Whether a function of one of ``modules`` is on the calling Python stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") in modules:
            return True
        frame = frame.f_back
    return False
