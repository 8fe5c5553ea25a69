"""Watch the library from outside: every collective and every layout change, as they happen.

# NOTE [Taps on record_comm and redistribute_local]
Every collective shardsci issues reaches ``record_comm`` (NOTE [What a byte count means]) and
every change of a shard's layout ``redistribute_local``. ``tapped(function, tap)`` makes
every loaded ``shardsci`` module that binds ``function`` call ``tap(function, *args)``
instead, for the duration of the block, and restores the bindings on exit, so a tool (the dry
run's observer, the probe that finds compilable regions) sees each event wherever in the
library it comes from, a module added later included, with no hook in the library itself.
Taps nest: an inner tap wraps whatever the outer one bound.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["tapped"]


@contextmanager
def tapped(function: Callable, tap: Callable) -> Iterator[None]:
    """Route every call of ``function`` from a loaded shardsci module through
    ``tap(function, *args, **kwargs)`` inside the block."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return tap(function, *args, **kwargs)

    bound = [
        (module, attribute)
        for name, module in list(sys.modules.items())
        if name.startswith("shardsci.") and module is not None
        for attribute, value in list(vars(module).items())
        if value is function
    ]
    for module, attribute in bound:
        setattr(module, attribute, wrapper)
    try:
        yield
    finally:
        for module, attribute in bound:
            setattr(module, attribute, function)
