"""The run configuration's schema: typed dataclasses behind every config group.

Hydra composes ``configs/`` over these schemas (registered in its ConfigStore), so a typo or a
value of the wrong type fails when the config is composed, not hours into a run. Schemas of
components that have their own config dataclass (the UNet, the dataset) are derived from it
(``schema_of``), so fields are declared once.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from shardsci.training import LoggerConfig, ParallelConfig, ScheduleConfig

__all__ = ["LauncherConfig", "RunConfig", "TrainConfig", "register_schemas", "schema_of"]


@dataclass
class TrainConfig:
    """The training loop.

    Attributes
    ----------
    steps : int
        Optimiser steps in the run.
    global_batch : int
        Samples per step over all data-parallel ranks (must divide by the data-parallel size).
    precision : str
        ``"fp32"`` or ``"bf16"`` (autocast of the forward pass).
    grad_clip : float or None
        Clip the global gradient norm to this value.
    seed : int
        Seeds parameter initialisation and the data order.
    parallel : str
        Data parallelism on the dp axis: ``"ddp"`` or ``"fsdp2"``.
    log_every, eval_every, checkpoint_every : int
        Steps between metric logs, evaluations (held-out error, rollout, plot) and checkpoints.
    resume : str
        ``"auto"`` (the latest complete checkpoint in the run directory, if any), ``"never"``, or
        a checkpoint path.
    rollout_steps : int
        Autoregressive steps of the rollout evaluation.
    eval_samples : int
        Held-out samples per evaluation of the one-step error.
    schedule : ScheduleConfig
        The learning-rate schedule.
    """

    steps: int = 300
    global_batch: int = 16
    precision: str = "fp32"
    grad_clip: float | None = 1.0
    seed: int = 0
    parallel: str = "ddp"
    log_every: int = 10
    eval_every: int = 100
    checkpoint_every: int = 100
    resume: str = "auto"
    rollout_steps: int = 5
    eval_samples: int = 32
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)


@dataclass
class LauncherConfig:
    """How the ranks are started.

    Attributes
    ----------
    kind : str
        ``"local"``: without torchrun or SLURM variables, start the mesh's ranks on this
        machine; ``"slurm"``: Hydra's submitit launcher submits the job (``-m`` runs).
    timeout_s : float
        Timeout of every collective: a rank left waiting fails with a message after this long.
    """

    kind: str = "local"
    timeout_s: float = 600.0


@dataclass
class RunConfig:
    """The whole run (``configs/config.yaml`` composes onto this)."""

    recipe: str | None = None
    run_dir: str = MISSING
    mesh: str = "1"
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: Any = MISSING
    data: Any = MISSING
    optim: Any = MISSING
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


def schema_of(config_type: type, target: str | None = None) -> type:
    """A Hydra schema with the fields of ``config_type`` (a dataclass, possibly frozen).

    OmegaConf cannot take frozen dataclasses (read-only) or ``Literal`` types, so the schema
    is a mutable dataclass with ``Literal`` read as ``str``, tuples as lists and nested
    dataclasses as their own schemas; ``target`` adds Hydra's ``_target_``.
    """
    hints = typing.get_type_hints(config_type)
    fields = [("_target_", str, field(default=target))] if target else []
    for f in dataclasses.fields(config_type):
        kind = _omegaconf_type(hints[f.name])
        if dataclasses.is_dataclass(kind):
            fields.append((f.name, kind, field(default_factory=kind)))
        else:
            fields.append((f.name, kind, field(default=f.default)))
    return dataclasses.make_dataclass(f"{config_type.__name__}Schema", fields)


def _omegaconf_type(hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return type(typing.get_args(hint)[0])
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        inner = _omegaconf_type(options[0]) if len(options) == 1 else Any
        return inner | None
    if origin is tuple:
        return list[typing.get_args(hint)[0]]
    if dataclasses.is_dataclass(hint):
        return schema_of(hint)
    return hint


def register_schemas(groups: dict[tuple[str, str], type]) -> None:
    """Register the run schema and ``{(group, name): schema}`` with Hydra's ConfigStore."""
    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunConfig)
    for (group, name), schema in groups.items():
        store.store(group=group, name=name, node=schema)
