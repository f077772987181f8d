"""Import boundaries of the package, read from the source (AST), function-local imports included.

Applications import the core, never the other way; only `cli/` imports typer; only `engines/` imports vLLM and
torch, and only `engines/` and `cli/` import `engines/`; `engines/` does not import the service (helpers both need,
like the port helper, live below both, in `llmvisor.net`); only `report/` and `cli/` import the report package (plot
helpers live below it, in `llmvisor.plots`); nothing reaches into another module's private names.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "llmvisor"


@dataclass(frozen=True)
class Import:
    source: str  # importing module, e.g. llmvisor.cli.main
    where: str  # path:line
    module: str  # imported module, e.g. llmvisor.core.trace
    name: str | None  # the name taken from it (`from module import name`), None for `import module`
    bound: str | None = None  # the local name a module is bound to (`import a.b as c`, `from a import b`)


class Package:
    """The modules of one package folder and what each imports."""

    def __init__(self, root: Path):
        self.root = root
        self.sources = sorted(root.rglob("*.py"))
        self.imports = [imp for path in self.sources for imp in self.imports_of(path)]

    def module_name(self, path: Path) -> str:
        parts = path.relative_to(self.root.parent).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    def is_module(self, dotted: str) -> bool:
        relative = self.root.joinpath(*dotted.split(".")[1:])
        return relative.with_suffix(".py").is_file() or (relative / "__init__.py").is_file()

    def where(self, path: Path, node: ast.AST) -> str:
        return f"{path.relative_to(self.root.parent)}:{node.lineno}"

    def imports_of(self, path: Path) -> list[Import]:
        source = self.module_name(path)
        package = source if path.name == "__init__.py" else source.rpartition(".")[0]
        found = []
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Import):
                found += [Import(source, self.where(path, node), alias.name, None, alias.asname) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join([*parts[: len(parts) - node.level + 1], *([base] if base else [])])
                for alias in node.names:
                    if within(base, self.root.name) and self.is_module(f"{base}.{alias.name}"):
                        found.append(Import(source, self.where(path, node), f"{base}.{alias.name}", None, alias.asname or alias.name))
                    else:
                        found.append(Import(source, self.where(path, node), base, alias.name))
        return found

    def module_aliases(self, path: Path) -> dict[str, str]:
        """Names bound to the package's modules in one file (`from llmvisor.validation import study as v` binds v)."""
        return {i.bound: i.module for i in self.imports_of(path) if i.bound and within(i.module, self.root.name)}

    def violations(self, condition) -> list[str]:
        return sorted(f"{i.where}: {i.module}{'' if i.name is None else ' ' + i.name}" for i in self.imports if condition(i))

    def private_uses(self) -> list[str]:
        """Private names of another module of the package: imported by name, or read through a module alias."""
        found = self.violations(
            lambda i: within(i.module, self.root.name)
            and i.module != i.source
            and ((i.name is not None and private(i.name)) or any(private(part) for part in i.module.split(".")[1:]))
        )
        for path in self.sources:
            aliases = self.module_aliases(path)
            for node in ast.walk(parse(path)):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                    if private(node.attr) and aliases[node.value.id] != self.module_name(path):
                        found.append(f"{self.where(path, node)}: {aliases[node.value.id]}.{node.attr}")
        return sorted(found)


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def within(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


LLMVISOR = Package(PACKAGE)


def test_the_walk_sees_the_package():
    imports = LLMVISOR.imports
    assert len(LLMVISOR.sources) > 30
    assert any(i.source == "llmvisor.cli.main" and i.module == "typer" for i in imports)
    assert any(i.source == "llmvisor.core.model" and i.module == "llmvisor.core.trace" for i in imports)
    assert any(i.module == "llmvisor.shipped" and i.name is None for i in imports)  # `from llmvisor import shipped`


def test_only_cli_imports_typer():
    assert LLMVISOR.violations(lambda i: within(i.module, "typer", "click") and not within(i.source, "llmvisor.cli")) == []


def test_only_engines_import_vllm_and_torch():
    assert LLMVISOR.violations(lambda i: within(i.module, "vllm", "torch") and not within(i.source, "llmvisor.engines")) == []


def test_core_imports_only_core_and_errors():
    allowed = ("llmvisor.core", "llmvisor.errors")
    assert LLMVISOR.violations(lambda i: within(i.source, "llmvisor.core") and within(i.module, "llmvisor") and not within(i.module, *allowed)) == []


def test_only_engines_and_cli_import_engines():
    """The fairness experiment starts its engines as `python -m llmvisor.engines.vllm.fair_experiment`, not by import."""
    assert LLMVISOR.violations(
        lambda i: within(i.module, "llmvisor.engines") and not within(i.source, "llmvisor.engines", "llmvisor.cli")
    ) == []


def test_engines_do_not_import_the_service():
    assert LLMVISOR.violations(lambda i: within(i.source, "llmvisor.engines") and within(i.module, "llmvisor.service")) == []


def test_only_report_and_cli_import_the_report_package():
    """The demo report draws validation's and fairness's sections, so those cannot import it back."""
    assert LLMVISOR.violations(
        lambda i: within(i.module, "llmvisor.report") and not within(i.source, "llmvisor.report", "llmvisor.cli")
    ) == []


def test_no_private_names_across_modules():
    assert LLMVISOR.private_uses() == []


def test_the_checks_catch_what_they_should(tmp_path):
    """The same walk over a planted package: each kind of violation is found, and allowed imports are not."""
    root = tmp_path / "llmvisor"
    for folder in ("core", "validation", "engines", "fairness", "service", "report"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "errors.py").write_text("class LlmvisorError(Exception):\n    pass\n")
    (root / "core" / "trace.py").write_text("from llmvisor.errors import LlmvisorError\nfrom llmvisor.validation import study\n_private = 1\n")
    (root / "validation" / "study.py").write_text("import typer\nfrom ..core.trace import _private\n")
    (root / "engines" / "run.py").write_text("import vllm\nfrom . import _helpers\n")
    (root / "engines" / "_helpers.py").write_text("")
    (root / "engines" / "served.py").write_text("from llmvisor.service.process import free_loopback_port\n")
    (root / "service" / "process.py").write_text("")
    (root / "report" / "html.py").write_text("")
    (root / "validation" / "report.py").write_text("def f():\n    from llmvisor.report.html import img_tag\n")
    (root / "fairness" / "x.py").write_text(
        "def f():\n    import torch\n    from llmvisor.validation import study as v\n    from llmvisor.engines import run\n    return v._journal\n"
    )
    planted = Package(root)
    assert planted.violations(lambda i: i.module == "typer" and not within(i.source, "llmvisor.cli")) == ["llmvisor/validation/study.py:1: typer"]
    assert planted.violations(lambda i: within(i.module, "vllm", "torch") and not within(i.source, "llmvisor.engines")) == [
        "llmvisor/fairness/x.py:2: torch"
    ]
    assert planted.violations(
        lambda i: within(i.source, "llmvisor.core") and within(i.module, "llmvisor") and not within(i.module, "llmvisor.core", "llmvisor.errors")
    ) == ["llmvisor/core/trace.py:2: llmvisor.validation.study"]
    assert planted.violations(lambda i: within(i.module, "llmvisor.engines") and not within(i.source, "llmvisor.engines")) == [
        "llmvisor/fairness/x.py:4: llmvisor.engines.run"
    ]
    assert planted.violations(lambda i: within(i.source, "llmvisor.engines") and within(i.module, "llmvisor.service")) == [
        "llmvisor/engines/served.py:1: llmvisor.service.process free_loopback_port"
    ]
    assert planted.violations(lambda i: within(i.module, "llmvisor.report") and not within(i.source, "llmvisor.report", "llmvisor.cli")) == [
        "llmvisor/validation/report.py:2: llmvisor.report.html img_tag"
    ]
    assert planted.private_uses() == [
        "llmvisor/engines/run.py:2: llmvisor.engines._helpers",
        "llmvisor/fairness/x.py:5: llmvisor.validation.study._journal",
        "llmvisor/validation/study.py:2: llmvisor.core.trace _private",
    ]
