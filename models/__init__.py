"""Model zoo: plain single-device ``nn.Module``\\ s that shardsci runs domain-parallel unchanged."""

from models.fno import FNO, FNOConfig
from models.meshgraphnet import MeshGraphNet, MeshGraphNetConfig
from models.transolver import Transolver, TransolverConfig
from models.unet import UNet, UNetConfig
from models.vit import ViT, ViTConfig

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
