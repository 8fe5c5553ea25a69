"""Where a 2-rank UNet layer's time goes: the calling thread's CPU, its waiting, and gloo's own
cost for the same messages (issue 21, item 1: the 2-rank UNet step's group norms and circular
pads).

# NOTE [Our CPU and the collective's wait]
Every rank of two runs, on its ``(1, C, T, T)`` shard of a field split along H (the UNet's
first level: 16 channels, a 16² tile), one call at a time, the ops in turn every round:

- ``group_norm``: ``F.group_norm`` with 4 groups and affine parameters, and its backward: one
  all-gather of the statistics forward, one all-reduce of the two row sums backward (NOTE
  [Normalisation statistics across shards]);
- ``circular_pad``: ``F.pad(x, (1, 1, 1, 1), mode="circular")``, the pad of a periodic 3x3
  convolution, and its backward: one halo message each way forward and backward;
- gloo's own calls of the same bytes, on plain tensors: ``all_gather`` of the 32 bytes of
  statistics, ``all_reduce`` of 64, and the circular pad's 2 KiB exchange posted as
  ``isend`` + ``irecv`` (how the library posts it) and as one ``all_to_all_single``.

Per call, medians over ``--rounds`` rounds of ``--calls`` calls, rank by rank: ``wall_us``,
``cpu_us`` (the calling thread's CPU, ``time.thread_time``) and ``waiting_us`` (wall less
that CPU: blocked in a collective, or not scheduled). Ours beyond the collective is an op's
CPU less the raw call's CPU; its wait is to be read against the raw call's wall. On this
shared 2-core machine waits are mostly scheduling: state the load (the summary does).

Run ``python -m benchmarks.call_waiting [--rounds 30] [--calls 10] [--channels 16]
[--tile 16]``; JSON lines: ``call`` per rank and call kind, then ``summary``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks._common import emit, emit_summary, on_ranks, parse_arguments, rank_pools
from shardsci import Shard, ShardTensor
from shardsci.tensor._torch_compat import all_gather_single
from shardsci.testing import get_mesh

GROUPS = 4


def _op_calls(channels: int, tile: int) -> dict[str, Callable[[], None]]:
    """The sharded ops' forward and backward calls, each a function of no arguments."""
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(rank)
    shard = torch.randn(1, channels, tile, tile, generator=generator, requires_grad=True)
    weight = torch.randn(channels, generator=generator, requires_grad=True)
    bias = torch.randn(channels, generator=generator, requires_grad=True)
    x = ShardTensor.from_local(shard, get_mesh((2,)), [Shard(2)], {0: (tile, tile)})
    ops = {
        "group_norm": lambda: F.group_norm(x, GROUPS, weight, bias),
        "circular_pad": lambda: F.pad(x, (1, 1, 1, 1), mode="circular"),
    }
    calls: dict[str, Callable[[], None]] = {}
    for name, op in ops.items():
        held: list[torch.Tensor] = []

        def forward(op: Callable = op, held: list = held) -> None:
            held[:] = [op().to_local()]

        def backward(held: list = held) -> None:
            out = held.pop()
            out.backward(torch.ones_like(out))

        calls[f"{name} forward"] = forward
        calls[f"{name} backward"] = backward
    return calls


def _raw_calls(channels: int, tile: int) -> dict[str, Callable[[], None]]:
    """gloo's own calls of the ops' bytes (NOTE above), on plain tensors."""
    peer = 1 - dist.get_rank()
    statistics_ = torch.randn(2 * GROUPS)
    gathered = torch.empty(2 * statistics_.numel())
    halo, received = torch.randn(2 * channels * tile), torch.empty(2 * channels * tile)
    splits = [0, halo.numel()] if peer else [halo.numel(), 0]

    def point_to_point() -> None:
        for work in (dist.isend(halo, peer), dist.irecv(received, peer)):
            work.wait()

    return {
        "raw all_gather 32 B": lambda: all_gather_single()(gathered, statistics_),
        "raw all_reduce 64 B": lambda: dist.all_reduce(gathered.clone()),
        "raw isend+irecv 2 KiB": point_to_point,
        "raw all_to_all_single 2 KiB": lambda: dist.all_to_all_single(
            received, halo, splits, splits
        ),
    }


def measure(rounds: int, calls: int, channels: int, tile: int) -> dict[str, dict[str, float]]:
    """Rank body: per call kind, the medians of wall, thread CPU and waiting, in µs."""
    torch.set_num_threads(1)
    kinds = _op_calls(channels, tile) | _raw_calls(channels, tile)
    ops = [k for k in kinds if not k.startswith("raw")]
    for _ in range(3):  # plans, caches, gloo's pairs
        for fn in kinds.values():
            fn()
    walls: dict[str, list[float]] = {k: [] for k in kinds}
    cpus: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(rounds):
        for kind, fn in kinds.items():
            if kind.endswith("backward"):
                continue
            dist.barrier()
            for _ in range(calls):
                wall, cpu = time.perf_counter(), time.thread_time()
                fn()
                walls[kind].append(time.perf_counter() - wall)
                cpus[kind].append(time.thread_time() - cpu)
                if kind in ops:  # its backward, timed alike
                    after = kind.replace("forward", "backward")
                    wall, cpu = time.perf_counter(), time.thread_time()
                    kinds[after]()
                    walls[after].append(time.perf_counter() - wall)
                    cpus[after].append(time.thread_time() - cpu)
    return {
        kind: {
            "wall_us": round(statistics.median(walls[kind]) * 1e6, 1),
            "cpu_us": round(statistics.median(cpus[kind]) * 1e6, 1),
            "waiting_us": round(
                statistics.median(w - c for w, c in zip(walls[kind], cpus[kind])) * 1e6, 1
            ),
        }
        for kind in kinds
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=10, help="calls of each kind a round")
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--tile", type=int, default=16, help="H and W of each rank's shard")
    args = parse_arguments(parser, argv)
    with rank_pools():
        per_rank = on_ranks(2, measure, args.rounds, args.calls, args.channels, args.tile)
    for rank, results in enumerate(per_rank):
        for kind, figures in results.items():
            emit("call", rank=rank, kind=kind, **figures)
    emit_summary(
        [],
        args.check,
        rounds=args.rounds,
        calls=args.calls,
        shard=[1, args.channels, args.tile, args.tile],
    )


if __name__ == "__main__":
    main()
