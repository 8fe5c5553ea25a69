"""``domain_parallel``: one call that makes a model train data- and domain-parallel on a mesh.

# NOTE [Why shardsci reduces gradients itself instead of DDP]
Under a domain decomposition a parameter's gradient is a sum over the domain ranks; under
data parallelism, a mean over replicas. Handing the first to the promotions (one all-reduce per
use of a weight, synchronous in backward) and the second to DDP reduces every gradient twice,
in about as many collectives as there are weight uses. DDP's reducer cannot take the domain sum
over (it reads ``.grad``, which would then hold partial sums, and reduces over one group), so
with ``dp_mode="ddp"`` shardsci replaces it: ``GradientReducer`` reduces the domain sum and the
data-parallel mean of every bucket in one all-reduce over the combined group, launched while
backward goes on (NOTE [A reducer's gradients are final or absent] in ``_reducer``). The
result equals DDP's (same buckets: 1 MiB first, then 25 MiB, reverse parameter order).
With ``dp_mode="fsdp2"`` FSDP2 keeps its reduce-scatter over dp (it owns the sharded
parameters and their gradients); the domain sum is added as FSDP2's all-reduce hook on the
reduce-scattered shard, as HSDP does for its replicas: per FSDP2 module one reduce-scatter over
dp and one all-reduce over the domain of ``1 / dp`` of the bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, Literal

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from shardsci.parallel._reducer import (
    GRAD_KIND,
    ContributionsToGrad,
    GradientReducer,
    ReductionGroup,
)
from shardsci.tensor._collectives import axis_group
from shardsci.tensor._comm_stats import record_comm
from shardsci.tensor._promotion import gradient_sink

__all__ = ["ParallelModule", "domain_parallel"]

DataParallelMode = Literal["ddp", "fsdp2"]
_MIB = 1024 * 1024


class ParallelModule(nn.Module):
    """Mixed into a model's class by :func:`domain_parallel` (as FSDP2 mixes in ``FSDPModule``):
    the model keeps its class, parameters and state-dict names, and gains ``no_sync``."""

    _shardsci_sink: Any
    _shardsci_no_sync: Any

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with gradient_sink(self._shardsci_sink):
            return super().forward(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients without reducing them; the first
        backward outside reduces everything accumulated. ``optimizer.step()`` inside raises
        (dp_mode ``"ddp"``)."""
        with self._shardsci_no_sync():
            yield


def domain_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    dp_axis: str | None = None,
    domain_axes: Sequence[str] = (),
    dp_mode: DataParallelMode = "ddp",
    bucket_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
) -> nn.Module:
    """Train ``model`` data-parallel over ``dp_axis`` and domain-parallel over ``domain_axes``.

    The model is changed in place and returned (its class gains :class:`ParallelModule`'s
    ``no_sync``). Feed it ShardTensors on ``mesh[domain_axes]`` (or plain tensors when there
    is no domain decomposition); after ``loss.backward()`` every parameter's ``.grad`` is the
    gradient of the single-device model on the global batch: summed over the domain ranks,
    averaged over the data-parallel replicas.

    Parameters
    ----------
    model : nn.Module
    mesh : DeviceMesh
        The whole mesh, its axes named.
    dp_axis : str, optional
        The data-parallel axis.
    domain_axes : sequence of str
        The axes that split the fields; ShardTensors live on ``mesh[domain_axes]``.
    dp_mode : "ddp" or "fsdp2"
        ``"ddp"``: parameters replicated, each bucket of gradients reduced once over dp x
        domain; ``"fsdp2"``: parameters sharded over dp by ``fully_shard`` (NOTE [Why shardsci
        reduces gradients itself instead of DDP]).
    bucket_mb, first_bucket_mb : float
        Bucket capacities of the ``"ddp"`` reducer, in MiB.
    """
    if isinstance(model, ParallelModule):
        raise ValueError(
            f"{type(model).__name__} is already parallelised (domain_parallel was called on it "
            f"before); its gradients would be reduced twice"
        )
    names = _checked_axes(mesh, dp_axis, domain_axes, dp_mode)
    dp_size = mesh.size(names.index(dp_axis)) if dp_axis is not None else 1
    domain_size = math.prod(mesh.size(names.index(a)) for a in domain_axes)
    if dp_mode == "fsdp2" and dp_size > 1:
        return _with_fsdp2(model, mesh, dp_axis, tuple(domain_axes))
    if dp_size * domain_size == 1:
        return _mixed_in(model, None, nullcontext)
    reducer = GradientReducer(
        list(model.parameters()),
        _reduction(mesh, dp_axis, tuple(domain_axes), dp_size),
        bucket_bytes=int(bucket_mb * _MIB),
        first_bucket_bytes=int(first_bucket_mb * _MIB),
    )
    return _mixed_in(model, reducer, reducer.no_sync)


def _checked_axes(
    mesh: DeviceMesh, dp_axis: str | None, domain_axes: Sequence[str], dp_mode: str
) -> list[str]:
    names = list(mesh.mesh_dim_names or ())
    if not names:
        raise ValueError(f"parallelize needs a mesh with named axes, got {mesh}")
    if dp_mode not in ("ddp", "fsdp2"):
        raise ValueError(f"dp_mode must be 'ddp' or 'fsdp2', got {dp_mode!r}")
    wanted = ([dp_axis] if dp_axis is not None else []) + list(domain_axes)
    unknown = [a for a in wanted if a not in names]
    if unknown or len(set(wanted)) != len(wanted):
        raise ValueError(
            f"dp_axis={dp_axis!r} and domain_axes={list(domain_axes)} must be distinct axes "
            f"of the mesh {names}"
        )
    return names


def _reduction(
    mesh: DeviceMesh, dp_axis: str | None, domain_axes: tuple[str, ...], dp_size: int
) -> ReductionGroup:
    names = list(mesh.mesh_dim_names)
    axes = sorted(names.index(a) for a in ((dp_axis,) if dp_axis else ()) + domain_axes)
    group = axis_group(mesh, axes)
    coordinate = mesh.get_coordinate()
    return ReductionGroup(
        group=group.group if group.size > 1 else None,
        size=group.size,
        domain_mesh=_domain_mesh(mesh, domain_axes),
        keeps_plain=all(coordinate[names.index(a)] == 0 for a in domain_axes),
        average=dp_size,
    )


def _domain_mesh(mesh: DeviceMesh, domain_axes: tuple[str, ...]) -> DeviceMesh | None:
    if not domain_axes:
        return None
    return mesh[domain_axes] if len(domain_axes) > 1 else mesh[domain_axes[0]]


# One mixed-in class per model class, for the life of the process (as FSDP2 keeps its
# FSDP<Model> classes): a registry, not a cache, since a model class mixed in twice must get
# the same class back (pickling, isinstance), and model classes are few.
_MIXED: dict[type, type] = {}


def _mixed_in(model: nn.Module, sink: Any, no_sync: Any) -> nn.Module:
    cls = type(model)
    mixed = _MIXED.get(cls)
    if mixed is None:
        mixed = type(f"Parallel{cls.__name__}", (ParallelModule, cls), {})
        _MIXED[cls] = mixed
    model.__class__ = mixed
    model._shardsci_sink = sink
    model._shardsci_no_sync = no_sync
    return model


# ---------------------------------------------------------------------------- FSDP2
def _with_fsdp2(
    model: nn.Module, mesh: DeviceMesh, dp_axis: str, domain_axes: tuple[str, ...]
) -> nn.Module:
    if not isinstance(model, FSDPModule):
        fully_shard(model, mesh=mesh[dp_axis])
    reduction = _reduction(mesh, None, domain_axes, 1)
    contributions = ContributionsToGrad(reduction)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.register_forward_pre_hook(_registers_unsharded(contributions))
            if reduction.group is not None:
                module.set_all_reduce_hook(_domain_sum(reduction))

    @contextmanager
    def no_sync() -> Iterator[None]:
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    return _mixed_in(model, contributions, no_sync)


def _registers_unsharded(contributions: ContributionsToGrad):
    """A forward pre-hook, run after FSDP2's own (which all-gathers the module's parameters):
    the sink owns the unsharded parameters from then on."""

    def hook(module: FSDPModule, args: Any) -> None:
        group = module._get_fsdp_state()._fsdp_param_group
        if group is not None:
            contributions.register([p.unsharded_param for p in group.fsdp_params])

    return hook


def _domain_sum(reduction: ReductionGroup):
    def hook(reduced: Any) -> None:
        dist.all_reduce(reduced, group=reduction.group)
        nbytes = reduced.numel() * reduced.element_size()
        ring = 2 * (reduction.size - 1) * nbytes // reduction.size
        record_comm(GRAD_KIND, ring, ring)

    return hook
