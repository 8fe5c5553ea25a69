"""Every zoo model on ShardTensors equals its single-device run: forward and every parameter
gradient, float64, on 2 ranks uneven, 4 ranks with an empty shard and a 2x2 block (and 3-D
slabs and pencils for the models with 3-D variants), and the layout each returns.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard

from models import FNO, Transolver, UNet, ViT
from shardsci import attention_exchange
from shardsci.testing import (
    Layout,
    assert_all_ranks,
    check_against_reference,
    get_mesh,
    run_on_ranks,
)
from tests.layouts import Sharded

# (B, C, H, W) fields; H and W multiples of 4 (the UNet's depth 2, the ViT's patches of 2).
FIELDS = [
    Sharded("2r-H-7/5", (2,), (2, 2, 12, 8), Layout((Shard(2),), {2: (7, 5)})),
    Sharded("4r-H-4/0/6/2", (4,), (2, 2, 12, 8), Layout((Shard(2),), {2: (4, 0, 6, 2)})),
    Sharded(
        "2x2-block", (2, 2), (1, 2, 12, 8), Layout((Shard(2), Shard(3)), {2: (8, 4), 3: (2, 6)})
    ),
]
# (B, C, D, H, W) volumes.
VOLUMES = [
    Sharded("2r-D-5/3", (2,), (1, 2, 8, 6, 6), Layout((Shard(2),), {2: (5, 3)})),
    Sharded("4r-D-3/0/4/1", (4,), (1, 2, 8, 6, 6), Layout((Shard(2),), {2: (3, 0, 4, 1)})),
    Sharded(
        "2x2-pencil", (2, 2), (1, 2, 8, 6, 6), Layout((Shard(2), Shard(3)), {2: (6, 2), 3: (1, 5)})
    ),
]
CASES = {c.name: c for c in FIELDS + VOLUMES}

MODELS: dict[str, Callable[[], nn.Module]] = {
    "unet": lambda: UNet(
        in_channels=2, width=4, depth=2, norm_groups=2, blocks_per_level=1, coordinates="periodic"
    ),
    "fno": lambda: FNO(
        in_channels=2,
        width=4,
        modes=(3, 3),
        layers=2,
        projection_channels=6,
        coordinates="periodic",
        residual=True,
    ),
    "fno-padded": lambda: FNO(
        in_channels=2, width=4, modes=(3, 2), layers=2, projection_channels=6, padding=2
    ),
    "vit": lambda: ViT(in_channels=2, patch_size=2, width=8, depth=2, heads=2, mlp_ratio=2),
    "vit-ring": lambda: ViT(in_channels=2, patch_size=2, width=8, depth=1, heads=2, mlp_ratio=2),
    "transolver": lambda: Transolver(in_channels=2, width=8, layers=2, heads=2, slices=3),
    "fno-3d": lambda: FNO(
        in_channels=2,
        width=4,
        modes=(2, 2, 2),
        layers=2,
        projection_channels=6,
        coordinates="linear",
    ),
    "transolver-3d": lambda: Transolver(
        in_channels=2, spatial_dims=3, width=8, layers=1, heads=2, slices=3
    ),
}
COMBINATIONS = [(m, c.name) for m in MODELS if not m.endswith("3d") for c in FIELDS] + [
    (m, c.name) for m in MODELS if m.endswith("3d") for c in VOLUMES
]


def _layout_kept(model: str, case: Sharded) -> bool:
    """Whether the output has the input's layout, shard sizes included. Not for the ViT on a
    block (NOTE [Tokens of a block decomposition]: it returns H split over both axes), nor on
    a split that cuts through patches (the patch embedding decides who owns a patch)."""
    if not model.startswith("vit"):
        return True
    sizes = case.layout.sizes.get(2, ())
    return len(case.mesh) == 1 and all(size % 2 == 0 for size in sizes)


def _model_body(model: str, case_name: str) -> None:
    case = CASES[case_name]
    mesh = get_mesh(case.mesh)
    torch.manual_seed(0)
    module = MODELS[model]().double()
    x = torch.randn(case.shape, dtype=torch.float64)
    # Tiny keys and values are gathered (NOTE [Ring or all-gather]); "vit-ring" forces the ring.
    with attention_exchange("ring" if model == "vit-ring" else "auto"):
        out = check_against_reference(
            lambda m, a: m(a), [x], [case.layout], mesh, module=module, what=model
        )[0]
    expected = case.layout.spec(mesh, x)
    if _layout_kept(model, case):
        kept = out.placements == expected.placements and out._spec.shardings == expected.shardings
    else:
        kept = out.placements in (expected.placements, (Shard(2), Shard(2)))
    assert_all_ranks(kept, f"{model}: output {out._spec}, input {expected}")


@pytest.mark.parametrize(("model", "case"), COMBINATIONS, ids=[f"{m}-{c}" for m, c in COMBINATIONS])
def test_sharded_equals_single_device(model: str, case: str) -> None:
    run_on_ranks(CASES[case].world, _model_body, model, case)
