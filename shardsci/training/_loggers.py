"""Metric logging: always a JSON-lines file in the run directory, optionally wandb.

wandb runs offline unless the config says otherwise (``logger.mode``), so no run ever needs
the network; ``logger=none`` turns wandb off.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["LoggerConfig", "LoggerKind", "MetricLogger", "WandbMode"]


class LoggerKind(enum.Enum):
    """Where metrics go besides ``metrics.jsonl`` (``logger.kind``)."""

    wandb = "wandb"
    none = "none"


class WandbMode(enum.Enum):
    """wandb's ``mode`` (``logger.mode``)."""

    offline = "offline"
    online = "online"
    disabled = "disabled"


@dataclass
class LoggerConfig:
    """The ``logger`` config group.

    Attributes
    ----------
    kind : LoggerKind
        ``wandb`` or ``none``.
    project : str
        wandb project name.
    mode : WandbMode
        wandb mode: ``offline`` (default: files under the run directory, no network),
        ``online`` or ``disabled``.
    entity : str or None
        wandb entity (team), for online runs.
    """

    kind: LoggerKind = LoggerKind.wandb
    project: str = "shardsci"
    mode: WandbMode = WandbMode.offline
    entity: str | None = None


class MetricLogger:
    """Writes metrics on one rank: ``metrics.jsonl`` in the run directory, and wandb.

    Parameters
    ----------
    config : LoggerConfig
    run_dir : Path
    run_config : dict
        The resolved run configuration, recorded with the run.
    enabled : bool
        True on exactly one rank.
    """

    def __init__(self, config: LoggerConfig, run_dir: Path, run_config: dict, enabled: bool):
        self._enabled = enabled
        self._file = open(run_dir / "metrics.jsonl", "a") if enabled else None  # noqa: SIM115
        self._wandb = None
        if enabled and config.kind is LoggerKind.wandb:
            import wandb

            self._wandb = wandb.init(
                project=config.project,
                entity=config.entity,
                mode=config.mode.value,
                dir=str(run_dir),
                config=run_config,
                reinit="finish_previous",
            )

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if not self._enabled:
            return
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
