"""The schema of a whole run: what ``configs/config.yaml`` composes onto.

Generic groups are typed here (``train``, ``parallel``, ``logger``, ``launcher``, ``optim``
options); the recipe-owned groups (``model``, ``data``, ``eval``) are typed by the schemas the
recipe registers (NOTE [How train.py finds recipes]). Choices are Enums, so a mistyped choice
fails when the config is composed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from shardsci.training._launcher import LauncherConfig
from shardsci.training._loggers import LoggerConfig
from shardsci.training._parallelism import ParallelConfig
from shardsci.training._trainer import TrainConfig

__all__ = ["AdamWConfig", "RunConfig", "register_run_schemas"]


@dataclass
class AdamWConfig:
    """The ``optim`` group's ``adamw``: ``torch.optim.AdamW``, instantiated partially (the
    parameters come later)."""

    _target_: str = "torch.optim.AdamW"
    _partial_: bool = True
    lr: float = 1e-3
    weight_decay: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])


@dataclass
class RunConfig:
    """The whole run (``configs/config.yaml`` composes onto this).

    Attributes
    ----------
    recipe : str or None
        The registered recipe to run (``+recipe=<name>``).
    run_dir : str
        One directory for every rank's files.
    mesh : str
        The shape of the run's DeviceMesh, ranks per axis: ``"1"``, ``"8"``, ``"4x2"``,
        ``"2x2x2"``; ``-1`` infers one axis (under torchrun or srun).
    parallel : ParallelConfig
        What each mesh axis does (the ``parallel`` group: ``auto``, ``slab``, ``block``).
    model, data, eval : recipe schemas
        Chosen by the recipe's config (``configs/recipe/<name>.yaml``).
    dry_run : bool
        Plan the run instead of running it (``shardsci.planning``): memory, collectives and
        layouts per rank class, in one process, without data.
    device_memory_gib : float or None
        Memory of one device; a dry run reports a rank whose peak exceeds it.
    """

    recipe: str | None = None
    run_dir: str = MISSING
    mesh: str = "1"
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: Any = MISSING
    data: Any = MISSING
    eval: Any = None
    optim: Any = MISSING
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dry_run: bool = False
    device_memory_gib: float | None = None


def register_run_schemas() -> None:
    """Store the run schema and the generic groups' schemas in Hydra's ConfigStore."""
    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunConfig)
    store.store(group="optim", name="adamw_schema", node=AdamWConfig)
