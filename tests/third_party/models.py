"""The third-party models, declared: what to build, on which field, how to call it, what
layout its output must have, and which shims it needs.

Models are tiny (widths 4-16, fields of 16 x 16 or 32 x 32 cells) and built from a fixed seed
in float64, unchanged: each is its package's own class with constructor arguments only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import Shard

from shardsci.testing import ExpectedLayout, Layout
from tests.expected_layouts import windowed
from tests.third_party.shims import NEURALOP_COMPLEX128, Shim


# ---------------------------------------------------------------------------- fields and layouts
@dataclass(frozen=True)
class Field:
    """A model input and the layouts it is sharded in.

    Attributes
    ----------
    shape : tuple of int
        Global shape: ``(B, C, H, W)`` for images, ``(B, L, D)`` for token sequences.
    layouts : dict
        Layout name -> (mesh shape, Layout). Every field has the same three names: ``1d``
        (2 ranks, uneven), ``empty`` (4 ranks, one empty shard) and ``2x2`` (a 2 x 2 mesh,
        uneven in opposite directions on its two dims).
    """

    shape: tuple[int, ...]
    layouts: dict[str, tuple[tuple[int, ...], Layout]]


def _image(batch: int, channels: int, n: int) -> Field:
    """``(B, C, n, n)`` split along H unevenly (5/8 and 3/8), along H with rank 0 empty, and in
    H x W blocks uneven in opposite directions."""
    big, small = 5 * n // 8, n - 5 * n // 8
    return Field(
        (batch, channels, n, n),
        {
            "1d": ((2,), Layout((Shard(2),), {2: (big, small)})),
            "empty": ((4,), Layout((Shard(2),), {2: (0, big - small, small, small)})),
            "2x2": ((2, 2), Layout((Shard(2), Shard(3)), {2: (big, small), 3: (small, big)})),
        },
    )


#: Token sequences (B, L, D): tokens split unevenly, with rank 0 empty, and batch x tokens.
TOKENS = Field(
    (3, 12, 8),
    {
        "1d": ((2,), Layout((Shard(1),), {1: (7, 5)})),
        "empty": ((4,), Layout((Shard(1),), {1: (0, 5, 4, 3)})),
        "2x2": ((2, 2), Layout((Shard(0), Shard(1)), {0: (2, 1), 1: (5, 7)})),
    },
)
IMAGE_16 = _image(2, 1, 16)
IMAGE_32 = _image(1, 1, 32)  # for the models that patch by 16 (UNETR) or downsample by 32 (Swin)
LAYOUT_NAMES = ("1d", "empty", "2x2")


# ---------------------------------------------------------------------------- the cases
def _forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def _denoise(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """diffusers' UNet2DModel at diffusion step 10 (a plain int timestep)."""
    return module(x, 10).sample


def _same_layout(layout: Layout, shape: Sequence[int], mesh: Sequence[int]) -> ExpectedLayout:
    """The input's placements and shard sizes (an output with the input's spatial dims)."""
    return layout


def _pixel_shuffled(layout: Layout, shape: Sequence[int], mesh: Sequence[int]) -> ExpectedLayout:
    """Pixel shuffle by 2: output row ``j`` comes from input row ``j // 2`` (the window rule)."""
    return windowed(layout, shape, mesh, {2: lambda j: j // 2, 3: lambda j: j // 2})


@dataclass(frozen=True)
class ThirdPartyCase:
    """One third-party model.

    Attributes
    ----------
    name : str
        Test id.
    package : str
        The import name of the package it comes from (the case skips without it).
    build : callable
        ``build() -> nn.Module`` in float64, called under a fixed seed with the shims applied.
    field : Field
        Its input.
    call : callable
        ``call(module, x)`` -> the output compared with the reference.
    expected : callable
        ``expected(input layout, input shape, mesh shape)`` -> the output's layout.
    shims : tuple of Shim
        Fixes of the package's own bugs, applied to both runs.
    """

    name: str
    package: str
    build: Callable[[], nn.Module]
    field: Field
    call: Callable[[nn.Module, torch.Tensor], torch.Tensor] = _forward
    expected: Callable[[Layout, Sequence[int], Sequence[int]], ExpectedLayout] = _same_layout
    shims: tuple[Shim, ...] = field(default_factory=tuple)


def _fno() -> nn.Module:
    from neuralop.models import FNO

    return FNO(n_modes=(4, 4), in_channels=1, out_channels=1, hidden_channels=4, n_layers=2)


def _tfno() -> nn.Module:
    from neuralop.models import TFNO

    return TFNO(
        n_modes=(4, 4),
        in_channels=1,
        out_channels=1,
        hidden_channels=4,
        n_layers=2,
        factorization="tucker",
        rank=0.5,
    )


def _uno() -> nn.Module:
    from neuralop.models import UNO

    return UNO(
        1,
        1,
        hidden_channels=4,
        lifting_channels=8,
        projection_channels=8,
        n_layers=3,
        uno_out_channels=[4, 4, 4],
        uno_n_modes=[[4, 4], [2, 2], [4, 4]],
        uno_scalings=[[1, 1], [0.5, 0.5], [2, 2]],
        channel_mlp_skip="linear",
    )


def _monai_unet_batch_norm() -> nn.Module:
    from monai.networks.nets import UNet

    return UNet(2, 1, 2, channels=(4, 8, 16), strides=(2, 2), num_res_units=1, norm="batch")


def _monai_basic_unet() -> nn.Module:
    from monai.networks.nets import BasicUNet

    return BasicUNet(2, 1, 2, features=(4, 4, 8, 8, 16, 4))


def _monai_attention_unet() -> nn.Module:
    from monai.networks.nets import AttentionUnet

    return AttentionUnet(2, 1, 2, channels=(4, 8, 16), strides=(2, 2))


def _monai_segresnet() -> nn.Module:
    from monai.networks.nets import SegResNet

    return SegResNet(
        spatial_dims=2, init_filters=4, in_channels=1, out_channels=2, blocks_down=(1, 1, 1),
        blocks_up=(1, 1), norm=("GROUP", {"num_groups": 2}),
    )  # fmt: skip


def _monai_swin_unetr() -> nn.Module:
    from monai.networks.nets import SwinUNETR

    # Group norm: instance norm refuses the 1 x 1 bottleneck of a 32 x 32 input.
    return SwinUNETR(
        in_channels=1, out_channels=2, depths=(1, 1, 1, 1), num_heads=(1, 1, 2, 2),
        window_size=4, feature_size=12, spatial_dims=2, norm_name=("group", {"num_groups": 1}),
    )  # fmt: skip


def _monai_unetr() -> nn.Module:
    from monai.networks.nets import UNETR

    return UNETR(
        in_channels=1, out_channels=2, img_size=(32, 32), feature_size=4, hidden_size=12,
        mlp_dim=24, num_heads=2, spatial_dims=2,
    )  # fmt: skip


def _diffusers_unet() -> nn.Module:
    from diffusers import UNet2DModel

    return UNet2DModel(
        sample_size=16, in_channels=1, out_channels=1, block_out_channels=(8, 16),
        layers_per_block=1, norm_num_groups=4, attention_head_dim=4,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    )  # fmt: skip


def _transformer_encoder_layer() -> nn.Module:
    return nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)


def _transformer_encoder() -> nn.Module:
    """Two pre-norm layers with a final norm, as nn.TransformerEncoder stacks them."""
    layer = nn.TransformerEncoderLayer(
        8, 2, dim_feedforward=16, dropout=0.0, batch_first=True, norm_first=True
    )
    return nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(8), enable_nested_tensor=False)


def _espcn() -> nn.Module:
    """ESPCN (Shi et al. 2016): three convolutions, then a sub-pixel shuffle by 2."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 5, padding=2),
        nn.Tanh(),
        nn.Conv2d(8, 4, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.PixelShuffle(2),
    )


_NEURALOP = (NEURALOP_COMPLEX128,)
CASES = {
    c.name: c
    for c in (
        ThirdPartyCase("fno", "neuralop", _fno, IMAGE_16, shims=_NEURALOP),
        ThirdPartyCase("tfno", "neuralop", _tfno, IMAGE_16, shims=_NEURALOP),
        ThirdPartyCase("uno", "neuralop", _uno, IMAGE_16, shims=_NEURALOP),
        ThirdPartyCase("monai-unet-batchnorm", "monai", _monai_unet_batch_norm, IMAGE_16),
        ThirdPartyCase("monai-basicunet", "monai", _monai_basic_unet, IMAGE_32),
        ThirdPartyCase("monai-attentionunet", "monai", _monai_attention_unet, IMAGE_16),
        ThirdPartyCase("monai-segresnet", "monai", _monai_segresnet, IMAGE_16),
        ThirdPartyCase("monai-swinunetr", "monai", _monai_swin_unetr, IMAGE_32),
        ThirdPartyCase("monai-unetr", "monai", _monai_unetr, IMAGE_32),
        ThirdPartyCase("diffusers-unet2d", "diffusers", _diffusers_unet, IMAGE_16, _denoise),
        ThirdPartyCase("torch-encoder-layer", "torch", _transformer_encoder_layer, TOKENS),
        ThirdPartyCase("torch-encoder", "torch", _transformer_encoder, TOKENS),
        ThirdPartyCase("espcn-pixelshuffle", "torch", _espcn, IMAGE_16, expected=_pixel_shuffled),
    )
}
