"""Schemas of the CFD recipe's config groups: the data (from the dataset generator's
``DatasetConfig``) and the evaluation (``shardsci.training.NextStepEvalConfig``); the models'
schemas come from ``shardsci.recipes.models``."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardsci.data import GenerateMode
from shardsci.recipes.cfd.generate import DatasetConfig
from shardsci.recipes.models import MODEL_SCHEMAS
from shardsci.training import NextStepEvalConfig, schema_of

__all__ = ["SCHEMAS", "CFDDataConfig"]

DatasetSchema = schema_of(DatasetConfig)


@dataclass
class CFDDataConfig:
    """The ``data`` group of the CFD recipe (``configs/data/ns2d.yaml``).

    Attributes
    ----------
    path : str
        The HDF5 file of trajectories (``data/README.md``): a file of yours, read as it is if
        it follows the schema; or one shardsci generates, under ``data/generated/``.
    generate : GenerateMode
        ``auto``: generate a missing file, or regenerate an outdated one of ours, under
        ``data/generated/`` only; ``never``: only read; ``force``: regenerate (never over a
        file of yours). NOTE [Whose data file is it] in ``shardsci/data/_files.py``.
    dataset : DatasetConfig
        How the trajectories are generated (solver, resolution, counts); a file of yours is
        what it is, and these settings do not apply to it.
    """

    path: str = "data/generated/ns2d.h5"
    generate: GenerateMode = GenerateMode.auto
    dataset: DatasetSchema = field(default_factory=DatasetSchema)  # type: ignore[valid-type]


SCHEMAS: dict[tuple[str, str], type] = {
    **MODEL_SCHEMAS,
    ("data", "ns2d_schema"): CFDDataConfig,
    ("eval", "cfd_schema"): NextStepEvalConfig,
}
"""The recipe's Hydra schemas, ``(group, name) -> dataclass`` (``Recipe.schemas``)."""
