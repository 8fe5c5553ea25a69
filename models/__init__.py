"""Model zoo: plain single-device ``nn.Module``\\ s that shardsci runs domain-parallel unchanged."""

from shardsci.models.fno import FNO, FNOConfig
from shardsci.models.meshgraphnet import MeshGraphNet, MeshGraphNetConfig
from shardsci.models.transolver import Transolver, TransolverConfig
from shardsci.models.unet import UNet, UNetConfig
from shardsci.models.vit import ViT, ViTConfig

__all__ = [
    "FNO",
    "FNOConfig",
    "MeshGraphNet",
    "MeshGraphNetConfig",
    "Transolver",
    "TransolverConfig",
    "UNet",
    "UNetConfig",
    "ViT",
    "ViTConfig",
]
