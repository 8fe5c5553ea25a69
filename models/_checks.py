"""Validation shared by the zoo's config dataclasses: one clear line per bad field."""

from __future__ import annotations

from typing import get_args

__all__ = ["check_choice", "check_non_negative", "check_positive"]


def check_positive(name: str, value: object) -> None:
    """Raise unless ``value`` is an ``int`` >= 1."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_non_negative(name: str, value: object) -> None:
    """Raise unless ``value`` is an ``int`` >= 0."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


def check_choice(name: str, value: object, choices: object) -> None:
    """Raise unless ``value`` is one of the arguments of the ``Literal`` type ``choices``."""
    allowed = get_args(choices)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
