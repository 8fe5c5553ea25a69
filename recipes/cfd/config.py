"""Schemas of the CFD recipe's config groups: the data (from the dataset generator's
``DatasetConfig``) and the evaluation; the models' schemas come from ``shardsci.recipes.models``."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardsci.data import GenerateMode
from shardsci.recipes.cfd.generate import DatasetConfig
from shardsci.recipes.models import MODEL_SCHEMAS
from shardsci.training import schema_of

__all__ = ["SCHEMAS", "CFDDataConfig", "CFDEvalConfig"]

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


@dataclass
class CFDEvalConfig:
    """The ``eval`` group of the CFD recipe (``configs/eval/cfd.yaml``): what each evaluation (every ``train.eval_every``
    steps, and at the end) measures on the held-out trajectories.

    Attributes
    ----------
    samples : int or None
        Held-out (t, t + 1) pairs for the one-step error, spread evenly over the held-out
        trajectories and times; None: every pair (the default, so the error is the mean over
        all held-out trajectories and times).
    rollout_steps : int
        Autoregressive steps of the rollout, from the middle snapshot of each held-out
        trajectory (or the latest start that leaves this many steps).
    """

    samples: int | None = None
    rollout_steps: int = 10


SCHEMAS: dict[tuple[str, str], type] = {
    **MODEL_SCHEMAS,
    ("data", "ns2d_schema"): CFDDataConfig,
    ("eval", "cfd_schema"): CFDEvalConfig,
}
"""The recipe's Hydra schemas, ``(group, name) -> dataclass`` (``Recipe.schemas``)."""
