"""AOTAutograd's cache and ShardTensors: ``ShardTensor._stable_hash_for_caching``.

A compiled graph's cache key holds each input's stable hash. Torch's default for a subclass
pickles the flatten context (the spec, with its device mesh), which differs between processes:
measured 2026-11-29 (one rank, inductor), a second process compiling the same function missed
the cache and saved another entry every time. The key must also tell apart every layout and
every rank's position, as the graph traced through a ShardTensor is the rank's own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from shardsci.tensor._api import from_local_spec
from shardsci.tensor._spec import ShardTensorSpec, replicated_spec
from shardsci.testing import assert_all_ranks, get_mesh, run_on_ranks


def _hash(spec: ShardTensorSpec, requires_grad: bool = False) -> str:
    local = torch.zeros(spec.local_shape(), dtype=spec.dtype)
    return from_local_spec(local.requires_grad_(requires_grad), spec)._stable_hash_for_caching()


def _distinct_body() -> None:
    mesh = get_mesh((2,))
    even = ShardTensorSpec.build(mesh, [Shard(0)], (6, 4), torch.float64)
    # Rank 0's shard is (3, 4) in both: only the layout tells them apart.
    uneven = ShardTensorSpec.build(mesh, [Shard(0)], (7, 4), torch.float64, {0: (3, 4)})
    remembering = even.relaid([Shard(0)], hints=uneven.shardings)
    hashes = {
        "even": _hash(even),
        "uneven": _hash(uneven),
        "hints": _hash(remembering),
        "replicated": _hash(replicated_spec(torch.zeros(6, 4, dtype=torch.float64), mesh)),
        "dim 1": _hash(ShardTensorSpec.build(mesh, [Shard(1)], (6, 8), torch.float64)),
        "requires grad": _hash(even, requires_grad=True),
    }
    assert_all_ranks(
        len(set(hashes.values())) == len(hashes), f"layouts sharing a cache key: {hashes}"
    )
    copy = ShardTensorSpec(*(getattr(even, f) for f in even.__dataclass_fields__))
    assert_all_ranks(_hash(copy) == hashes["even"], "one layout, two keys")
    ranks: list[str | None] = [None, None]
    dist.all_gather_object(ranks, hashes["even"])
    assert_all_ranks(ranks[0] != ranks[1], f"ranks 0 and 1 share a cache key: {ranks}")


def test_every_layout_and_rank_has_its_own_cache_key() -> None:
    run_on_ranks(2, _distinct_body)


_ONE_RANK = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed as dist
    import torch._dynamo.utils
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from shardsci.tensor._api import from_local_spec
    from shardsci.tensor._spec import ShardTensorSpec

    store, compile_it = sys.argv[1], sys.argv[2] == "compile"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    report = {"hashes": [], "counters": [], "errors": []}
    compiled = torch.compile(lambda x: torch.tanh(x) * 2 - x.mean(), backend="inductor")
    for rows in (4, 5):
        whole = torch.randn(rows, 6, dtype=torch.float64)
        spec = ShardTensorSpec.build(mesh, [Shard(0)], whole.shape, whole.dtype)
        leaf = whole.clone().requires_grad_()
        x = from_local_spec(leaf, spec)
        report["hashes"].append(x._stable_hash_for_caching())
        if compile_it:
            torch._dynamo.utils.counters.clear()
            y = compiled(x)
            (y * y).sum().backward()
            report["counters"].append(dict(torch._dynamo.utils.counters["aot_autograd"]))
            expected = whole.clone().requires_grad_()
            z = torch.tanh(expected) * 2 - expected.mean()
            (z * z).sum().backward()
            errors = (y.to_local() - z, leaf.grad - expected.grad)
            report["errors"].append(max(e.abs().max().item() for e in errors))
    dist.destroy_process_group()
    print(json.dumps(report))
    """
)


def _start(tmp_path, name: str, mode: str, seed: str) -> subprocess.Popen:
    """``_ONE_RANK`` in a new process (its own ``PYTHONHASHSEED``), the inductor cache in
    ``tmp_path``."""
    env = dict(os.environ, PYTHONHASHSEED=seed, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    return subprocess.Popen(
        [sys.executable, "-c", _ONE_RANK, str(tmp_path / name), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _reports(*processes: subprocess.Popen) -> list[dict]:
    """What each process reported: each layout's stable hash and, compiled, AOTAutograd's
    cache counters and the largest difference from eager plain torch. Those not finished are
    killed on a failure."""
    try:
        reports = []
        for process in processes:
            stdout, stderr = process.communicate(timeout=900)
            assert process.returncode == 0, stderr[-3000:]
            reports.append(json.loads(stdout.strip().splitlines()[-1]))
        return reports
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def test_the_cache_key_of_a_layout_is_the_same_in_a_new_process(tmp_path) -> None:
    # Side by side: two start-ups in about the time of one on two idle cores.
    first, second = _reports(_start(tmp_path, "a", "hash", "1"), _start(tmp_path, "b", "hash", "2"))
    assert first["hashes"] == second["hashes"]
    assert first["hashes"][0] != first["hashes"][1]


# About 2 minutes at load 20-40 (inductor compiles two layouts, forward and backward, once).
@pytest.mark.slow
def test_a_new_process_finds_the_graphs_compiled_by_the_last(tmp_path) -> None:
    # One after the other: the second process reads what the first wrote in the cache.
    [first] = _reports(_start(tmp_path, "a", "compile", "1"))
    [second] = _reports(_start(tmp_path, "b", "compile", "2"))
    saved = [c.get("autograd_cache_saved", 0) for c in first["counters"]]
    hits = [c.get("autograd_cache_hit", 0) for c in second["counters"]]
    assert saved == [1, 1], first["counters"]  # two layouts, two entries
    assert hits == [1, 1], second["counters"]
    # The cached graphs compute what eager code does (output and input gradient, float64).
    assert max(first["errors"] + second["errors"]) < 1e-12, (first["errors"], second["errors"])
