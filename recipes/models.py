"""Hydra schemas of the zoo's models, for every recipe's ``model`` group.

``configs/model/<name>.yaml`` names ``<name>_schema`` in its defaults list; the schema is the
model's own config dataclass (``schema_of``), so a typo, a wrong type or a mistyped choice
fails when the config is composed. Adding a model: one line in ``ZOO`` and one yaml file.
"""

from __future__ import annotations

from shardsci.models import FNOConfig, MeshGraphNetConfig, TransolverConfig, UNetConfig, ViTConfig
from shardsci.training import schema_of

__all__ = ["MODEL_SCHEMAS", "ZOO"]

ZOO: dict[str, tuple[type, str]] = {
    "unet": (UNetConfig, "shardsci.models.UNet"),
    "fno": (FNOConfig, "shardsci.models.FNO"),
    "vit": (ViTConfig, "shardsci.models.ViT"),
    "transolver": (TransolverConfig, "shardsci.models.Transolver"),
    "meshgraphnet": (MeshGraphNetConfig, "shardsci.models.MeshGraphNet"),
}
"""Model option name -> (its config dataclass, the class Hydra instantiates)."""

MODEL_SCHEMAS: dict[tuple[str, str], type] = {
    ("model", f"{name}_schema"): schema_of(config, target=target)
    for name, (config, target) in ZOO.items()
}
"""``("model", "<name>_schema") -> schema``, for a recipe's ``Recipe.schemas``."""
