"""Config keys that were renamed: the old key fails with one line that names the new one.

A renamed key would otherwise fail as a misspelt one (Hydra: ``Key 'parallel' not in
'TrainConfig'``), which does not say what to write instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardsci.training._errors import ConfigError

__all__ = ["RENAMED_KEYS", "check_renamed_keys", "renamed_key_hint"]

RENAMED_KEYS: dict[str, str] = {
    "train.parallel": "train.dp_mode",
}
"""Old key -> new key. ``train.parallel`` (``ddp``/``fsdp2``) read like the ``parallel`` group
(the mesh axes' roles), a different thing."""


def check_renamed_keys(overrides: Sequence[str]) -> None:
    """Raise ``ConfigError`` naming the new key if a command-line override sets an old one
    (``train.parallel=fsdp2``, ``+train.parallel=...``, ``~train.parallel``)."""
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key in RENAMED_KEYS:
            new = RENAMED_KEYS[key]
            raise ConfigError(f"{key} was renamed {new}: write {new}={value or '<value>'}")


def renamed_key_hint(message: str) -> str | None:
    """For an error ``message`` about an old key (a config file that still sets it), the line
    that names the new one; None for any other message."""
    for old, new in RENAMED_KEYS.items():
        if f"full_key: {old}\n" in f"{message}\n" or f"'{old}'" in message:
            return f"{old} was renamed {new}"
    return None
