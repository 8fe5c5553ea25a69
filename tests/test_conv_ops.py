"""Convolutions, transposed convolutions and padding on spatially sharded tensors against the
single-process reference: forward, input and parameter gradients, float64, every padding mode,
uneven and empty shards, 1-D meshes and a 2x2 block decomposition."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

from shardsci.tensor._ops import _windows
from shardsci.testing import Layout, check_against_reference, get_mesh, run_on_ranks
from tests.expected_layouts import module_anchors, pad_anchors, windowed
from tests.layouts import SPATIAL_2D, Sharded

CONV2D = {
    "k3": dict(kernel_size=3, padding=1),
    "k3-stride2": dict(kernel_size=3, stride=2, padding=1),
    "k4-stride2": dict(kernel_size=4, stride=2, padding=1),
    "k2-stride2": dict(kernel_size=2, stride=2),
    "k3-dilation2": dict(kernel_size=3, dilation=2, padding=2),
    "k4-same": dict(kernel_size=4, padding="same"),
    "k3-valid": dict(kernel_size=3, padding="valid"),
    "k5-stride3": dict(kernel_size=5, stride=3),
    "groups2": dict(kernel_size=3, padding=1, groups=2),
    "rect-k(3,1)": dict(kernel_size=(3, 1), padding=(1, 0)),
}
MODES = ["zeros", "circular", "reflect", "replicate"]


def _conv2d_body(case: Sharded, name: str, mode: str) -> None:
    torch.manual_seed(0)
    channels = case.shape[1]
    config = CONV2D[name]
    channels_out = 2 * config["groups"] if config.get("groups") else 3
    module = nn.Conv2d(channels, channels_out, padding_mode=mode, dtype=torch.float64, **config)
    x = torch.randn(case.shape, dtype=torch.float64)
    _check_module(module, x, case)


def _check_module(module: nn.Module, x: torch.Tensor, case: Sharded, what: str = "") -> None:
    """Each output cell on the rank holding its window's centre (NOTE [Which rank owns an
    output of a windowed op])."""
    expected = windowed(case.layout, case.shape, case.mesh, module_anchors(module, x.ndim))
    check_against_reference(
        lambda m, a: m(a),
        [x],
        [case.layout],
        get_mesh(case.mesh),
        module=module,
        out_layouts=[expected],
        what=what or type(module).__name__,
    )


def _valid(configs: dict[str, dict]) -> list[tuple[Sharded, str]]:
    """(layout, config) pairs whose channels the config's groups divide."""
    return [
        (case, name)
        for case in SPATIAL_2D
        for name, config in configs.items()
        if case.shape[1] % config.get("groups", 1) == 0
    ]


@pytest.mark.parametrize(("case", "name"), _valid(CONV2D), ids=lambda v: str(v))
@pytest.mark.parametrize("mode", MODES)
def test_conv2d(case: Sharded, name: str, mode: str) -> None:
    run_on_ranks(case.world, _conv2d_body, case, name, mode)


CONV_TRANSPOSE2D = {
    "k2-stride2": dict(kernel_size=2, stride=2),
    "k4-stride2-pad1": dict(kernel_size=4, stride=2, padding=1),
    "k3-same": dict(kernel_size=3, padding=1),
    "k3-stride2-outpad1": dict(kernel_size=3, stride=2, padding=1, output_padding=1),
    "k3-dilation2": dict(kernel_size=3, dilation=2, padding=1),
    "groups": dict(kernel_size=3, stride=2, groups=2),
}


def _conv_transpose_body(case: Sharded, name: str) -> None:
    torch.manual_seed(0)
    config = CONV_TRANSPOSE2D[name]
    module = nn.ConvTranspose2d(case.shape[1], 4, dtype=torch.float64, **config)
    x = torch.randn(case.shape, dtype=torch.float64)
    _check_module(module, x, case, name)


@pytest.mark.parametrize(("case", "name"), _valid(CONV_TRANSPOSE2D), ids=lambda v: str(v))
def test_conv_transpose2d(case: Sharded, name: str) -> None:
    run_on_ranks(case.world, _conv_transpose_body, case, name)


PADS = {
    "constant": ((2, 1, 3, 0), "constant", 1.5),
    "reflect": ((1, 2, 2, 1), "reflect", None),
    "replicate": ((3, 0, 1, 4), "replicate", None),
    "circular": ((2, 2, 1, 3), "circular", None),
    # only W padded, H cropped: the local op is given the whole list (torch's replicate pad
    # refuses a 4-D input with one padded dim)
    "replicate, H cropped": ((2, 1, -1, 0), "replicate", None),
}


def _pad_body(case: Sharded, name: str) -> None:
    pad, mode, value = PADS[name]
    x = torch.randn(case.shape, dtype=torch.float64)
    kwargs = {} if value is None else {"value": value}
    check_against_reference(
        lambda a: F.pad(a, pad, mode=mode, **kwargs),
        [x],
        [case.layout],
        get_mesh(case.mesh),
        out_layouts=[windowed(case.layout, case.shape, case.mesh, pad_anchors(pad, x.ndim))],
        what=name,
    )


@pytest.mark.parametrize("case", SPATIAL_2D, ids=str)
@pytest.mark.parametrize("name", list(PADS))
def test_pad(case: Sharded, name: str) -> None:
    run_on_ranks(case.world, _pad_body, case, name)


# ---------------------------------------------------------------------------- unsplit dims
# NOTE [A windowed op on unsplit dims is the local op]: one rank, or H sharded over an axis of
# size 1 beside a sharded batch: torch's op on the shard, no halo extension planned or run.
UNSPLIT = [
    Sharded("1r-H", (1,), (2, 3, 11, 6), Layout((Shard(2),), {2: (11,)})),
    Sharded("2x1-N-H", (2, 1), (2, 3, 11, 6), Layout((Shard(0), Shard(2)), {0: (1, 1)})),
]


def _unsplit_body(case: Sharded, op: str, name: str) -> None:
    extensions = mock.patch.object(_windows, "extend", wraps=_windows.extend)
    with extensions as extend:
        if op == "conv":
            zeros = name == "constant"
            _conv2d_body(case, "k4-same" if zeros else "k3", "zeros" if zeros else PADS[name][1])
        else:
            _pad_body(case, name)
    assert extend.call_count == 0, f"{extend.call_count} halo extensions on unsplit dims"


@pytest.mark.parametrize("case", UNSPLIT, ids=str)
@pytest.mark.parametrize("op", ["conv", "pad"])
@pytest.mark.parametrize("name", list(PADS))
def test_unsplit_dims_run_the_local_op(case: Sharded, op: str, name: str) -> None:
    run_on_ranks(case.world, _unsplit_body, case, op, name)


# ---------------------------------------------------------------------------- 1-D and 3-D
def _conv1d_body(sizes, mode) -> None:
    module = nn.Conv1d(2, 3, 3, padding=1, padding_mode=mode, dtype=torch.float64)
    x = torch.randn(2, 2, sum(sizes), dtype=torch.float64)
    layout = Layout((Shard(2),), {2: sizes})
    _check_module(module, x, Sharded("1d", (len(sizes),), tuple(x.shape), layout))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sizes", [(5, 4), (2, 0, 6, 1)], ids=["5/4", "2/0/6/1"])
def test_conv1d(sizes, mode) -> None:
    run_on_ranks(len(sizes), _conv1d_body, sizes, mode)


def _conv3d_body(mode, transpose) -> None:
    if transpose:
        module = nn.ConvTranspose3d(2, 2, 2, stride=2, dtype=torch.float64)
    else:
        module = nn.Conv3d(2, 2, 3, padding=1, padding_mode=mode, dtype=torch.float64)
    x = torch.randn(1, 2, 5, 6, 4, dtype=torch.float64)
    layout = Layout((Shard(2), Shard(3)), {2: (3, 2), 3: (2, 4)})
    _check_module(module, x, Sharded("2x2-3d", (2, 2), tuple(x.shape), layout))


@pytest.mark.parametrize("mode", MODES)
def test_conv3d_block(mode) -> None:
    run_on_ranks(4, _conv3d_body, mode, False)


def test_conv_transpose3d_block() -> None:
    run_on_ranks(4, _conv3d_body, "zeros", True)


# ---------------------------------------------------------------------------- autograd steps
def _graph_nodes(root) -> list[str]:
    seen, names, stack = set(), [], [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def _one_step_body() -> dict[str, object]:
    import shardsci

    torch.manual_seed(0)
    whole = torch.randn(1, 2, 9, 5, dtype=torch.float64)
    weight = torch.randn(3, 2, 3, 3, dtype=torch.float64)
    x = shardsci.distribute_tensor(whole, get_mesh((2,)), [Shard(2)], {0: (5, 4)})
    x.requires_grad_()
    y = F.conv2d(F.pad(x, (1, 1, 1, 1)), weight)  # the pad is local, the conv exchanges
    nodes = _graph_nodes(y.grad_fn)
    y.to_local().square().sum().backward()
    leaf = whole.clone().requires_grad_()
    expected = F.conv2d(F.pad(leaf, (1, 1, 1, 1)), weight)
    expected.square().sum().backward()
    return {
        "to_local steps": nodes.count("_ToLocalBackward"),
        "extension steps": nodes.count("_ExtendShardBackward") + nodes.count("_ExtendBackward"),
        "layout": (tuple(y.placements), y._spec.sharding_by_dim[2].sizes),
        "values": torch.allclose(y.full_tensor(), expected.detach(), rtol=1e-12, atol=1e-12),
        "grad": torch.allclose(x.grad.full_tensor(), leaf.grad, rtol=1e-12, atol=1e-12),
    }


def test_a_halo_extension_is_one_autograd_step() -> None:
    """NOTE [A shard extended in one autograd step]: the convolution's halo exchange records
    one node, not ``to_local``'s and the extension's (the pad's ``to_local`` stays: its local
    pad's backward is torch's); values and the input's gradient are one process's, float64."""
    for result in run_on_ranks(2, _one_step_body):
        assert result == {
            "to_local steps": 1,
            "extension steps": 1,
            "layout": ((Shard(2),), (5, 4)),
            "values": True,
            "grad": True,
        }, result


# A dilated transposed convolution whose windows reach past the domain (OpInfo's
# conv_transpose2d sample 2): along W (kernel 5, stride 2, padding 2, dilation 4, output
# padding 3) output 18 reads input 2 alone and output 20 input 3 alone, though both are
# centred beyond the domain, on input 3 when clamped; outputs 12-17 read inputs 1 and 3.
# Each output that reads one shard's cells alone is on that shard, the others on their
# centre's owner held between those (NOTE [Which rank owns an output of a windowed op]).
# Along H (kernel 4, stride 3, padding 1, dilation 4) the lone readers' shards decrease
# along the dim, so H keeps the centres' rule. (mesh, input layout, output layout)
LONE_READERS = {
    "4r-W-empty": (
        (4,),
        Layout((Shard(3),), {3: (0, 2, 1, 1)}),
        Layout((Shard(3),), {3: (0, 10, 9, 3)}),
    ),
    "2r-W": ((2,), Layout((Shard(3),), {3: (3, 1)}), Layout((Shard(3),), {3: (19, 3)})),
    "2x2-last": (
        (2, 2),
        Layout((Shard(2), Shard(3)), {2: (1, 3), 3: (3, 1)}),
        Layout((Shard(2), Shard(3)), {2: (8, 14), 3: (19, 3)}),
    ),
}


def _lone_readers_body(name: str) -> None:
    mesh_shape, layout, out_layout = LONE_READERS[name]
    torch.manual_seed(0)
    module = nn.ConvTranspose2d(
        2, 4, (4, 5), stride=(3, 2), padding=(1, 2), output_padding=(2, 3), groups=2,
        dilation=(4, 4), dtype=torch.float64,
    )  # fmt: skip
    x = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    check_against_reference(
        lambda m, a: m(a),
        [x],
        [layout],
        get_mesh(mesh_shape),
        module=module,
        out_layouts=[out_layout],
        what=f"{name}: dilated ConvTranspose2d",
    )


@pytest.mark.parametrize("name", list(LONE_READERS))
def test_an_output_reading_one_shard_alone_is_on_it(name: str) -> None:
    run_on_ranks(math.prod(LONE_READERS[name][0]), _lone_readers_body, name)
