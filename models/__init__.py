"""Model zoo: plain single-device ``nn.Module``\\ s that shardsci runs domain-parallel unchanged."""

from models.fno import FNO, FNOConfig
from models.unet import UNet, UNetConfig

__all__ = ["FNO", "FNOConfig", "UNet", "UNetConfig"]
