"""Data parallelism on the mesh's dp axis: wrapping the model, and means over replicas.

``parallelize`` is the one place a model is wrapped for data parallelism (DDP or FSDP2 over
the dp group); the domain sum of weight gradients comes from shardsci's autograd, the
data-parallel average from the wrapper. ``dp_mean`` and ``dp_sample_mean`` turn per-replica
numbers into the numbers of the whole global batch, on every rank.

Collectives here run on tensors of the process group's device (``ParallelLayout.device``):
an NCCL group rejects CPU tensors.
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from shardsci.training._layout import ParallelLayout

__all__ = ["DataParallel", "dp_mean", "dp_sample_mean", "parallelize"]


class DataParallel(enum.Enum):
    """How replicas along the dp axis share the model (``train.parallel``)."""

    ddp = "ddp"
    """``DistributedDataParallel``: every replica holds all parameters; gradients averaged."""
    fsdp2 = "fsdp2"
    """``fully_shard``: parameters, gradients and optimiser state sharded over the replicas."""


def parallelize(model: nn.Module, layout: ParallelLayout, mode: DataParallel) -> nn.Module:
    """``model`` wrapped for data parallelism over ``layout``'s dp axis (itself without one).

    Parameters
    ----------
    model : nn.Module
        On its device already; fed ShardTensors when the layout splits the fields.
    layout : ParallelLayout
    mode : DataParallel

    Returns
    -------
    nn.Module
        The module to train (``model`` itself when the dp axis has one replica).
    """
    if layout.dp_size == 1:
        return model
    if mode is DataParallel.ddp:
        return DistributedDataParallel(model, process_group=layout.dp_group)
    if mode is DataParallel.fsdp2:
        return fully_shard(model, mesh=layout.dp_mesh)
    raise ValueError(
        f"data parallelism must be one of {[m.name for m in DataParallel]}, got {mode!r}"
    )


def dp_mean(values: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    """The mean over data-parallel replicas of ``values`` (the same on the ranks of a replica).

    Parameters
    ----------
    values : Tensor
        Any shape; float.

    Returns
    -------
    Tensor
        Same shape, float64, on ``layout.device``; equal on every rank.
    """
    values = values.detach().to(layout.device, torch.float64)
    if layout.dp_group is not None:
        dist.all_reduce(values, group=layout.dp_group)
        values /= layout.dp_size
    return values


def dp_sample_mean(per_sample: torch.Tensor, layout: ParallelLayout) -> float:
    """The mean over the samples of every data-parallel replica.

    Parameters
    ----------
    per_sample : Tensor
        ``(N,)``: this replica's values, one per sample; ``N`` may differ between replicas,
        and be 0.
    """
    per_sample = per_sample.detach().to(layout.device, torch.float64)
    totals = torch.stack([per_sample.sum(), per_sample.new_tensor(per_sample.numel())])
    if layout.dp_group is not None:
        dist.all_reduce(totals, group=layout.dp_group)
    return float(totals[0] / totals[1])
