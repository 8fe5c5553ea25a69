"""An exchange every member of a group joins, as point-to-point messages against one
all-to-all on gloo, paired (issue 21: NOTE [An exchange of messages as one all-to-all where
messages are slow]): a halo exchange, or a hop of the ring that carries attention's keys and
values (NOTE [Ring or all-gather]).

Every rank runs, on a domain mesh (``--meshes``: ``2``, ``4``, ``2x2``, ``8``), the same work
two ways in one process, the way switched between rounds (``messages``: each exchange posted
as ``isend``/``irecv`` per neighbour; ``all_to_all``: the same exchange as one
``all_to_all_single`` over the group, zero splits for the non-neighbours), the order
reversed every round (``_common.interleaved_steps``), each step from a barrier:

- ``pad``: ``F.pad(x, (1, 1, 1, 1), mode="circular")`` of a ``(1, 16, T, T)`` shard and its
  backward (one exchange per split dim each way);
- ``ring``: ``F.scaled_dot_product_attention`` of ``(1, 4, P T, 32)`` queries, keys and
  values with their sequence split evenly (``T`` tokens a rank) by the ring
  (``attention_exchange("ring")``), forward and backward (``3 (N - 1)`` hops);
- ``unet``, ``vit``, ``transolver``: a training step (forward, mean-square loss, backward,
  gradients reduced) of ``benchmarks.compile.CASES[work]`` on a ``(1, 1, P_h T, P_w T)``
  field split along H (and W on a 2-D mesh). The ViT's attention takes the ring
  (``attention_exchange("ring")``: at these sizes ``auto`` would all-gather); the
  Transolver's attends among replicated slice tokens and exchanges no halo: a control.

The way is switched by setting ``messages_in_one_collective`` on the axis groups the run made
(the rule's one input); per way, one step's traffic (``count_traffic``): bytes, collectives and
messages, which must show the same bytes. Figures per step: the slowest rank's wall and CPU
(``time.process_time``) seconds, median and spread; ``ratio``: all-to-all over messages,
medians. Run ``python -m benchmarks.halo_collective [--meshes 2 4 2x2]
[--work pad ring unet vit transolver] [--tiles 16 64] [--rounds 5] [--steps 4]``; JSON lines:
``case`` per mesh, work and tile, then ``summary``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks._common import (
    emit,
    emit_summary,
    interleaved_steps,
    on_ranks,
    parse_arguments,
    rank_pools,
    spread,
    timed_steps,
)
from benchmarks.compile import CASES
from shardsci import Shard, ShardTensor, attention_exchange
from shardsci.parallel import domain_parallel
from shardsci.tensor import _collectives
from shardsci.tensor._api import from_local_spec
from shardsci.testing import Layout, count_traffic, get_mesh

WAYS = ("messages", "all_to_all")
WORKS = ("pad", "ring", "unet", "vit", "transolver")
CHANNELS = 16
HEADS, HEAD_WIDTH = 4, 32


def _use(way: str) -> None:
    """Make every axis group made so far exchange halos and ring hops ``way``."""
    for group in list(_collectives._GROUPS._entries.values()):
        object.__setattr__(group, "messages_in_one_collective", way == "all_to_all")


def _ring(shape: tuple[int, ...], tile: int) -> Callable[[], None]:
    """Attention over a sequence of ``tile`` tokens a rank, split over the whole mesh."""
    mesh = get_mesh(shape)
    world = math.prod(shape)
    layout = Layout((Shard(2),) * len(shape), {2: (tile,) * world})
    generator = torch.Generator().manual_seed(0)
    qkv = []
    for _ in range(3):
        whole = torch.randn(1, HEADS, world * tile, HEAD_WIDTH, generator=generator)
        spec = layout.spec(mesh, whole)
        qkv.append(from_local_spec(spec.narrow(whole).contiguous().requires_grad_(True), spec))

    def attend() -> None:
        out = F.scaled_dot_product_attention(*qkv).to_local()
        out.backward(torch.ones_like(out))

    return attend


def _work(name: str, shape: tuple[int, ...], tile: int) -> Callable[[], None]:
    """This rank's step of ``name`` on a domain mesh of ``shape``."""
    torch.manual_seed(0)
    if name == "ring":
        return _ring(shape, tile)
    axes = ("h", "w")[: len(shape)]
    full = get_mesh((1, *shape), ("dp", *axes))
    mesh = full[axes] if len(axes) > 1 else full[axes[0]]
    coordinate = mesh.get_coordinate()
    channels = CHANNELS if name == "pad" else 1
    rows, columns = tile * shape[0], tile * (shape[1] if len(shape) > 1 else 1)
    whole = torch.randn(1, channels, rows, columns, generator=torch.Generator().manual_seed(0))
    local = whole.narrow(2, coordinate[0] * tile, tile)
    placements = [Shard(2)]
    sizes = {0: (tile,) * shape[0]}
    if len(shape) > 1:
        local = local.narrow(3, coordinate[1] * tile, tile)
        placements.append(Shard(3))
        sizes[1] = (tile,) * shape[1]
    x = ShardTensor.from_local(
        local.contiguous().requires_grad_(name == "pad"), mesh, placements, sizes
    )
    if name == "pad":

        def pad() -> None:
            out = F.pad(x, (1, 1, 1, 1), mode="circular").to_local()
            out.backward(torch.ones_like(out))

        return pad
    model = domain_parallel(CASES[name].build(), full, dp_axis="dp", domain_axes=list(axes))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        out = model(x)
        (out * out).mean().full_tensor().backward()

    return step


def measure(name: str, shape: tuple[int, ...], tile: int, rounds: int, steps: int) -> dict:
    """Rank body: per way, one step's traffic and every timed step's wall and CPU seconds."""
    torch.set_num_threads(1)
    with attention_exchange("ring"):
        return _measure(_work(name, shape, tile), rounds, steps)


def _measure(step: Callable[[], None], rounds: int, steps: int) -> dict:
    step()  # makes the axis groups that _use switches
    traffic = {}
    for way in WAYS:
        _use(way)
        step()  # warm-up: plans, caches, gloo's pairs
        with count_traffic() as counted:
            step()
        traffic[way] = {
            "sent": counted.sent,
            "received": counted.received,
            "collectives": dict(counted.collectives),
            "messages": counted.messages,
        }
    cpu: dict[str, list[float]] = {way: [] for way in WAYS}

    def run(way: str) -> list[float]:
        _use(way)
        walls, cpus = timed_steps(step, steps)
        cpu[way] += cpus
        return walls

    wall = interleaved_steps(list(WAYS), rounds, run)
    return {"traffic": traffic, "wall": wall, "cpu": cpu}


def _slowest(per_rank: list[dict], what: str, way: str) -> list[float]:
    return [max(samples) for samples in zip(*(r[what][way] for r in per_rank))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", nargs="+", default=["2", "4", "2x2"])
    parser.add_argument("--work", nargs="+", default=["pad", "unet"], choices=WORKS)
    parser.add_argument("--tiles", nargs="+", type=int, default=[16, 64])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    args = parse_arguments(parser, argv)
    with rank_pools():
        for text in args.meshes:
            shape = tuple(int(n) for n in text.split("x"))
            for name in args.work:
                for tile in args.tiles:
                    per_rank = on_ranks(
                        math.prod(shape), measure, name, shape, tile, args.rounds, args.steps
                    )
                    figures = {
                        way: {
                            what: spread(_slowest(per_rank, what, way), 5)
                            for what in ("wall", "cpu")
                        }
                        for way in WAYS
                    }
                    emit(
                        "case",
                        mesh=text,
                        work=name,
                        tile=tile,
                        **figures,
                        ratio={
                            what: round(
                                figures["all_to_all"][what]["median"]
                                / figures["messages"][what]["median"],
                                3,
                            )
                            for what in ("wall", "cpu")
                        },
                        traffic_rank0=per_rank[0]["traffic"],
                    )
    emit_summary([], args.check, rounds=args.rounds, steps=args.steps)


if __name__ == "__main__":
    main()
