"""Bad input raises a clear error on every rank, and never leaves a rank waiting.

Each case calls the library with a mistake and checks, with ``assert_raises_all_ranks``, that
every rank raises the same kind of error with a message naming the mistake. A rank that
raised alone would leave the others in a collective: ``run_on_ranks`` then fails on its
timeout instead of hanging the suite.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard

from shardsci.distributed import build_mesh
from shardsci.tensor import ShardTensor, distribute_tensor, scatter_tensor
from shardsci.testing import assert_raises_all_ranks, get_mesh, run_on_ranks

S0, S1, S2, R = Shard(0), Shard(1), Shard(2), Replicate()
TIMEOUT_S = 30.0


def _raises(match: str, fn: Callable, *args, **kwargs) -> None:
    assert_raises_all_ranks(ValueError, match, fn, *args, **kwargs)


def _rows(rank: int, *, cols: int = 4, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(rank + 1, cols, dtype=dtype)


# --------------------------------------------------------------------------- from_local "infer"
def _shards_that_do_not_concatenate(mesh) -> None:
    rank = dist.get_rank()
    _raises(
        "tensor dim 1 is not sharded, but shards that should agree on its size do not",
        ShardTensor.from_local,
        _rows(rank, cols=5 if rank == 2 else 4),
        mesh,
        [S0],
    )
    _raises(
        r"the shards have different numbers of dims: rank 0: \(1, 4\), rank 1: \(2, 4, 1\)",
        ShardTensor.from_local,
        _rows(rank).unsqueeze(-1) if rank == 1 else _rows(rank),
        mesh,
        [S0],
    )
    # Shard(2) exists only on the 3-D shard: the dims must be compared before the placement.
    _raises(
        "the shards have different numbers of dims",
        ShardTensor.from_local,
        _rows(rank).unsqueeze(-1) if rank == 1 else _rows(rank),
        mesh,
        [S2],
    )
    _raises(
        r"the shards have different dtypes: \['torch.float64', 'torch.float64', "
        r"'torch.float64', 'torch.float32'\]",
        ShardTensor.from_local,
        _rows(rank, dtype=torch.float32 if rank == 3 else torch.float64),
        mesh,
        [S0],
    )


def _nested_shards_that_do_not_concatenate(mesh) -> None:
    """On a 2x2 mesh, [Shard(0), Shard(1)]: ranks along mesh axis 1 must agree on dim 0."""
    rank = dist.get_rank()
    rows = 3 if rank == 1 else 2
    _raises(
        r"tensor dim 0 is sharded over mesh axes \(0,\), but shards that should agree",
        ShardTensor.from_local,
        torch.randn(rows, 3, dtype=torch.float64),
        mesh,
        [S0, S1],
    )


# --------------------------------------------------------------------------- placements
def _wrong_placements(mesh) -> None:
    rank = dist.get_rank()
    x = ShardTensor.from_local(_rows(rank), mesh, [S0])
    whole = torch.randn(10, 4, dtype=torch.float64)
    two = [S0, R]
    _raises("got 2 placements .* for a 1-D mesh", ShardTensor.from_local, _rows(rank), mesh, two)
    _raises("got 2 placements .* for a 1-D mesh", x.redistribute, mesh, two)
    _raises("got 2 placements .* for a 1-D mesh", scatter_tensor, whole, 0, mesh, two)
    _raises("got 2 placements .* for a 1-D mesh", distribute_tensor, whole, mesh, two)
    out_of_range = r"Shard\({}\) on mesh axis 0 is out of range for a 2-D"
    _raises(out_of_range.format(2), ShardTensor.from_local, _rows(rank), mesh, [S2])
    _raises(out_of_range.format(-3), x.redistribute, mesh, [Shard(-3)])
    _raises(out_of_range.format(2), scatter_tensor, whole, 0, mesh, [S2])
    _raises(out_of_range.format(5), distribute_tensor, whole, mesh, [Shard(5)])
    _raises(
        r"cannot redistribute to P\(sum\) on mesh axis 0: Partial placements are produced",
        x.redistribute,
        mesh,
        [Partial()],
    )
    _raises(
        r"scatter_tensor places whole values: got P\(sum\) on mesh axis 0",
        scatter_tensor,
        whole,
        0,
        mesh,
        [Partial()],
    )


def _mesh_larger_than_world(mesh) -> None:
    _raises("mesh shape 4x2 has 8 ranks but the world size is 4", build_mesh, "4x2")


# --------------------------------------------------------------------------- explicit sizes
def _sizes_that_do_not_sum(mesh) -> None:
    rank = dist.get_rank()
    x = ShardTensor.from_local(_rows(rank), mesh, [S0])  # rows 1/2/3/4: 10 in all
    _raises(
        r"sizes \[1, 1, 1, 1\] for tensor dim 0 sum to 4, but its global size is 10",
        x.redistribute,
        mesh,
        [S0],
        sharding_shapes={0: [1, 1, 1, 1]},
    )
    _raises(
        r"sizes \[3, 3, 3, 3\] for tensor dim 1 sum to 12, but its global size is 4",
        x.redistribute,
        mesh,
        [S1],
        sharding_shapes={0: [(10, 3)] * 4},
    )
    whole = torch.randn(10, 4, dtype=torch.float64) if rank == 1 else None
    for known in ({}, {"global_shape": (10, 4), "dtype": torch.float64}):
        _raises(
            r"sizes \[2, 2, 2, 2\] for tensor dim 0 sum to 8, but its global size is 10",
            scatter_tensor,
            whole,
            1,
            mesh,
            [S0],
            {0: [2, 2, 2, 2]},
            **known,
        )
    _raises(
        r"the shards form a tensor of shape \(10, 4\), but shape=\(12, 4\) was given",
        ShardTensor.from_local,
        _rows(rank),
        mesh,
        [S0],
        {0: [1, 2, 3, 4]},
        shape=(12, 4),
    )
    _raises(
        r"sharding_shapes\[0\] has 3 entries, but mesh axis 0 has 4 ranks",
        x.redistribute,
        mesh,
        [S0],
        sharding_shapes={0: [4, 3, 3]},
    )
    _raises(
        r"sharding_shapes must give exactly the sharded mesh axes \[0\], got \[1\]",
        ShardTensor.from_local,
        _rows(rank),
        mesh,
        [S0],
        {1: [1, 2, 3, 4]},
    )
    _raises(
        "sharding_shapes must be 'infer', 'chunk' or a dict",
        ShardTensor.from_local,
        _rows(rank),
        mesh,
        [S0],
        "even",
    )


def _sizes_that_contradict_the_shards(mesh) -> None:
    """run_check=True: the claim is checked against every rank's shard, on every rank."""
    rank = dist.get_rank()
    _raises(
        r"the shards held by the ranks have sizes \{0: \[1, 2, 3, 4\]\} along their sharded "
        r"dims \(global shape \(10, 4\)\), but the given sharding says \{0: \[4, 3, 2, 1\]\}",
        ShardTensor.from_local,
        _rows(rank),
        mesh,
        [S0],
        {0: [4, 3, 2, 1]},
        run_check=True,
    )
    _raises(
        r"the shards held by the ranks have sizes \{0: \[1, 2, 3, 4\]\} .* says "
        r"\{0: \[3, 3, 3, 1\]\}",
        ShardTensor.from_local,
        _rows(rank),
        mesh,
        [S0],
        "chunk",
        shape=(10, 4),
        run_check=True,
    )
    # One rank's unsharded dim differs: its own global shape would differ from the others'.
    _raises(
        "tensor dim 1 is not sharded, but shards that should agree on its size do not",
        ShardTensor.from_local,
        _rows(rank, cols=5 if rank == 3 else 4),
        mesh,
        [S0],
        {0: [1, 2, 3, 4]},
        shape=(10, 4),
        run_check=True,
    )


# --------------------------------------------------------------------------- scatter_tensor
def _bad_scatter_source(mesh) -> None:
    rank = dist.get_rank()
    whole = torch.randn(10, 4, dtype=torch.float64)
    _raises(
        re.escape("global_src 7 is not a rank of the mesh") + r".*\(its ranks: \[0, 1, 2, 3\]\)",
        scatter_tensor,
        whole,
        7,
        mesh,
        [S0],
    )
    _raises(
        "rank 2 is the source of scatter_tensor but passed no tensor",
        scatter_tensor,
        None,
        2,
        mesh,
        [S0],
    )
    odd = whole.to(torch.uint16) if rank == 2 else None
    _raises(
        "scatter_tensor cannot send the metadata of the tensor on rank 2 .* pass global_shape "
        "and dtype on every rank",
        scatter_tensor,
        odd,
        2,
        mesh,
        [S0],
    )


CASES: dict[str, tuple[tuple[int, ...], Callable]] = {
    "shards_that_do_not_concatenate": ((4,), _shards_that_do_not_concatenate),
    "nested_shards_that_do_not_concatenate": ((2, 2), _nested_shards_that_do_not_concatenate),
    "wrong_placements": ((4,), _wrong_placements),
    "mesh_larger_than_world": ((4,), _mesh_larger_than_world),
    "sizes_that_do_not_sum": ((4,), _sizes_that_do_not_sum),
    "sizes_that_contradict_the_shards": ((4,), _sizes_that_contradict_the_shards),
    "bad_scatter_source": ((4,), _bad_scatter_source),
}


def _bad_input_body(name: str) -> None:
    mesh_shape, case = CASES[name]
    case(get_mesh(mesh_shape))


@pytest.mark.parametrize("name", CASES)
def test_bad_input_raises_on_every_rank(name: str) -> None:
    run_on_ranks(math.prod(CASES[name][0]), _bad_input_body, name, timeout_s=TIMEOUT_S)
