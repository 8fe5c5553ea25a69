"""Model zoo: plain single-device ``nn.Module``\\ s that shardsci runs domain-parallel unchanged."""

from models.unet import UNet, UNetConfig

__all__ = ["UNet", "UNetConfig"]
