"""``torch.gradient`` along split dims, against one process in float64: values, the input's
gradient, every output in the input's layout (placements and shard sizes: before, the
composite's ``x[2:] - x[:-2]`` took one slice's sizes and the boundaries moved by a cell or
two), and each rank receiving only its halo, ``edge_order`` cells on each side of its shard
(``count_traffic``). Uniform, per-dim and coordinate spacing, edge orders 1 and 2, a rank
holding a single cell at the domain's edge; uneven, empty-shard and 2x2 layouts."""

from __future__ import annotations

import math

import pytest
import torch

from shardsci.handlers import from_local_spec
from shardsci.testing import (
    assert_all_ranks,
    check_against_reference,
    count_traffic,
    get_mesh,
    run_on_ranks,
)
from tests.expected_layouts import parse

SHAPE = (7, 9)
LAYOUTS = {
    "2r-rows-uneven": ((2,), parse("S0; 0=2/5")),
    "4r-rows-empty-edge-cell": ((4,), parse("S0; 0=1/0/3/3")),
    "4r-columns-empty": ((4,), parse("S1; 1=0/4/4/1")),
    "2x2-blocks": ((2, 2), parse("S0,S1; 0=3/4; 1=6/3")),
}
X = torch.tensor([0.0, 0.5, 1.5, 1.75, 3.0, 4.5, 5.0], dtype=torch.float64)
Y = torch.linspace(-1, 1, 9, dtype=torch.float64) ** 3 + torch.arange(9) * 0.1
CALLS = {
    "gradient(u)": lambda u: torch.gradient(u),
    "spacing=0.3, dim=0": lambda u: torch.gradient(u, spacing=0.3, dim=0),
    "spacing=[2, 0.5], edge_order=2": lambda u: torch.gradient(u, spacing=[2.0, 0.5], edge_order=2),
    "coordinates, dim=(0, -1)": lambda u: torch.gradient(u, spacing=[X, Y], dim=(0, -1)),
    "coordinates, edge_order=2": lambda u: torch.gradient(u, spacing=(X, Y), edge_order=2),
}


def _body(name: str) -> None:
    mesh_shape, layout = LAYOUTS[name]
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    u = torch.randn(SHAPE, dtype=torch.float64)
    spec = layout.spec(mesh, u)
    shard = from_local_spec(spec.narrow(u).contiguous(), spec)
    local = spec.local_shape()
    for what, call in CALLS.items():
        outputs = len(call(u))
        check_against_reference(
            call, [u], [layout], mesh, out_layouts=[layout] * outputs, what=f"{name}: {what}"
        )
        edge_order = 2 if "edge_order=2" in what else 1
        with count_traffic() as traffic:
            call(shard)
        halo = sum(2 * edge_order * local.numel() // max(local[d], 1) for d in range(2))
        assert_all_ranks(
            traffic.received <= halo * u.element_size(),
            f"{name}: {what}: received {traffic.received} bytes; its halos hold at most "
            f"{halo * u.element_size()}",
        )


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gradient_keeps_the_layout(name: str) -> None:
    run_on_ranks(math.prod(LAYOUTS[name][0]), _body, name)
