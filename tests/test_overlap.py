"""The overlap option gives the synchronous result, forward and gradients, and overlaps: the
halo's messages are in flight while the interior is computed (NOTE [Overlap is an order of
events])."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard

import shardsci
from shardsci.testing import (
    Layout,
    check_against_reference,
    count_traffic,
    get_mesh,
    run_on_ranks,
)
from tests.expected_layouts import module_anchors, windowed

CONVS = {
    "k3": dict(kernel_size=3, padding=1),
    "k5-stride2": dict(kernel_size=5, stride=2, padding=2),
    "k3-valid": dict(kernel_size=3),
    "k3-dilation2": dict(kernel_size=3, padding=2, dilation=2),
}


def _body(sizes, name, mode) -> None:
    torch.manual_seed(0)
    module = nn.Conv2d(2, 3, padding_mode=mode, dtype=torch.float64, **CONVS[name])
    x = torch.randn(2, 2, sum(sizes), 6, dtype=torch.float64)
    layout = Layout((Shard(2),), {2: sizes})
    mesh = (len(sizes),)
    expected = windowed(layout, x.shape, mesh, module_anchors(module, x.ndim))
    with shardsci.overlap_halos():
        check_against_reference(
            lambda m, a: m(a),
            [x],
            [layout],
            get_mesh(mesh),
            module=module,
            out_layouts=[expected],
            what=name,
        )


@pytest.mark.parametrize("mode", ["zeros", "circular"])
@pytest.mark.parametrize("name", list(CONVS))
@pytest.mark.parametrize("sizes", [(9, 5), (6, 0, 2, 8)], ids=["9/5", "6/0/2/8"])
def test_overlapped_conv_matches_reference(sizes, name, mode) -> None:
    run_on_ranks(len(sizes), _body, sizes, name, mode)


# ---------------------------------------------------------------------------- order of events
# NOTE [Overlap is an order of events]
# Whether a convolution overlapped its halo exchange is read from the order of events that
# ``count_traffic`` logs at the dispatcher, not from timings: a received message is overlapped
# when a convolution (forward) or its backward ran after the message was posted and before
# the message was first read (nothing can read it before it arrived). Under ``overlap_halos()``
# every rank with interior outputs overlaps the faces' exchange of each convolution, forward
# and backward; a circular padding also exchanges the boundary rows, synchronously, in the pad.
COMPUTE = {"forward": "aten::convolution", "backward": "aten::convolution_backward"}


def overlapped_receives(log: list, compute: str) -> tuple[int, int]:
    """(receives overlapped by a call of ``compute``, receives) in a ``Traffic.log``."""
    posted: dict[int, int] = {}
    overlapped = set()
    for position, event in enumerate(log):
        if event.what == "post" and event.message is not None:
            posted[event.message] = position
        elif event.what == "read":
            between = log[posted[event.message] + 1 : position]
            if any(e.what == "op" and e.op == compute for e in between):
                overlapped.add(event.message)
    return len(overlapped), len(posted)


def _exchanged_at_once(start_extend):
    """``start_extend`` that finishes the exchange before returning: overlap turned off
    inside the overlap path (the negative control)."""

    def start(local, ext, fill=0.0):
        shard, finish = start_extend(local, ext, fill)
        extended = finish()
        return shard, lambda: extended

    return start


def _event_order(mode: str, overlap: bool, sabotage: bool) -> dict[str, tuple[int, int]]:
    from shardsci.tensor._ops import _windows

    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3, padding=1, padding_mode=mode, dtype=torch.float64)
    x = torch.randn(2, 2, 14, 6, dtype=torch.float64)
    xs = shardsci.distribute_tensor(x, get_mesh((2,)), [Shard(2)], {0: (9, 5)})
    xs.requires_grad_()
    original = _windows.start_extend
    if sabotage:
        _windows.start_extend = _exchanged_at_once(original)
    try:
        with shardsci.overlap_halos(overlap):
            with count_traffic(watch=COMPUTE.values()) as forward:
                out = conv(xs)
            with count_traffic(watch=COMPUTE.values()) as backward:
                out.to_local().sum().backward()
    finally:
        _windows.start_extend = original
    return {
        "forward": overlapped_receives(forward.log, COMPUTE["forward"]),
        "backward": overlapped_receives(backward.log, COMPUTE["backward"]),
    }


@pytest.mark.parametrize("mode", ["zeros", "circular"])
def test_overlap_posts_the_halo_before_the_interior_and_reads_it_after(mode) -> None:
    exchanges = 2 if mode == "circular" else 1  # the pad's boundary rows, then the faces
    for rank, passes in enumerate(run_on_ranks(2, _event_order, mode, True, False)):
        for name, (overlapped, receives) in passes.items():
            assert (overlapped, receives) == (1, exchanges), (rank, name, passes)


@pytest.mark.parametrize(
    "overlap, sabotage", [(False, False), (True, True)], ids=["off", "exchanged-at-once"]
)
def test_the_order_check_fails_without_overlap(overlap, sabotage) -> None:
    """Negative controls: the synchronous path, and the overlap path with its exchange
    finished before the interior is computed, overlap nothing."""
    for passes in run_on_ranks(2, _event_order, "zeros", overlap, sabotage):
        assert {name: o for name, (o, _) in passes.items()} == {"forward": 0, "backward": 0}
