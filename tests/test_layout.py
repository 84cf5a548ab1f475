"""The house's walls: twin/ and executor/ never import each other, plan/ imports neither, only the CLI package
starts the executor, no module outgrows a reader, and the README's layout table is the tree."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = ROOT / "twin" / "cli"
MAX_LINES = 400  # HOUSE_STYLE.md: modules a reader can hold in mind


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize(
    ("package", "forbidden"), [("twin", ("executor",)), ("executor", ("twin",)), ("plan", ("twin", "executor"))]
)
def test_packages_keep_to_their_contract(package: str, forbidden: tuple[str, ...]) -> None:
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sources(package)
        for name in imported_modules(path)
        if name.split(".")[0] in forbidden
    ]
    assert not bad, bad


def test_only_the_cli_package_starts_the_executor() -> None:
    """No module of the product outside twin/cli/ starts a process or names the executor's entry points."""
    bad = []
    for package in ("twin", "plan"):
        for path in sources(package):
            if path.is_relative_to(LAUNCHER):
                continue
            text = path.read_text()
            if "subprocess" in imported_modules(path) or re.search(
                r"executor\.(train|bench)|torch\.distributed\.run", text
            ):
                bad.append(str(path.relative_to(ROOT)))
    assert not bad, bad


@pytest.mark.parametrize("package", ["plan", "twin", "executor"])
def test_no_module_outgrows_a_reader(package: str) -> None:
    long = {str(p.relative_to(ROOT)): n for p in sources(package) if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_readme_layout_table_is_the_tree() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## What is here", 1)[1].split("\n## ", 1)[0]
    paths = re.findall(r"^\| `([^`]+)` \|", section, flags=re.M)
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"the README's table names paths that do not exist: {missing}"
    listed = {p.rstrip("/") for p in paths}
    top = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")} - {"runs", "build", "dist"}
    top = {t for t in top if not t.endswith(".egg-info") and t != "__pycache__"}
    rooms = {f"twin/{p.name}" for p in (ROOT / "twin").iterdir() if p.is_dir() and p.name != "__pycache__"}
    unlisted = sorted((top | rooms) - listed - {"twin"})
    assert not unlisted, f"directories the README's table does not describe: {unlisted}"
