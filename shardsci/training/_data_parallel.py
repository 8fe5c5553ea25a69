"""Data parallelism on the mesh's dp axis: wrapping the model, and means over replicas.

``parallelize`` is the one place a model is made to train on the mesh: gradients summed over
the domain axes and averaged over the dp axis in bucketed collectives, with parameters
replicated (DDP-like) or sharded over dp (FSDP2) (``shardsci.parallel.domain_parallel``).
``dp_sample_mean`` turns per-sample numbers of each replica into the mean over the whole
global batch, on every rank.

Collectives here run on tensors of the process group's device (``Parallelism.device``): an
NCCL group rejects CPU tensors.
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist
from torch import nn

from shardsci.parallel import domain_parallel
from shardsci.training._parallelism import Parallelism

__all__ = ["DataParallelMode", "dp_sample_mean", "parallelize"]


class DataParallelMode(enum.Enum):
    """How replicas along the dp axis share the model (``train.dp_mode``)."""

    ddp = "ddp"
    """Every replica holds all parameters; gradients averaged (shardsci's bucketed reducer,
    DDP's semantics)."""
    fsdp2 = "fsdp2"
    """``fully_shard``: parameters, gradients and optimiser state sharded over the replicas."""


def parallelize(model: nn.Module, parallelism: Parallelism, mode: DataParallelMode) -> nn.Module:
    """``model`` wrapped for data parallelism over the dp axis of ``parallelism`` (itself
    without one).

    Parameters
    ----------
    model : nn.Module
        On its device already; fed ShardTensors when the mesh splits the fields.
    parallelism : Parallelism
        The run's mesh and its axis roles.
    mode : DataParallelMode

    Returns
    -------
    nn.Module
        ``model`` itself, its class extended with ``no_sync()`` (NOTE [Why shardsci reduces
        gradients itself instead of DDP] in ``shardsci/parallel/_domain_parallel.py``).
    """
    if not isinstance(mode, DataParallelMode):
        raise ValueError(
            f"data parallelism must be one of {[m.name for m in DataParallelMode]}, got {mode!r}"
        )
    return domain_parallel(
        model,
        parallelism.mesh,
        dp_axis=parallelism.plan.dp_axis,
        domain_axes=parallelism.domain_axes,
        dp_mode=mode.value,
    )


def dp_sample_mean(per_sample: torch.Tensor, parallelism: Parallelism) -> float:
    """The mean over the samples of every data-parallel replica.

    Parameters
    ----------
    per_sample : Tensor
        ``(N,)``: this replica's values, one per sample; ``N`` may differ between replicas,
        and be 0.
    """
    per_sample = per_sample.detach().to(parallelism.device, torch.float64)
    totals = torch.stack([per_sample.sum(), per_sample.new_tensor(per_sample.numel())])
    if parallelism.dp_group is not None:
        dist.all_reduce(totals, group=parallelism.dp_group)
    return float(totals[0] / totals[1])
