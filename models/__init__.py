"""Model zoo: plain single-device ``nn.Module``\\ s that shardsci runs domain-parallel unchanged."""

from shardsci.models.meshgraphnet import MeshGraphNet, MeshGraphNetConfig
from shardsci.models.unet import UNet, UNetConfig

__all__ = ["MeshGraphNet", "MeshGraphNetConfig", "UNet", "UNetConfig"]
