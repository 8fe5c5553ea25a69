"""Import layering: the library never imports the model zoo or the recipes, and the model zoo
imports neither the recipes nor the library (its models are plain ``nn.Module``s).

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

# package -> top-level packages it must not import
FORBIDDEN = {
    "shardsci": ("models", "recipes"),
    "models": ("recipes", "shardsci"),
}


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path`` (a file under ``root``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path, root)
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
    """``file:line imports name`` for every forbidden import in ``package``'s sources."""
    violations = []
    for path in sorted((root / package).rglob("*.py")):
        for line, name in _imported_names(path, root):
            if name.split(".")[0] in FORBIDDEN[package]:
                violations.append(f"{path.relative_to(root)}:{line} imports {name}")
    return violations


_RUNTIME_PROBE = """
import importlib, json, pkgutil, sys
package = importlib.import_module(sys.argv[1])
for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
    importlib.import_module(info.name)
print(json.dumps(sorted(sys.modules)))
"""


def runtime_violations(package: str) -> list[str]:
    """Forbidden modules in ``sys.modules`` after importing every module of ``package``."""
    result = subprocess.run(
        [sys.executable, "-c", _RUNTIME_PROBE, package],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"importing {package} failed:\n{result.stderr}"
    loaded = json.loads(result.stdout.splitlines()[-1])
    return [name for name in loaded if name.split(".")[0] in FORBIDDEN[package]]


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
        "import models.unet\n"
        "from recipes import config\n"
        "def late():\n"
        "    from models import unet\n"
        "    importlib.import_module('recipes.cfd')\n"
        "    __import__('models')\n"
        "from . import fine\n"
    )
    assert static_violations("shardsci", root=tmp_path) == [
        f"shardsci/sub/__init__.py:{line} imports {name}"
        for line, name in [
            (1, "models.unet"),
            (2, "recipes"),
            (4, "models"),
            (5, "recipes.cfd"),
            (6, "models"),
        ]
    ]
