"""Training a model on a mesh: gradient reduction over data-parallel and domain axes.

``domain_parallel(model, mesh, dp_axis=..., domain_axes=..., dp_mode="ddp" | "fsdp2")`` makes a
plain model train on ShardTensors split over the domain axes and on batches split over the
data-parallel axis, with every parameter's gradient that of the single-device model, reduced
in a few bucketed collectives overlapped with backward.
"""

from shardsci.parallel._domain_parallel import ParallelModule, domain_parallel

__all__ = ["ParallelModule", "domain_parallel"]
