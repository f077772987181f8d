"""README.md's Layout block lists every package and top-level module of ``src/llmvisor`` as the tree holds them
now (read at test time), names nothing that is gone, and the Install table has a row for every extra."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "src" / "llmvisor"
ENTRY = re.compile(r"^  ([A-Za-z_]\w*)(/|\.py)(?=\s|$)", re.M)


def layout_block(readme: str) -> str:
    section = readme[readme.index("## Layout") :]
    return re.search(r"^```\n(.*?)^```", section, re.S | re.M).group(1)


def tree(root: Path) -> tuple[set[str], set[str], set[str]]:
    """Top-level packages (a folder with ``__init__.py``), top-level modules, and the packages below them (by path)."""
    packages = {p.parent.name for p in root.glob("*/__init__.py")}
    modules = {p.stem for p in root.glob("*.py") if p.name != "__init__.py"}
    nested = {p.parent.relative_to(root).as_posix() for p in root.glob("*/*/**/__init__.py")}
    return packages, modules, nested


def layout_problems(readme: str, root: Path = PACKAGE) -> list[str]:
    """What the Layout block gets wrong about the tree under ``root``. A top-level entry may be written as a package
    (``name/``) or a module (``name.py``), so a module split into a package of the same name keeps its line."""
    block = layout_block(readme)
    entries = {name for name, _ in ENTRY.findall(block)}
    packages, modules, nested = tree(root)
    folders = {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))}
    problems = [f"package {name}/ has no line in README's Layout" for name in sorted(packages - entries)]
    problems += [f"module {name}.py has no line in README's Layout" for name in sorted(modules - entries)]
    problems += [f"Layout names {name}, which src/llmvisor does not hold" for name in sorted(entries - packages - modules - folders)]
    problems += [f"package {path}/ is not named ({path.rsplit('/', 1)[-1]}/) in README's Layout" for path in sorted(nested)
                 if f"{path.rsplit('/', 1)[-1]}/" not in block]  # fmt: skip
    return problems


def test_readme_layout_lists_every_package_and_module_of_the_tree():
    assert layout_problems((REPO / "README.md").read_text(encoding="utf-8")) == []


def test_the_layout_check_catches_an_omission_and_a_stale_line():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    without_billing = re.sub(r"^  billing/.*\n(?:^ {4,}\S.*\n)*", "", readme, flags=re.M)
    assert layout_problems(without_billing) == ["package billing/ has no line in README's Layout"]
    without_net = re.sub(r"^  net\.py .*\n", "", readme, flags=re.M)
    assert layout_problems(without_net) == ["module net.py has no line in README's Layout"]
    stale = readme.replace("  plots.py ", "  plots.py \n  gone/           a package that was removed\n  ", 1)
    assert layout_problems(stale) == ["Layout names gone, which src/llmvisor does not hold"]


def test_readme_install_table_has_a_row_per_extra():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| `\[(\w+)\]` \|", readme, re.M))
    assert set(extras) - {"test"} == rows
