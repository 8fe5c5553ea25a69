"""Run with ``torchrun --nproc-per-node 4 examples/uneven_softmax.py``: a softmax over rows
split 40/33/30/28 across 4 ranks, checked against the whole tensor."""

import torch

import shardsci
from shardsci import Shard
from shardsci.distributed import build_mesh, init_distributed

env = init_distributed()  # torchrun, SLURM or a single process; gloo on CPU, nccl on GPUs
mesh = build_mesh("4", ("domain",))  # or "4x2", "2x2x2", (-1, 2)

sizes = [40, 33, 30, 28]
torch.manual_seed(0)
whole = torch.randn(sum(sizes), 8)
start = sum(sizes[: env.rank])
local = whole[start : start + sizes[env.rank]]  # each rank holds its own rows

x = shardsci.ShardTensor.from_local(local, mesh, [Shard(0)])  # sizes gathered once
with shardsci.comm_counter() as stats:
    y = torch.softmax(x, dim=0)  # two small all-reduces, no gather
z = y.redistribute(mesh, [Shard(1)])  # one all-to-all; the uneven rows come back below
back = z.redistribute(mesh, [Shard(0)])
assert back.to_local().shape[0] == sizes[env.rank]
torch.testing.assert_close(y.full_tensor(), torch.softmax(whole, dim=0))
print(f"rank {env.rank}: softmax over uneven rows OK, received {stats.total_received} bytes")
