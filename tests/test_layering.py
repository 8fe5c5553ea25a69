"""Import layering: the library never imports the model zoo or the recipes, and the model zoo
imports neither the recipes nor the library (its models are plain ``nn.Module``s).

The zoo and the recipes are installed inside the ``shardsci`` package (``shardsci.models``,
``shardsci.recipes``; NOTE [How shardsci's top-level directories are installed]), so "the
library" is ``shardsci`` without them, without its configs and without the commands ``shardsci.train``
and ``shardsci.predict`` (and what they share, ``shardsci._commands``), which sit above the
recipes as ``train.py`` did.

Checked twice: statically, every import statement (top-level or inside a function, relative
ones resolved, ``importlib.import_module`` / ``__import__`` of a literal name) of every source
file; and at runtime, by importing every module of a package in a fresh interpreter and
listing what ended up in ``sys.modules``.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

APPLICATION = (
    "shardsci.models",
    "shardsci.recipes",
    "shardsci.configs",
    "shardsci.train",
    "shardsci.predict",
    "shardsci._commands",
)
"""Modules inside the ``shardsci`` package that are not the library."""

# package -> (its source directory, the packages it must not import)
FORBIDDEN = {
    "shardsci": ("shardsci", ("shardsci.models", "shardsci.recipes")),
    "shardsci.models": ("models", ("shardsci.recipes", "shardsci")),
}


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _forbidden(importer: str, name: str) -> bool:
    """Whether package ``importer`` may not import module ``name``: the most specific of the
    importer and its forbidden packages that contains ``name`` decides (the zoo may import
    itself, ``shardsci.models``, but nothing else of ``shardsci``)."""
    owners = [p for p in (importer, *FORBIDDEN[importer][1]) if _within(name, p)]
    return bool(owners) and max(owners, key=len) != importer


def _module_name(path: Path, directory: Path, package: str) -> str:
    """The module a file under ``package``'s source ``directory`` is imported as."""
    parts = (package, *path.relative_to(directory).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(path: Path, directory: Path, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, a file of ``package`` (whose
    sources are in ``directory``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path, directory, package)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((node.lineno, base))
        elif (
            isinstance(node, ast.Call)
            and _called_name(node.func) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def _called_name(func: ast.expr) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def static_violations(package: str, root: Path = ROOT) -> list[str]:
    """``file:line imports name`` for every forbidden import in ``package``'s sources (symlinked
    directories, the application modules inside ``shardsci``, are not walked)."""
    directory = root / FORBIDDEN[package][0]
    violations = []
    for path in sorted(directory.rglob("*.py")):
        module = _module_name(path, directory, package)
        if any(_within(module, app) for app in APPLICATION if not _within(package, app)):
            continue
        for line, name in _imported_names(path, directory, package):
            if _forbidden(package, name):
                violations.append(f"{path.relative_to(root)}:{line} imports {name}")
    return violations


_RUNTIME_PROBE = """
import importlib, json, pkgutil, sys
import shardsci
before = set(sys.modules)
skip = sys.argv[2:]
def walk(package):
    for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
        if not any(info.name == s or info.name.startswith(s + ".") for s in skip):
            module = importlib.import_module(info.name)
            if info.ispkg:
                walk(module)
walk(importlib.import_module(sys.argv[1]))
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def runtime_violations(package: str) -> list[str]:
    """Forbidden modules that importing every module of ``package`` (but not the application
    modules inside ``shardsci``) adds to what ``import shardsci`` loads."""
    skip = [name for name in APPLICATION if not _within(package, name)]
    result = subprocess.run(
        [sys.executable, "-c", _RUNTIME_PROBE, package, *skip],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"importing {package} failed:\n{result.stderr}"
    loaded = json.loads(result.stdout.splitlines()[-1])
    return [name for name in loaded if _forbidden(package, name)]


@pytest.mark.parametrize("package", list(FORBIDDEN))
def test_no_forbidden_import_statement(package: str) -> None:
    assert static_violations(package) == []


@pytest.mark.parametrize("package", list(FORBIDDEN))
def test_importing_every_module_loads_no_forbidden_package(package: str) -> None:
    assert runtime_violations(package) == []


def test_the_static_check_finds_imports_in_every_spelling(tmp_path: Path) -> None:
    (tmp_path / "shardsci" / "sub").mkdir(parents=True)
    (tmp_path / "shardsci" / "__init__.py").write_text("")
    (tmp_path / "shardsci" / "sub" / "__init__.py").write_text(
        "import shardsci.models.unet\n"
        "from shardsci.recipes import config\n"
        "def late():\n"
        "    from ..models import unet\n"
        "    importlib.import_module('shardsci.recipes.cfd')\n"
        "    __import__('shardsci.models')\n"
        "from . import fine\n"
        "from shardsci.tensor import ShardTensor\n"
    )
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text(
        "from shardsci.models.unet import UNet\nfrom .unet import UNet\nimport shardsci.tensor\n"
    )
    assert static_violations("shardsci", root=tmp_path) == [
        f"shardsci/sub/__init__.py:{line} imports {name}"
        for line, name in [
            (1, "shardsci.models.unet"),
            (2, "shardsci.recipes"),
            (4, "shardsci.models"),
            (5, "shardsci.recipes.cfd"),
            (6, "shardsci.models"),
        ]
    ]
    assert static_violations("shardsci.models", root=tmp_path) == [
        "models/__init__.py:3 imports shardsci.tensor"
    ]
