"""Scans along a sharded dim (cumsum, logcumsumexp, cumprod, cummax, cummin) against one process, float64.

Values, the input's gradient (cumprod's also with zeros in the dim, cummax's and cummin's with
ties across shards), the output's layout (the input's placements and shard sizes, for cummax's
and cummin's indices too), and the traffic by ``count_traffic``: each rank receives one slice
(cummax, cummin: a value and an index) of every other shard along the scanned dim's axes, never
the dim itself, in the forward and (cumprod, cummax, cummin) in the backward.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import Shard

from shardsci.handlers import from_local_spec
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    check_against_reference,
    count_traffic,
    get_mesh,
    run_on_ranks,
)

# (mesh, layout of a (3, 10, 4) input scanned along dim 1)
LAYOUTS = {
    "2r-uneven": ((2,), Layout((Shard(1),), {1: (7, 3)})),
    "4r-empty": ((4,), Layout((Shard(1),), {1: (3, 0, 5, 2)})),
    "2x2-nested": ((2, 2), Layout((Shard(1), Shard(1)), {1: (2, 0, 5, 3)}, {1: (1, 0)})),
    "2x2-scanned-and-batch": ((2, 2), Layout((Shard(0), Shard(1)), {0: (2, 1), 1: (4, 6)})),
}

SCANS = {
    "cumsum": lambda x: torch.cumsum(x, 1),
    "cumsum, an integer input": lambda x: torch.cumsum((x * 4).long(), 1, dtype=torch.float64),
    "logcumsumexp": lambda x: torch.logcumsumexp(x, 1),
    "cumprod": lambda x: torch.cumprod(x, 1),
    "cumprod, zeros in the dim": lambda x: (x * (x.abs() > 0.5)).cumprod(1),
}
# values and global indices; two slices (a value and an index) from each shard
EXTREMA = {"cummax": lambda x: torch.cummax(x, 1), "cummin": lambda x: x.cummin(1)}


def _scan_body(name: str) -> None:
    mesh_shape, layout = LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(3, 10, 4, dtype=torch.float64)
    for what, fn in SCANS.items():
        check_against_reference(
            fn, [x], [layout], mesh, out_layouts=[layout], grad=what != "cumsum, an integer input",
            what=f"{name}: {what}",
        )  # fmt: skip
    ties = (x * 2).round() / 2  # equal values across shards: the later index wins
    for what, fn in EXTREMA.items():
        for data, kind in ((x, ""), (ties, ", ties")):
            check_against_reference(
                fn,
                [data],
                [layout],
                mesh,
                out_layouts=[layout, layout],
                what=f"{name}: {what}{kind}",
            )
    spec = layout.spec(mesh, x)
    shard = from_local_spec(spec.narrow(x).contiguous(), spec)
    sharding = spec.sharding_by_dim[1]
    slice_bytes = math.prod(1 if d == 1 else n for d, n in enumerate(spec.local_shape())) * 8
    others = math.prod(mesh_shape[a] for a in sharding.axes) - 1
    bounds = {**dict.fromkeys(SCANS, 1), **dict.fromkeys(EXTREMA, 2)}
    for what, fn in {**SCANS, **EXTREMA}.items():
        with count_traffic() as traffic:
            fn(shard)
        _assert_slices(traffic, bounds[what] * others, slice_bytes, f"{name}: {what}")
    for what, fn in {"cumprod": SCANS["cumprod"], **EXTREMA}.items():
        leaf = shard.detach().requires_grad_()
        out = fn(leaf)
        values = out if isinstance(out, torch.Tensor) else out[0]
        with count_traffic() as traffic:
            values.backward(torch.ones_like(values))
        _assert_slices(traffic, bounds[what] * others, slice_bytes, f"{name}: {what}'s backward")


def _assert_slices(traffic, slices: int, slice_bytes: int, what: str) -> None:
    assert_all_ranks(
        traffic.received <= slices * slice_bytes,
        f"{what} received {traffic.received} bytes, more than {slices} slices of "
        f"{slice_bytes}: {traffic.as_dict()}",
    )


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_scan_along_a_sharded_dim_keeps_its_shards(name: str) -> None:
    run_on_ranks(math.prod(LAYOUTS[name][0]), _scan_body, name)
