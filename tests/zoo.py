"""Small instances of the zoo's models on fields, for the tests that run every model.

Each builds in float32 with the seed left to the caller; ``.double()`` them for the float64
comparisons. The 2-D models take ``(B, 2, H, W)`` fields (the ViT's patches are 2 cells), the
``-3d`` ones ``(B, 2, D, H, W)`` volumes. The MeshGraphNet, on graphs, is not among them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shardsci.models import FNO, Transolver, UNet, ViT

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

#: The exchange each ViT's attention is run with (``shardsci.attention_exchange``), so that
#: both run and neither is the cost rule's silent choice: under the default "auto", tiny keys
#: and values are gathered (NOTE [Ring or all-gather]), which the default gather policy "warn"
#: says in a GatherWarning; asked for by name, neither exchange is a gather it was not asked for.
ATTENTION_EXCHANGES = {"vit": "all_gather", "vit-ring": "ring"}


def assert_learns_a_fixed_pair(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> None:
    """40 Adam steps on one (input, target) pair at least halve the MSE loss: the model's
    parameters all reach the output and its gradients point downhill."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(40):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
