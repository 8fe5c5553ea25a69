"""Activation memory per rank of a sharded conv stack against the ideal 1/N of one rank's.

A stack of 4 x (``nn.Conv2d(16, 16, 3, padding=1)`` + ``nn.SiLU``) runs forward on a float32
``(4, 16, 256, 256)`` input: on 1 rank with plain tensors, and on 2 and 4 ranks with H split
evenly over a 1-D mesh. Every tensor autograd saves for backward passes through a
``torch.autograd.graph.saved_tensors_hooks`` pack hook, which records its storage (a
ShardTensor's: its local tensor's); the saved bytes of a rank are the sizes of the distinct
storages. The ideal at N ranks is one rank's bytes / N; ``ratio`` is the largest rank's bytes
over the ideal. What a rank saves beyond its share: the halo rows of each convolution's input
(one on each side), its padding columns (a sharded convolution saves its input with the
padding materialised; one rank's ``zeros`` convolution pads internally and saves the input
alone), and the replicated weights. Both ``zeros`` and ``circular`` padding are measured (the
latter pads with ``F.pad`` before the convolution, on one rank too).

Goal: at most 1.25x the ideal at 4 ranks. Run ``python -m benchmarks.halo_and_conv
activation_memory [--shrink N]`` (``--shrink`` divides H and W, for a quick run); the JSON
fields are listed in README.md.
"""

from __future__ import annotations

import torch
from torch import nn

from benchmarks._common import Goal, emit, on_ranks
from benchmarks.conv_scaling import shard_rows
from shardsci import ShardTensor

GLOBAL_SHAPE = (4, 16, 256, 256)
LAYERS = 4
WORLD_SIZES = (1, 2, 4)
PADDING_MODES = ("zeros", "circular")
GOAL_WORLD_SIZE = 4
GOAL_RATIO = 1.25


def conv_stack(padding_mode: str) -> nn.Sequential:
    channels = GLOBAL_SHAPE[1]
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Conv2d(channels, channels, 3, padding=1, padding_mode=padding_mode)]
        layers += [nn.SiLU()]
    return nn.Sequential(*layers)


def global_shape(shrink: int) -> tuple[int, ...]:
    batch, channels, height, width = GLOBAL_SHAPE
    return batch, channels, height // shrink, width // shrink


def saved_bytes(padding_mode: str, shape: tuple[int, ...]) -> dict[str, int]:
    """Rank body: bytes of the distinct storages saved for backward by one forward pass on a
    field of ``shape``."""
    model = conv_stack(padding_mode)
    local, wrap = shard_rows(torch.randn(shape))
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        shard = t._local if isinstance(t, ShardTensor) else t
        # Holding the tensor keeps its storage alive, so no address is reused while counting.
        saved[shard.untyped_storage().data_ptr()] = shard
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(wrap(local))
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return {
        "bytes": sum(t.untyped_storage().nbytes() for t in saved.values()),
        "parameter_bytes": sum(
            t.untyped_storage().nbytes() for ptr, t in saved.items() if ptr in parameters
        ),
        "tensors": len(saved),
    }


def report(padding_mode: str, shape: tuple[int, ...]) -> float:
    """Emit one record per world size; return the ratio at ``GOAL_WORLD_SIZE``."""
    per_world = {n: on_ranks(n, saved_bytes, padding_mode, shape) for n in WORLD_SIZES}
    (single,) = per_world[1]
    ratios = {}
    for world_size, per_rank in per_world.items():
        ideal = single["bytes"] / world_size
        ratios[world_size] = max(r["bytes"] for r in per_rank) / ideal
        emit(
            "activation_memory",
            padding_mode=padding_mode,
            world_size=world_size,
            global_shape=shape,
            layers=f"{LAYERS} x (Conv2d 3x3 + SiLU)",
            saved_bytes=[r["bytes"] for r in per_rank],
            saved_tensors=[r["tensors"] for r in per_rank],
            parameter_bytes=per_rank[0]["parameter_bytes"],
            ideal_bytes=round(ideal),
            ratio=round(ratios[world_size], 4),
        )
    return ratios[GOAL_WORLD_SIZE]


def run(shrink: int = 1) -> tuple[dict[str, object], list[Goal]]:
    """Emit every case (on the running rank pools), H and W divided by ``shrink``; return the
    part's summary fields and goal."""
    ratios = {mode: report(mode, global_shape(shrink)) for mode in PADDING_MODES}
    goal = Goal(
        f"saved bytes per rank <= {GOAL_RATIO}x (one rank's / N) at N = {GOAL_WORLD_SIZE}",
        max(ratios.values()) <= GOAL_RATIO,
    )
    return {f"ratio_{mode}": round(r, 4) for mode, r in ratios.items()}, [goal]
