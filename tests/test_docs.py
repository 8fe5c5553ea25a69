"""The API reference covers the public API.

`.ci/run` builds the reference with `mkdocs build --strict`, which fails on a page naming an
object that no longer exists, a broken cross-reference or a malformed numpy section. What the
build cannot see is a public name that silently drops out: the reference renders only names
with a docstring (`show_if_no_docstring: false` in mkdocs.yml), and only the modules a page
names. These tests read the package statically, as the build does, and close both gaps.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

griffe = pytest.importorskip("griffe", reason="the dev extra installs mkdocstrings' griffe")

ROOT = Path(__file__).resolve().parents[1]

# Public subpackages of shardsci that no API page renders as a module, and why.
NOT_A_PAGE = {
    "tensor": "its public names are re-exported by `shardsci` and rendered there",
    "configs": "YAML, the Hydra config groups' defaults",
    "train": "the console script `shardsci-train`",
    "predict": "the console script `shardsci-predict`",
}


def _page_targets() -> list[str]:
    """Every `::: name` an API page renders."""
    pages = sorted((ROOT / "docs" / "api").glob("*.md"))
    return [name for page in pages for name in re.findall(r"^::: (\S+)", page.read_text(), re.M)]


@pytest.fixture(scope="module")
def package():
    return griffe.load("shardsci", search_paths=[str(ROOT)], resolve_aliases=True)


def _get(package, path: str):
    return package if path == "shardsci" else package[path.removeprefix("shardsci.")]


def test_every_exported_name_of_a_documented_module_has_a_docstring(package) -> None:
    undocumented = []
    for target in _page_targets():
        module = _get(package, target)
        if not module.is_module:
            continue
        for name in module.exports or ():
            member = module[str(name)]
            if member.is_alias and not member.target_path.startswith("shardsci."):
                continue  # a re-export of another library's object (torch's placements)
            if member.docstring is None:
                undocumented.append(f"{target}.{name}")
    assert not undocumented, (
        f"public names the API reference would silently leave out (no docstring): {undocumented}"
    )


def test_every_public_subpackage_is_on_a_page(package) -> None:
    documented = {target.split(".")[1] for target in _page_targets() if "." in target}
    public = {
        name
        for name, member in package.members.items()
        if not name.startswith("_") and not member.is_alias and member.is_module
    }
    missing = sorted(public - documented - set(NOT_A_PAGE))
    assert not missing, (
        f"shardsci subpackages with no API page: {missing}; add docs/api/<name>.md and a nav "
        "entry in mkdocs.yml, or list them in NOT_A_PAGE with the reason"
    )


def test_every_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")]
    missing = sorted(page for page in pages if f": {page}\n" not in nav)
    assert not missing, f"pages mkdocs builds but no menu reaches: {missing}; add them to nav"
