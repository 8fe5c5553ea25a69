"""Run with ``torchrun --nproc-per-node 2 examples/zoo_model.py``: a zoo UNet on your own field,
split over H across the ranks, checked against the same model on the whole field."""

import torch

import shardsci
from shardsci import Shard
from shardsci.distributed import build_mesh, init_distributed
from shardsci.models import UNet

env = init_distributed()
mesh = build_mesh(str(env.world_size), ("domain",))
torch.manual_seed(0)  # the same weights and field on every rank
model = UNet(
    in_channels=1, out_channels=1, width=8, depth=2, norm_groups=4, padding_mode="circular"
)
field = torch.randn(2, 1, 64, 48)  # (B, C, H, W): your own data

x = shardsci.distribute_tensor(field, mesh, [Shard(2)])  # each rank keeps its rows of H
y = model(x)  # the single-device model, domain-parallel: halos behind every conv
y.sum().backward()  # the weights' gradients are summed over the shards
torch.testing.assert_close(y.full_tensor(), model(field), atol=1e-5, rtol=1e-4)
print(f"rank {env.rank}: UNet on rows {x.offsets(0)}.. of H, shape {tuple(y.to_local().shape)} OK")
