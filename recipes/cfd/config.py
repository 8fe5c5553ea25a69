"""Schemas of the CFD recipe's config groups: the model (from ``UNetConfig``), the data (from
the dataset generator's ``DatasetConfig``) and the optimiser."""

from __future__ import annotations

from dataclasses import dataclass, field

from models import UNetConfig
from recipes.cfd.generate import DatasetConfig
from recipes.config import register_schemas, schema_of

__all__ = ["CFDDataConfig", "register"]

DatasetSchema = schema_of(DatasetConfig)


@dataclass
class CFDDataConfig:
    """The ``data`` group of the CFD recipe.

    Attributes
    ----------
    path : str
        The HDF5 file of trajectories; generated on first use (or regenerated when its
        metadata does not match ``dataset``).
    dataset : DatasetConfig
        How the trajectories are generated (solver, resolution, counts).
    """

    path: str = "data/generated/ns2d.h5"
    dataset: DatasetSchema = field(default_factory=DatasetSchema)  # type: ignore[valid-type]


@dataclass
class AdamWConfig:
    """The ``optim`` group: ``torch.optim.AdamW``, instantiated partially (parameters later)."""

    _target_: str = "torch.optim.AdamW"
    _partial_: bool = True
    lr: float = 1e-3
    weight_decay: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])


def register() -> None:
    """Register the CFD recipe's schemas (and the run schema) with Hydra."""
    register_schemas(
        {
            ("model", "unet_schema"): schema_of(UNetConfig, target="models.UNet"),
            ("data", "ns2d_schema"): CFDDataConfig,
            ("optim", "adamw_schema"): AdamWConfig,
        }
    )
