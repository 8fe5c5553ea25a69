"""Common ops that returned a replicated output where their input was sharded (found by the
op-database sweep, ``tests/op_db_sweep.py``), against the single-process reference: forward,
gradients, float64, uneven and empty shards, 1-D and 2x2 meshes, and the output's stated
layout (NOTE [Outputs keep their input's layout]).

- ``cat`` along a sharded dim with an operand held whole (a plain tensor that needs a
  gradient, which arrives as a replicated ShardTensor): its cells join the rank holding the
  cells just before them, so the sharded operand's cells stay where they are.
- ``split`` / ``chunk`` along a sharded dim: each piece keeps each rank's own elements.
- convolutions with their input channels sharded: the channels are made whole, the spatial
  shardings kept (the axes that sharded channels replicate the output).
- a square grid sharded along H, flattened and viewed back (MONAI's UNETR): H again, not W
  (NOTE [An unflatten returns to the layout before the flatten]).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from shardsci import gather_policy
from shardsci.testing import Layout, check_against_reference, get_mesh, run_on_ranks
from tests.expected_layouts import transposed_anchor, window_anchor, windowed

F64 = torch.float64


def _cat_body(mesh_shape: tuple[int, ...], layout: Layout, after: Layout, before: Layout) -> None:
    """``x`` (5, 5) sharded along dim 1, ``y`` (5, 4) plain: ``cat([x, y])`` and
    ``cat([y, x])`` along dim 1, laid out as ``after`` and ``before``."""
    mesh = get_mesh(mesh_shape)
    x, y = torch.randn(5, 5, dtype=F64), torch.randn(5, 4, dtype=F64)
    for what, fn, expected in (
        ("x, y", lambda a, b: torch.cat([a, b], dim=-1), after),
        ("y, x", lambda a, b: torch.cat([b, a], dim=1), before),
    ):
        check_against_reference(fn, [x, y], [layout, None], mesh, out_layouts=[expected], what=what)


CAT = {
    "4r-0/3/1/1": (
        (4,),
        Layout((Shard(1),), {1: (0, 3, 1, 1)}),
        Layout((Shard(1),), {1: (0, 3, 1, 5)}),
        Layout((Shard(1),), {1: (4, 3, 1, 1)}),
    ),
    "2x2-uneven": (
        (2, 2),
        Layout((Shard(0), Shard(1)), {0: (2, 3), 1: (2, 3)}),
        Layout((Shard(0), Shard(1)), {0: (2, 3), 1: (2, 7)}),
        Layout((Shard(0), Shard(1)), {0: (2, 3), 1: (6, 3)}),
    ),
}


@pytest.mark.parametrize("case", list(CAT))
def test_cat_with_an_operand_held_whole_keeps_the_sharded_cells_in_place(case: str) -> None:
    mesh_shape, *layouts = CAT[case]
    run_on_ranks(math.prod(mesh_shape), _cat_body, mesh_shape, *layouts)


ONE_D = Layout((Shard(0),), {0: (2, 3)})
BLOCK = Layout((Shard(0), Shard(1)), {0: (2, 3), 1: (2, 3)})
# name -> (split, layout of the (5, 5, 5) input, mesh, split dim, each piece's sizes along it)
SPLITS = {
    "split(2)": (lambda a: torch.split(a, 2), ONE_D, (2,), 0, [(2, 0), (0, 2), (0, 1)]),
    "chunk(2)": (lambda a: torch.chunk(a, 2), ONE_D, (2,), 0, [(2, 1), (0, 2)]),
    "2x2-split([1, 3, 1], 1)": (
        lambda a: a.split([1, 3, 1], 1),
        BLOCK,
        (2, 2),
        1,
        [(1, 0), (1, 2), (0, 1)],
    ),
}


def _split_body(name: str) -> None:
    fn, layout, mesh_shape, dim, pieces = SPLITS[name]
    x = torch.randn(5, 5, 5, dtype=F64)
    expected = [Layout(layout.placements, {**layout.sizes, dim: p}) for p in pieces]
    check_against_reference(fn, [x], [layout], get_mesh(mesh_shape), out_layouts=expected)


@pytest.mark.parametrize("name", list(SPLITS))
def test_split_along_a_sharded_dim_keeps_each_ranks_elements(name: str) -> None:
    run_on_ranks(math.prod(SPLITS[name][2]), _split_body, name)


def _conv_body() -> None:
    """(N, C, L) with C and L sharded on a 2x2 mesh, as the sweep's 2x2-uneven layout does;
    a 2-D convolution likewise with C and H sharded. The channels are gathered (each output
    cell reads all of them: ``_conv_ops``' docstring), the spatial shards kept."""
    mesh = get_mesh((2, 2))
    for what, fn, shape, weight in (
        ("conv1d", lambda a, w: F.conv1d(a, w, stride=2, padding=2), (1, 3, 4), (3, 3, 3)),
        ("conv2d", lambda a, w: F.conv2d(a, w, stride=2, padding=2), (1, 3, 4, 4), (3, 3, 3, 3)),
        ("conv_transpose1d", lambda a, w: F.conv_transpose1d(a, w, stride=2, padding=2),
         (2, 3, 5), (3, 2, 3)),
    ):  # fmt: skip
        layout = Layout((Shard(1), Shard(2)), {1: (1, 2), 2: (1, shape[2] - 1)})
        spatial = Layout((Replicate(), Shard(2)), {2: (1, shape[2] - 1)})
        anchor = (transposed_anchor if "transpose" in what else window_anchor)(3, 2, 2, 1)
        expected = windowed(spatial, shape, (2, 2), {2: anchor})
        with gather_policy("allow"):  # the channels made whole, as `_conv_ops` says
            check_against_reference(
                fn,
                [torch.randn(shape, dtype=F64), torch.randn(weight, dtype=F64)],
                [layout, None],
                mesh,
                out_layouts=[expected],
                what=what,
            )


def test_convolutions_with_sharded_channels_keep_the_spatial_shards() -> None:
    run_on_ranks(4, _conv_body)


def _square_grid_body() -> None:
    mesh = get_mesh((2,))
    for shape, sizes in (((1, 12, 2, 2), (1, 1)), ((1, 2, 32, 32), (20, 12))):
        check_against_reference(
            lambda a, s=shape: a.flatten(2).view(s),
            [torch.randn(shape, dtype=F64)],
            [Layout((Shard(2),), {2: sizes})],
            mesh,
            out_layouts=[Layout((Shard(2),), {2: sizes})],
            what=str(shape),
        )


def test_a_square_grid_flattened_and_viewed_back_is_sharded_along_h_again() -> None:
    run_on_ranks(2, _square_grid_body)


# name -> (mesh, input shape, its layout, normalized_shape, the statistics' layout)
LAYER_NORMS = {
    "rows-whole": ((2,), (3, 4, 5), Layout((Shard(1),), {1: (1, 3)}), [4, 5],
                   Layout((Replicate(),))),
    "2x2-rows-sharded": ((2, 2), (5, 4, 6), Layout((Shard(0), Shard(2)), {0: (2, 3), 2: (2, 4)}),
                         [6], Layout((Shard(0), Replicate()), {0: (2, 3)})),
}  # fmt: skip


def _native_layer_norm_body(name: str) -> None:
    """``torch.native_layer_norm`` (aten's, with the row statistics) keeps the input's layout;
    the statistics are sharded like the rows and replicated over the normalised dims' axes."""
    mesh_shape, shape, layout, normalized, stats = LAYER_NORMS[name]
    weight, bias = torch.randn(normalized, dtype=F64), torch.randn(normalized, dtype=F64)
    check_against_reference(
        lambda a, w, b: torch.native_layer_norm(a, normalized, w, b, 1e-5),
        [torch.randn(shape, dtype=F64), weight, bias],
        [layout, None, None],
        get_mesh(mesh_shape),
        out_layouts=[layout, stats, stats],
    )


@pytest.mark.parametrize("name", list(LAYER_NORMS))
def test_native_layer_norm_keeps_the_layout(name: str) -> None:
    run_on_ranks(math.prod(LAYER_NORMS[name][0]), _native_layer_norm_body, name)
