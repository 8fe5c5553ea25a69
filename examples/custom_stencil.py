"""Run with ``torchrun --nproc-per-node 4 examples/custom_stencil.py``: your own finite-difference
stencil (a periodic 5-point Laplacian) on a 2x2 block decomposition, with ``halo_exchange``
bringing each block the neighbours' cells it reads; checked against the whole field."""

import torch

import shardsci
from shardsci import Shard
from shardsci.distributed import build_mesh, init_distributed


def laplacian(padded: torch.Tensor) -> torch.Tensor:
    """5-point Laplacian of a (H + 2, W + 2) array with a one-cell halo: (H, W)."""
    centre = padded[1:-1, 1:-1]
    return padded[:-2, 1:-1] + padded[2:, 1:-1] + padded[1:-1, :-2] + padded[1:-1, 2:] - 4 * centre


env = init_distributed()
mesh = build_mesh("2x2", ("rows", "columns"))
torch.manual_seed(0)
field = torch.randn(37, 30, dtype=torch.float64)  # 37 rows: uneven blocks (19 / 18)

u = shardsci.distribute_tensor(field, mesh, [Shard(0), Shard(1)])
padded = shardsci.halo_exchange(u, widths={0: 1, 1: 1}, boundary="periodic")  # plain tensor
local = laplacian(padded)  # this block's Laplacian, no further communication
result = shardsci.ShardTensor.from_local(local, mesh, u.placements, u.sharding_shapes())
expected = laplacian(
    torch.nn.functional.pad(field[None, None], (1, 1, 1, 1), mode="circular")[0, 0]
)
torch.testing.assert_close(result.full_tensor(), expected)
print(f"rank {env.rank}: Laplacian of block {tuple(local.shape)} OK")
