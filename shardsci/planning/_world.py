"""One simulated rank of a world of any size, in this process, with no real communication.

# NOTE [A dry run executes the library on one simulated rank at a time]
The dry run does not model shardsci: it runs it. The default process group is torch's fake
process group (every collective returns at once, having moved nothing), registered as a
backend for the CPU, CUDA and ``meta`` devices, so a DeviceMesh of any shape can be built for
any rank; the model, its
optimiser state and the batch live on the ``meta`` device, where every op computes shapes,
strides and dtypes but no values and allocates nothing. The library's own code decides every
halo, redistribution and reduction, and records every collective's bytes exactly as it does on
real ranks (``comm_counter``), so a change to how shardsci communicates changes the plan by
construction. What a rank does depends only on global specs (NOTE [Shard sizes are a global,
rank-independent table]) and its coordinate, so ranks are simulated one per rank class
(``_rank_classes``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from shardsci.tensor._collectives import issued_as
from shardsci.tensor._torch_compat import FakeProcessGroup

__all__ = ["META", "simulated_rank"]

META = torch.device("meta")
"""Where a dry run's tensors live: shapes and dtypes without storage."""

_BACKEND = "shardsci_dry_run"
"""The fake process group's backend name."""


def _fake_process_group(common_options, backend_options):
    return FakeProcessGroup._create_internal(
        common_options.group_rank, common_options.group_size, backend_options
    )


@contextlib.contextmanager
def simulated_rank(rank: int, world_size: int, backend: str = "gloo") -> Iterator[None]:
    """Make this process rank ``rank`` of a fake world of ``world_size`` ranks whose process
    groups stand in for ``backend``'s, the target run's (``"nccl"`` on GPUs): the rules that
    depend on a group's backend (how a halo is issued) follow it (``issued_as``), whatever
    device the simulated mesh is on.

    Raises
    ------
    RuntimeError
        If a real default process group exists (a dry run must not touch a real job).
    """
    if _BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            _BACKEND, _fake_process_group, extended_api=True, devices=["cpu", "cuda", "meta"]
        )
    if dist.is_initialized():
        raise RuntimeError(
            "a dry run needs a process without a default process group; this one is already "
            f"rank {dist.get_rank()} of {dist.get_world_size()}"
        )
    # Cached plans hold the process groups they were made with (NOTE [Caches are keyed by
    # value]): each simulated rank gets a new world, so none may outlive it (``issued_as``
    # empties the caches on entry and exit).
    with issued_as(backend):
        dist.init_process_group(_BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size)
        try:
            yield
        finally:
            dist.destroy_process_group()
