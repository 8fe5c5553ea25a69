"""``gather_policy("allow")`` scoped to the calls of the cases that state a gather.

The rank pool runs a body under its caller's warning filters, so pytest's
``error::shardsci.GatherWarning`` fails a body whose op gathers behind its back. A case whose
expected result *is* what the guard counts (a pending sum held whole, a replicated read, a
gathered op: NOTE [Gathers an op was not asked to make]) wraps that one call, and only when
the case states it, in ``allowed_if(...)``; a later call that gathers still fails the case.
``gather_policy`` is per process: set here, inside the rank body, it reaches the op.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from torch.distributed.tensor import Partial

from shardsci import gather_policy
from shardsci.testing import Layout


def allowed_if(stated: bool) -> AbstractContextManager[object]:
    """``gather_policy("allow")`` where ``stated``, else a block that changes nothing."""
    return gather_policy("allow") if stated else nullcontext()


def pending(layout: Layout | None) -> bool:
    """Whether an expected output is a pending sum (``Partial`` over some mesh axis)."""
    return layout is not None and any(isinstance(p, Partial) for p in layout.placements)
