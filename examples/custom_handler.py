"""Run with ``torchrun --nproc-per-node 2 examples/custom_handler.py``: your own op, and a
shard-aware handler that tells shardsci how to run it on a ShardTensor.

``demo::scale_by_max`` divides a tensor by its largest absolute value. Run locally on each
shard it would use each shard's own maximum (silently wrong); the handler all-reduces the
maximum once and returns the result in the input's layout.
"""

import torch
import torch.distributed as dist

import shardsci
from shardsci import Shard
from shardsci.distributed import build_mesh, init_distributed
from shardsci.handlers import accepts, bind


@torch.library.custom_op("demo::scale_by_max", mutates_args=())
def scale_by_max(x: torch.Tensor) -> torch.Tensor:
    return x / x.abs().max()


@shardsci.register_aten_handler("demo::scale_by_max")
def scale_by_max_on_shards(func, args, kwargs):
    x = bind(func, args, kwargs).x  # by the op's schema: scale_by_max(Tensor x)
    if not accepts(x):  # a Partial input's maximum is not the maximum of its shards
        return NotImplemented
    local = x.to_local()
    largest = local.abs().amax() if local.numel() else local.new_zeros(())  # empty shards too
    for axis, placement in enumerate(x.placements):
        if placement.is_shard():
            dist.all_reduce(largest, dist.ReduceOp.MAX, group=x.device_mesh.get_group(axis))
    return shardsci.ShardTensor.from_local(
        local / largest, x.device_mesh, x.placements, x.sharding_shapes()
    )


env = init_distributed()
mesh = build_mesh(str(env.world_size), ("domain",))
torch.manual_seed(0)
whole = torch.randn(11, 4)
x = shardsci.distribute_tensor(whole, mesh, [Shard(0)])  # 6 / 5 rows
y = torch.ops.demo.scale_by_max(x)
torch.testing.assert_close(y.full_tensor(), scale_by_max(whole))
print(f"rank {env.rank}: demo::scale_by_max on a ShardTensor OK")
