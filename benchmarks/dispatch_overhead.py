"""Per-op dispatch overhead of ShardTensor against DTensor and a plain torch.Tensor.

Every rank times small ops on its own (64, 64) float32 shard, the same ops on a plain tensor,
a DTensor (``Shard(0)``, ``torch.chunk`` sizes) and a ShardTensor of the same layout, plus a
ShardTensor with uneven shards (rows 72/56 on 2 ranks). On 1 rank (a gloo world of one) no
data could ever move, so the difference to the plain tensor is pure dispatch overhead. Timings
are taken side by side in one run (see ``interleaved_medians_us``), with and without autograd
(inputs that require grad, forward only); each figure is the slowest rank's median. A last
record breaks the time of a ShardTensor ``x + y`` down by layer (``time_breakdown``).

Goal: ShardTensor's pointwise ops at most ``GOAL_RATIO`` times DTensor's time. Run ``python -m
benchmarks.dispatch_overhead [--rounds 1000] [--warmup 100] [--check]``; the JSON fields are
listed in README.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, Shard

from benchmarks._common import (
    Goal,
    emit,
    emit_summary,
    interleaved_medians_us,
    on_ranks,
    parse_arguments,
    rank_pools,
)
from shardsci import ShardTensor
from shardsci.tensor import _dispatch
from shardsci.testing import get_mesh

aten = torch.ops.aten

SHARD_SHAPE = (64, 64)
UNEVEN_ROWS = {2: (72, 56)}
GOAL_RATIO = 1.2
OPS = {
    "add": lambda x, y: x + y,
    "mul_scalar": lambda x, y: x * 2.0,
    "relu": lambda x, y: torch.relu(x),
    "sum_dim0": lambda x, y: x.sum(0),
}
FAST_PATH_OPS = ("add", "mul_scalar", "relu")


def _operands(world_size: int, autograd: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Variant -> the pair ``(x, y)`` of this rank, each a leaf requiring grad if ``autograd``.

    Global operands are ``(64 N, 64)``; ranks draw them from the same seed.
    """
    x, y = (_variants(world_size, autograd) for _ in range(2))
    return {variant: (x[variant], y[variant]) for variant in x}


def _variants(world_size: int, autograd: bool) -> dict[str, torch.Tensor]:
    """Variant -> this rank's view of one random global ``(64 N, 64)`` tensor."""
    mesh = get_mesh((world_size,))
    rank = mesh.get_local_rank()
    rows = SHARD_SHAPE[0]
    whole = torch.randn(rows * world_size, SHARD_SHAPE[1])
    local = whole[rank * rows : (rank + 1) * rows].contiguous()
    tensors = {
        "torch": local,
        "dtensor": DTensor.from_local(local, mesh, [Shard(0)]),
        "shardtensor": ShardTensor.from_local(local, mesh, [Shard(0)], "chunk"),
    }
    if world_size in UNEVEN_ROWS:
        sizes = UNEVEN_ROWS[world_size]
        uneven = whole[sum(sizes[:rank]) : sum(sizes[: rank + 1])].contiguous()
        tensors["shardtensor_uneven"] = ShardTensor.from_local(uneven, mesh, [Shard(0)], {0: sizes})
    return {variant: t.detach().requires_grad_(autograd) for variant, t in tensors.items()}


def time_ops(
    world_size: int, autograd: bool, rounds: int, warmup: int
) -> dict[str, dict[str, float]]:
    """Rank body: op -> variant -> median µs per call on this rank, over ``rounds`` rounds
    after ``warmup``."""
    pairs = _operands(world_size, autograd)
    result = {}
    for op_name, op in OPS.items():
        candidates = {variant: _bind(op, *pair) for variant, pair in pairs.items()}
        result[op_name] = interleaved_medians_us(candidates, rounds=rounds, warmup_rounds=warmup)
    return result


def _bind(op: Callable, x: torch.Tensor, y: torch.Tensor) -> Callable[[], torch.Tensor]:
    """``op(x, y)`` as a call of no arguments (one closure per candidate)."""
    return lambda: op(x, y)


def time_breakdown(rounds: int, warmup: int) -> dict[str, float]:
    """Rank body (1 rank): where the time of a ShardTensor ``x + y`` goes, in µs per call.

    Nested entry points are timed apart and their differences give the layers, outermost
    first: ``__torch_function__`` (the call minus the same call with subclass torch functions
    disabled), the C++ dispatcher's call into Python (that minus a direct call of
    ``__torch_dispatch__``), the dispatch preamble (handler lookup, reduction-dim and
    pointwise tests: that minus a direct call of the fast path), and inside the fast path its
    checks (of which the test whether the op writes its first argument, read from the op's
    schema on every call), the wrapper (``_make_wrapper_subclass``) and the local kernel.
    DTensor's total and wrapper construction are given for reference.
    """
    pairs = _operands(1, autograd=False)
    x, y = pairs["shardtensor"]
    dx, dy = pairs["dtensor"]
    local_x, local_y = x._local, y._local
    out = aten.add.Tensor(local_x, local_y)

    def without_torch_function() -> torch.Tensor:
        with torch._C.DisableTorchFunctionSubclass():
            return x + y

    t = interleaved_medians_us(
        {
            "total_us": lambda: x + y,
            "without_torch_function_us": without_torch_function,
            "torch_dispatch_us": lambda: ShardTensor.__torch_dispatch__(
                aten.add.Tensor, (ShardTensor,), (x, y), {}
            ),
            "fast_path_us": lambda: _dispatch._pointwise_fast_path(
                aten.add.Tensor, (x, y), {}, False
            ),
            "wrapper_us": lambda: ShardTensor(out, x._spec),
            "local_kernel_us": lambda: aten.add.Tensor(local_x, local_y),
            "dtensor_total_us": lambda: dx + dy,
            "dtensor_wrapper_us": lambda: DTensor(out, dx._spec, requires_grad=False),
        },
        rounds=rounds,
        warmup_rounds=warmup,
    )
    return {
        **t,
        "torch_function_layer_us": t["total_us"] - t["without_torch_function_us"],
        "cpp_to_python_us": t["without_torch_function_us"] - t["torch_dispatch_us"],
        "dispatch_preamble_us": t["torch_dispatch_us"] - t["fast_path_us"],
        "fast_path_checks_us": t["fast_path_us"] - t["wrapper_us"] - t["local_kernel_us"],
    }


def _report(world_size: int, autograd: bool, rounds: int, warmup: int) -> list[float]:
    """Emit one record per op; return the total-time ratios of the fast-path ops."""
    per_rank = on_ranks(world_size, time_ops, world_size, autograd, rounds, warmup)
    ratios = []
    for op_name in OPS:
        slowest = {
            variant: max(rank[op_name][variant] for rank in per_rank)
            for variant in per_rank[0][op_name]
        }
        overhead = {v: slowest[v] - slowest["torch"] for v in slowest if v != "torch"}
        ratio = slowest["shardtensor"] / slowest["dtensor"]
        if op_name in FAST_PATH_OPS:
            ratios.append(ratio)
        emit(
            "op",
            world_size=world_size,
            autograd=autograd,
            op=op_name,
            path="fast" if op_name in FAST_PATH_OPS else "propagation",
            **{f"{v}_us": round(t, 2) for v, t in slowest.items()},
            **{f"{v}_overhead_us": round(t, 2) for v, t in overhead.items()},
            ratio_shardtensor_to_dtensor=round(ratio, 3),
            ratio_shardtensor_to_dtensor_overhead=round(
                overhead["shardtensor"] / overhead["dtensor"], 3
            ),
        )
    return ratios


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1000, help="timed rounds per figure")
    parser.add_argument("--warmup", type=int, default=100, help="discarded rounds first")
    args = parse_arguments(parser, argv)
    with rank_pools():
        ratios = [
            ratio
            for world_size in (1, 2)
            for autograd in (False, True)
            for ratio in _report(world_size, autograd, args.rounds, args.warmup)
        ]
        (breakdown,) = on_ranks(1, time_breakdown, args.rounds, args.warmup)
    emit("breakdown", op="add", world_size=1, **{k: round(v, 2) for k, v in breakdown.items()})
    worst = max(ratios)
    emit_summary(
        [Goal(f"ShardTensor pointwise op time <= {GOAL_RATIO}x DTensor's", worst <= GOAL_RATIO)],
        args.check,
        worst_ratio_shardtensor_to_dtensor=round(worst, 3),
    )


if __name__ == "__main__":
    main()
