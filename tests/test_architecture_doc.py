"""docs/architecture.md names modules and folders by path; each must exist, so the page cannot outlive the tree."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "src" / "llmvisor"
PATH = re.compile(r"`((?:[\w-]+/)*[\w-]+\.py|(?:[\w-]+/)+)`")


def named_paths(text: str) -> list[str]:
    """The code spans of the page that are file or folder paths (``core/trace.py``, ``client/``, ``tests/x.py``)."""
    return sorted(set(PATH.findall(text)))


def exists(path: str) -> bool:
    """Under the repository for ``tests/`` and ``src/`` paths, else under ``src/llmvisor``; a module ``x.py`` also
    counts as there when the tree holds it as the package ``x/``."""
    base = REPO if path.startswith(("tests/", "src/")) else PACKAGE
    target = base / path
    return target.exists() or (path.endswith(".py") and (target.with_suffix("") / "__init__.py").is_file())


def test_every_path_the_architecture_page_names_exists():
    paths = named_paths((REPO / "docs" / "architecture.md").read_text(encoding="utf-8"))
    assert len(paths) > 40 and "core/trace.py" in paths and "ledger/steps.py" in paths
    assert [path for path in paths if not exists(path)] == []


def test_the_check_catches_a_path_that_is_gone():
    assert named_paths("`core/game.py`, `client/`, `service/routes/steps.py`") == ["client/", "core/game.py", "service/routes/steps.py"]
    assert exists("core/game.py") and exists("tests/test_imports.py") and exists("data/usage-page/")
    assert not exists("core/gone.py") and not exists("service/nothing/")


def test_readme_links_the_page():
    assert "(docs/architecture.md)" in (REPO / "README.md").read_text(encoding="utf-8")
