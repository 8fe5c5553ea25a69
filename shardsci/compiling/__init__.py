"""``torch.compile`` for domain-parallel models: compiled local regions.

``compile_regions(model)`` compiles every module that computes on each shard alone and runs
it on the local shards (NOTE [Compiled local regions]); the rest of the model, where shards
communicate, runs eagerly through ShardTensor dispatch. ``region_summary`` says which modules
run compiled.
"""

from shardsci.compiling._regions import compile_regions, region_summary

__all__ = ["compile_regions", "region_summary"]
