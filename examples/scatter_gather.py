"""Run with ``torchrun --nproc-per-node 4 examples/scatter_gather.py``: a field that exists on
one rank (read from a file there, say) is scattered so that every rank receives only its
piece; each rank works on its piece; the result is gathered back."""

import torch

import shardsci
from shardsci import Shard
from shardsci.distributed import build_mesh, init_distributed

env = init_distributed()
mesh = build_mesh(str(env.world_size), ("domain",))
source = 0
field = torch.linspace(0, 1, 4 * 50).reshape(4, 50) if env.rank == source else None

sizes = [20, 15, 10, 5][: env.world_size]  # any split, uneven or empty
with shardsci.comm_counter() as traffic:  # shape and dtype known everywhere: no metadata sent
    x = shardsci.scatter_tensor(
        field, source, mesh, [Shard(1)], {0: sizes}, global_shape=(4, 50), dtype=torch.float32
    )
piece = x.to_local()
assert traffic.total_received == (0 if env.rank == source else piece.numel() * 4)
print(f"rank {env.rank}: received only its piece {tuple(piece.shape)}")

y = torch.sin(x) * 2  # every rank computes on its own columns
whole = y.full_tensor()  # every rank gets the whole result (or y.redistribute(...))
if env.rank == source:
    torch.testing.assert_close(whole, torch.sin(field) * 2)
    print("gathered result OK")
