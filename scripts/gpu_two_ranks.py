"""Two ranks on one GPU: what NCCL says, and what runs instead.

NCCL allows one rank per GPU, so a card of one cannot run NCCL's multi-rank paths. This runs
two processes on the one device twice:

1. ``nccl``: a two-rank NCCL all-reduce on device 0. Recorded as it ends: the value, NCCL's
   error, or the processes still running after ``--nccl-seconds`` (killed).
2. ``gloo``: the same two processes with gloo, which takes CUDA tensors (it stages them
   through the host), and a ``DeviceMesh`` on the device: ShardTensor ops and
   redistributions, a periodic halo exchange, a convolution's forward and gradients, and a
   convolution under ``overlap_halos()`` (its halo halves on the device's side stream, NOTE
   [Halo overlap on streams]), causal ring attention under bf16 autocast against torch's SDPA
   of the whole sequence (accuracy against float64, and each one's peak memory, recorded
   under ``figures``), a float64 training step (forward, backward, AdamW) of every
   zoo model, all on uneven shards
   (7/5 rows; 5/3 for the 3-D models), each against plain torch on the same device, with
   every result and gradient checked to be on the device. This is how the multi-rank CUDA
   paths (buffers, statistics gathers, halo messages on the device) run on one card.

    python scripts/gpu_two_ranks.py [--device cuda|cpu] [--out FILE]

``--device cpu`` runs step 2 on the CPU (step 1 is skipped), which is what a machine without
a GPU can rehearse. One JSON object on stdout and in ``--out``: each case's status, error and
seconds per rank. Exit status 0 when every gloo case passed on both ranks.
"""

from __future__ import annotations

import argparse
import copy
import json
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES_2D = [7, 5]  # rows of dim 2 (12) per rank
SIZES_3D = [5, 3]  # depth of dim 2 (8) per rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(backend: str, rank: int, port: int, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )


def nccl_rank(rank: int, port: int, folder: str, device_type: str) -> None:
    """One NCCL all-reduce of ``rank + 1`` on device 0; writes what happened."""
    try:
        _init("nccl", rank, port, torch.device("cuda", 0))
        t = torch.full((4,), float(rank + 1), device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        result = {"ok": True, "value": t.tolist()}
    except Exception as error:
        result = {"ok": False, "error": f"{type(error).__name__}: {str(error)[:600]}"}
    Path(folder, f"nccl_{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


def gloo_rank(rank: int, port: int, folder: str, device_type: str) -> None:
    """Every case on a two-rank gloo mesh on the device; writes each case's outcome."""
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    import shardsci
    from shardsci import Replicate, Shard, ShardTensor, halo_exchange
    from shardsci.parallel import domain_parallel
    from shardsci.tensor import cache_sizes
    from shardsci.tensor._ops import _windows
    from tests.zoo import MODELS

    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    _init("gloo", rank, port, device)
    mesh = init_device_mesh(device.type, (2,), mesh_dim_names=("domain",))

    def field(*shape: int) -> torch.Tensor:
        torch.manual_seed(0)
        return torch.randn(shape, dtype=torch.float64, device=device)

    def uneven(x: torch.Tensor, sizes: list[int]) -> ShardTensor:
        local = x.narrow(2, sum(sizes[:rank]), sizes[rank]).clone()
        return ShardTensor.from_local(local, mesh, [Shard(2)], sharding_shapes="infer")

    def on_device(t: torch.Tensor) -> bool:
        local = t.to_local() if isinstance(t, ShardTensor) else t
        return local.device.type == device.type

    def ops() -> None:
        x = field(2, 3, 12, 6)
        s = uneven(x, SIZES_2D)
        y = (s * 2 + 1).relu().sum(dim=3).softmax(dim=1)
        assert on_device(y) and y.placements == (Shard(2),)
        torch.testing.assert_close(y.full_tensor(), (x * 2 + 1).relu().sum(dim=3).softmax(dim=1))
        torch.testing.assert_close(s.sum().full_tensor(), x.sum())
        torch.testing.assert_close(s.redistribute(mesh, [Replicate()]).to_local(), x)
        moved = s.redistribute(mesh, [Shard(3)])
        assert on_device(moved)
        torch.testing.assert_close(moved.full_tensor(), x)

    def halo() -> None:
        x = field(2, 3, 12, 6)
        extended = halo_exchange(uneven(x, SIZES_2D), {2: 1, 3: 2}, "periodic")
        assert on_device(extended)  # this rank's rows with one halo row each side
        padded = F.pad(x, (2, 2, 1, 1), mode="circular")
        start = sum(SIZES_2D[:rank])
        torch.testing.assert_close(extended, padded[:, :, start : start + SIZES_2D[rank] + 2])

    def convolution() -> None:
        x = field(2, 3, 12, 6)
        torch.manual_seed(1)
        conv = nn.Conv2d(3, 4, 3, padding=1).double().to(device)
        leaf = uneven(x, SIZES_2D).detach().requires_grad_()
        out = conv(leaf)
        out.square().sum().backward()
        plain = x.clone().requires_grad_()
        expected = copy.deepcopy(conv)(plain)
        expected.square().sum().backward()
        assert on_device(out) and on_device(leaf.grad)
        torch.testing.assert_close(out.full_tensor(), expected)
        torch.testing.assert_close(leaf.grad.full_tensor(), plain.grad)

    def overlapped_convolution() -> None:
        """Twice (the side stream is made once, then reused), against plain torch."""
        started = []
        start_extend = _windows.start_extend
        _windows.start_extend = lambda *a: started.append(1) or start_extend(*a)
        try:
            x = field(2, 3, 12, 6)
            torch.manual_seed(1)
            conv = nn.Conv2d(3, 4, 3, padding=1).double().to(device)
            plain = x.clone().requires_grad_()
            expected = copy.deepcopy(conv)(plain)
            expected.square().sum().backward()
            for _ in range(2):
                leaf = uneven(x, SIZES_2D).detach().requires_grad_()
                with shardsci.overlap_halos():
                    out = conv(leaf * 1)
                    out.square().sum().backward()
                torch.testing.assert_close(out.full_tensor(), expected)
                torch.testing.assert_close(leaf.grad.full_tensor(), plain.grad)
        finally:
            _windows.start_extend = start_extend
        assert len(started) == 2, f"the overlap path ran {len(started)} times, not 2"
        streams = cache_sizes()["halo side streams"]
        assert streams == (device.type == "cuda"), f"{streams} side streams"

    def peak_bytes(run: Callable[[], None]) -> int | None:
        """Peak bytes allocated on the device by ``run`` above what was held before it."""
        if device.type != "cuda":
            run()
            return None
        torch.cuda.synchronize(device)
        held = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - held

    def ring_attention_bf16() -> dict:
        """Causal ring attention under bf16 autocast (NOTE [Ring attention in a lower
        precision]) against torch's SDPA of the whole sequence on the device: output and
        gradients as accurate as torch's against float64 (3x its error plus 2^-10, the
        criterion of tests/test_autocast.py); each one's peak memory, recorded. On CUDA the
        ring's blocks are computed with float32 matmuls (no fused CUDA block kernel yet)."""
        from shardsci import attention_exchange

        length = 2048 if device.type == "cuda" else 64
        sizes = [length * 9 // 16, length - length * 9 // 16]
        torch.manual_seed(0)
        qkv = [torch.randn(1, 8, length, 64, device=device) for _ in range(3)]
        runs = {}
        for run in ("float64", "torch", "ring"):
            inputs = [t.double() if run == "float64" else t.clone() for t in qkv]
            if run == "ring":
                inputs = [uneven(t, sizes).detach() for t in inputs]
            inputs = [t.requires_grad_() for t in inputs]

            def step(inputs=inputs, run=run) -> None:
                with (
                    torch.autocast(device.type, dtype=torch.bfloat16, enabled=run != "float64"),
                    attention_exchange("ring"),
                ):
                    out = F.scaled_dot_product_attention(*inputs, is_causal=True)
                loss = out.float().square().sum()
                (loss.full_tensor() if isinstance(loss, ShardTensor) else loss).backward()
                runs[run] = [out.full_tensor() if isinstance(out, ShardTensor) else out]

            peak = peak_bytes(step)
            runs[run] += [t.grad.full_tensor() if run == "ring" else t.grad for t in inputs]
            runs[run].append(peak)

        def error(found: torch.Tensor, truth: torch.Tensor) -> float:
            found, truth = found.detach().double(), truth.detach()
            return float((found - truth).norm() / truth.norm().clamp_min(1e-30))

        figures = {"length": length, "rows": sizes, "peak_bytes_torch": runs["torch"][-1]}
        figures["peak_bytes_ring_rank"] = runs["ring"][-1]
        worse = []
        for i, what in enumerate(["output", "grad q", "grad k", "grad v"]):
            ring, plain = (
                error(runs["ring"][i], runs["float64"][i]),
                error(runs["torch"][i], runs["float64"][i]),
            )
            figures[f"error {what} (ring, torch)"] = [ring, plain]
            if ring > 3 * plain + 2**-10:
                worse.append(what)
        assert not worse, f"less accurate than torch's SDPA: {worse}; {figures}"
        return figures

    def training_step(name: str) -> Callable[[], None]:
        def run() -> None:
            torch.manual_seed(0)
            plain = MODELS[name]().double().to(device)
            model = domain_parallel(copy.deepcopy(plain), mesh, domain_axes=["domain"])
            three_d = name.endswith("3d")
            x = field(1, 2, 8, 6, 6) if three_d else field(2, 2, 12, 8)
            sharded = uneven(x, SIZES_3D if three_d else SIZES_2D)
            for m, data in ((plain, x), (model, sharded)):
                optimizer = torch.optim.AdamW(m.parameters(), lr=1e-3)
                loss = m(data).square().mean()
                if isinstance(loss, ShardTensor):
                    loss = loss.full_tensor()
                loss.backward()
                optimizer.step()
            for (path, p), q in zip(model.named_parameters(), plain.parameters()):
                assert on_device(p.grad), path
                torch.testing.assert_close(p.grad, q.grad, msg=path)
                torch.testing.assert_close(p, q, msg=path)

        return run

    cases = {
        "ops": ops,
        "halo": halo,
        "convolution": convolution,
        "overlapped convolution": overlapped_convolution,
        "ring attention bf16": ring_attention_bf16,
    }
    cases.update({f"step:{name}": training_step(name) for name in MODELS})
    results = {}
    for name, case in cases.items():
        started = time.perf_counter()
        try:
            figures = case()
            results[name] = {"ok": True} if figures is None else {"ok": True, "figures": figures}
        except Exception as error:  # recorded; the other cases still run
            results[name] = {
                "ok": False,
                "error": f"{type(error).__name__}: {str(error)[:400]}",
                "where": traceback.format_exc(limit=-3)[-1500:],
            }
        results[name]["seconds"] = round(time.perf_counter() - started, 2)
    Path(folder, f"gloo_{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def two_ranks(body: Callable, device_type: str, seconds: float) -> dict:
    """Run ``body`` on two spawned ranks; each rank's JSON, and the ranks still running at
    ``seconds`` (killed)."""
    with tempfile.TemporaryDirectory() as folder:
        context = mp.get_context("spawn")
        port = _free_port()
        ranks = [
            context.Process(target=body, args=(rank, port, folder, device_type))
            for rank in range(2)
        ]
        for process in ranks:
            process.start()
        deadline = time.monotonic() + seconds
        for process in ranks:
            process.join(max(0.1, deadline - time.monotonic()))
        hung = [rank for rank, process in enumerate(ranks) if process.is_alive()]
        for process in ranks:
            if process.is_alive():
                process.kill()
                process.join()
        found = {}
        for rank in range(2):
            path = Path(folder, f"{body.__name__.split('_')[0]}_{rank}.json")
            found[rank] = json.loads(path.read_text()) if path.exists() else None
    return {"ranks": found, "still_running_killed": hung}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--nccl-seconds", type=float, default=40)
    parser.add_argument("--gloo-seconds", type=float, default=150)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_two_ranks: --device cuda but torch sees no CUDA device")
    summary = {"torch": torch.__version__, "device": args.device}
    if args.device == "cuda":
        summary["device_name"] = torch.cuda.get_device_name(0)
        summary["nccl"] = two_ranks(nccl_rank, "cuda", args.nccl_seconds)
    summary["gloo"] = two_ranks(gloo_rank, args.device, args.gloo_seconds)
    ranks = summary["gloo"]["ranks"].values()
    summary["passed"] = all(r is not None and all(c["ok"] for c in r.values()) for r in ranks)
    text = json.dumps(summary, indent=1)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)
    sys.exit(0 if summary["passed"] else 1)


if __name__ == "__main__":
    main()
