"""Every zoo model's training step on one device, ShardTensor against plain torch: step time,
peak memory, in float32 and under bf16 autocast, eager, with ``compile_regions`` and with
``torch.compile``. One JSON object, written to ``--out`` (default: stdout) after each variant
of each model, so a run stopped at its time limit keeps what it measured (``"complete"`` is
false until the last variant has run; ``scripts/gpu_check.sh`` gathers it).

    python scripts/gpu_check.py [--device cuda|cpu] [--size N] [--repeats R] [--out FILE]
                                [--models NAME ...] [--variants VARIANT ...]

One rank: the default process group is a world of one (NCCL on CUDA, gloo on the CPU) and the
DeviceMesh has one ``domain`` axis. A step is forward, ``square().mean()`` backward and an AdamW
step; the two models start from the same weights. Steps are timed interleaved (plain, sharded,
plain, ...), after 3 warm-up steps each, synchronising the device around each step; the
figures are the median and the spread of ``--repeats`` steps. Peak memory is
``torch.cuda.max_memory_allocated`` over one step, from the memory held before it (None on
the CPU). A variant that raises is recorded with its error, and the others still run.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardsci import Shard, ShardTensor, distribute_tensor
from shardsci.compiling import compile_regions
from shardsci.parallel import domain_parallel
from tests.zoo import MODELS

VARIANTS = ("eager", "bf16", "compile_regions", "torch.compile")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, x, bf16: bool) -> None:
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
        loss = model(x).float().square().mean()
    if isinstance(loss, ShardTensor):
        loss = loss.full_tensor()
    loss.backward()
    optimizer.step()


def _timed(step: Callable[[], None], device: torch.device) -> tuple[float, int | None]:
    """Seconds of one step and its peak memory above what was held before it."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        held = torch.cuda.memory_allocated(device)
    _sync(device)
    started = time.perf_counter()
    step()
    _sync(device)
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated(device) - held if device.type == "cuda" else None
    return seconds, peak


def _variant(model: nn.Module, variant: str) -> nn.Module:
    if variant == "compile_regions":
        return compile_regions(model)
    if variant == "torch.compile":
        return torch.compile(model)
    return model


def check_model(
    name: str,
    mesh,
    device: torch.device,
    size: int,
    repeats: int,
    variants: list[str],
    result: dict,
    save: Callable,
) -> None:
    """Fill ``result`` with the model's figures for each of ``variants``, calling ``save``
    after each."""
    shape = (1, 2, size // 2, size // 2, size // 2) if name.endswith("3d") else (2, 2, size, size)
    torch.manual_seed(0)
    x = torch.randn(shape, device=device)
    sharded_x = distribute_tensor(x, mesh, [Shard(2)])
    result["input"] = list(shape)
    for variant in variants:
        try:
            torch.manual_seed(0)
            plain = MODELS[name]().to(device)
            sharded = domain_parallel(copy.deepcopy(plain), mesh, domain_axes=["domain"])
            runs = {
                "plain": (_variant(plain, variant), plain, x),
                "shardtensor": (_variant(sharded, variant), sharded, sharded_x),
            }
            steps = {}
            for kind, (model, params, data) in runs.items():
                optimizer = torch.optim.AdamW(params.parameters(), lr=1e-3)
                bf16 = variant == "bf16"
                steps[kind] = lambda m=model, o=optimizer, d=data, b=bf16: _step(m, o, d, b)
            for _ in range(3):
                for step in steps.values():
                    step()
            samples: dict[str, list[tuple[float, int | None]]] = {k: [] for k in steps}
            for _ in range(repeats):
                for kind, step in steps.items():
                    samples[kind].append(_timed(step, device))
            figures = {}
            for kind, timed in samples.items():
                ms = [1e3 * s for s, _ in timed]
                peaks = [p for _, p in timed if p is not None]
                figures[kind] = {
                    "step_ms_median": round(statistics.median(ms), 3),
                    "step_ms_min": round(min(ms), 3),
                    "step_ms_max": round(max(ms), 3),
                    "peak_bytes": max(peaks) if peaks else None,
                }
            figures["time_ratio"] = round(
                figures["shardtensor"]["step_ms_median"] / figures["plain"]["step_ms_median"], 3
            )
            result[variant] = figures
        except Exception as error:  # recorded; the other variants still run
            result[variant] = {
                "error": f"{type(error).__name__}: {error}",
                "where": traceback.format_exc(limit=-3),
            }
        save()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--size", type=int, default=64, help="cells per side of a 2-D field")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--out", type=Path, help="the JSON file (default: stdout, at the end)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("gpu_check: --device cuda but torch sees no CUDA device")
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=120)
    )
    try:
        mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("domain",))
        summary = {
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
            "backend": backend,
            "world_size": 1,
            "two_ranks": (
                "not run: NCCL refuses two ranks on one GPU (a duplicate GPU error at the "
                "first collective); the multi-rank paths are the CPU suite's (gloo)"
            ),
            "size": args.size,
            "repeats": args.repeats,
            "variants": args.variants,
            "threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "models": {},
            "complete": False,
        }

        def save() -> None:
            if args.out is not None:
                partial = args.out.with_name(args.out.name + ".partial")
                partial.write_text(json.dumps(summary, indent=1) + "\n")
                partial.replace(args.out)

        for name in args.models:
            summary["models"][name] = {}
            check_model(
                name,
                mesh,
                device,
                args.size,
                args.repeats,
                args.variants,
                summary["models"][name],
                save,
            )
        summary["complete"] = True
        save()
    finally:
        dist.destroy_process_group()
    if args.out is None:
        json.dump(summary, sys.stdout, indent=1)
        print()


if __name__ == "__main__":
    main()
