"""Schemas of the 3-D CFD recipe's config groups: the data (from the dataset generator's
``DatasetConfig``) and the evaluation (``shardsci.training.NextStepEvalConfig``); the models'
schemas come from ``shardsci.recipes.models``."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardsci.data import GenerateMode
from shardsci.recipes.cfd3d.generate import DatasetConfig
from shardsci.recipes.models import MODEL_SCHEMAS
from shardsci.training import NextStepEvalConfig, schema_of

__all__ = ["SCHEMAS", "CFD3dDataConfig"]

DatasetSchema = schema_of(DatasetConfig)


@dataclass
class CFD3dDataConfig:
    """The ``data`` group of the 3-D CFD recipe (``configs/data/ns3d.yaml``).

    Attributes
    ----------
    path : str
        The HDF5 file of velocity trajectories ``(trajectory, time, 3, D, H, W)``
        (``data/README.md``): a file of yours, read as it is if it follows the schema; or one
        shardsci generates, under ``data/generated/``.
    generate : GenerateMode
        ``auto``: generate a missing file, or regenerate an outdated one of ours, under
        ``data/generated/`` only; ``never``: only read; ``force``: regenerate (never over a
        file of yours). NOTE [Whose data file is it] in ``shardsci/data/_files.py``.
    dataset : DatasetConfig
        How the trajectories are generated (solver, resolution, counts); a file of yours is
        what it is, and these settings do not apply to it.
    augment : bool
        Map each training batch by one of the 48 rotations and reflections of the box, drawn
        per step (``symmetry.py``): the equations and the forcing commute with them, so each
        training pair stands for 48.
    """

    path: str = "data/generated/ns3d.h5"
    generate: GenerateMode = GenerateMode.auto
    dataset: DatasetSchema = field(default_factory=DatasetSchema)  # type: ignore[valid-type]
    augment: bool = True


SCHEMAS: dict[tuple[str, str], type] = {
    **MODEL_SCHEMAS,
    ("data", "ns3d_schema"): CFD3dDataConfig,
    ("eval", "cfd3d_schema"): NextStepEvalConfig,
}
"""The recipe's Hydra schemas, ``(group, name) -> dataclass`` (``Recipe.schemas``)."""
