"""The command line of the recipes' dataset generators (``python -m shardsci.recipes.<recipe>
.generate``): one ``--field-name`` option per scalar field of the recipe's dataset config, its
nested solver config included, ``--out`` and ``--force``; the file is written if it is missing or
an outdated one of ours, never over a file shardsci did not write."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from shardsci.data import DataError, GenerateMode

__all__ = ["add_config_options", "config_from_options", "run_generator"]

logger = logging.getLogger(__name__)

Config = TypeVar("Config")


def add_config_options(parser: argparse.ArgumentParser, default: Any) -> None:
    """Add a ``--field-name`` option for each scalar field of the dataclass instance
    ``default`` and of the dataclasses nested in it (their names must not collide); an option
    not given is ``None`` (``config_from_options`` then keeps ``default``'s value)."""
    hints = typing.get_type_hints(type(default))
    for field in dataclasses.fields(default):
        value = getattr(default, field.name)
        if dataclasses.is_dataclass(value):
            add_config_options(parser, value)
            continue
        hint = hints[field.name]
        choices = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None
        parser.add_argument(
            f"--{field.name.replace('_', '-')}",
            type=str if choices else hint,
            choices=choices,
            default=None,
            help=f"{type(default).__name__}.{field.name} (default: {value!r})",
        )


def config_from_options(default: Config, options: Mapping[str, Any]) -> Config:
    """``default`` with every field that an option sets (not ``None``), nested dataclasses
    included; raises what the config's checks raise."""
    changes = {}
    for field in dataclasses.fields(default):  # type: ignore[arg-type]
        value = getattr(default, field.name)
        if dataclasses.is_dataclass(value):
            changes[field.name] = config_from_options(value, options)
        elif options.get(field.name) is not None:
            changes[field.name] = options[field.name]
    return dataclasses.replace(default, **changes)  # type: ignore[type-var]


def run_generator(
    argv: list[str] | None,
    *,
    description: str,
    default_out: Path,
    default: Config,
    ensure: Callable[[Path, Config, GenerateMode], Path],
    errors: tuple[type[Exception], ...],
) -> None:
    """Parse ``argv`` (``sys.argv[1:]`` when None) and write the dataset.

    Parameters
    ----------
    description : str
        What the command generates.
    default_out : Path
        The file written without ``--out``.
    default : dataclass instance
        The dataset config the options change.
    ensure : callable
        ``ensure(path, config, mode)``: generate the file if ``mode`` allows and it is missing
        or outdated; its path.
    errors : tuple of exception types
        What ``ensure`` raises for settings that cannot work (an unstable time step), besides
        ``DataError``: exit status 2 with one line, as for a config the options make invalid.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(
        description=f"{description} Each option sets the same-named field of the dataset's "
        f"config or of its solver config."
    )
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument(
        "--force",
        action="store_true",
        help="regenerate a file of ours even if it is up to date (never a file of yours)",
    )
    add_config_options(parser, default)
    options = vars(parser.parse_args(argv))
    started = time.perf_counter()
    try:
        config = config_from_options(default, options)
    except ValueError as error:
        parser.error(str(error))
    mode = GenerateMode.force if options["force"] else GenerateMode.auto
    try:
        path = ensure(options["out"], config, mode)
    except (*errors, DataError) as error:
        parser.error(str(error))
    logger.info("%s ready in %.1f s", path, time.perf_counter() - started)
