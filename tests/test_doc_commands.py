"""Every ``llmvisor`` command line in README.md and docs/*.md code blocks names a command that exists and only
options that command defines, so a renamed or removed command or option cannot stay in the docs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer

from llmvisor.cli import app

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def command_lines(text: str) -> list[str]:
    """The ``llmvisor ...`` invocations of a document's fenced blocks (after any ``VAR=value`` words) and its inline code spans that start with ``llmvisor``: continuations
    joined, comments dropped, one per ``;``/``&&``/``|``-separated part."""
    found = []
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line)
            for part in re.split(r";|&&|\s\|\s", line):
                words = part.split()
                start = next((i for i, word in enumerate(words) if not re.match(r"^\w+=", word)), len(words))
                if start < len(words) and (words[start] == "llmvisor" or words[start].endswith("/llmvisor")):
                    found.append(" ".join(words[start:]))
    for span in re.findall(r"(?<!`)`(llmvisor [^`\n]+)`(?!`)", FENCE.sub("", text)):  # inline: `llmvisor serve --db URL`
        found.append(" ".join(span.split()))
    return found


def resolve(words: list[str]) -> tuple:
    """The command the words name (subcommands followed from the top), and the words after it."""
    command = typer.main.get_command(app)
    words = [w.strip("[]") for w in words[1:]]
    while hasattr(command, "get_command") and words and not words[0].startswith("-"):
        name = words.pop(0)
        sub = command.get_command(typer.Context(command), name)
        assert sub is not None, f"no command {name!r}"
        command = sub
    return command, words


def options_of(command) -> set[str]:
    return {name for param in command.params for name in (*param.opts, *param.secondary_opts)} | {"--help"}


CASES = [(path.relative_to(REPO).as_posix(), line) for path in DOCS for line in command_lines(path.read_text(encoding="utf-8"))]


def test_the_docs_show_commands():
    assert len(CASES) > 40 and {"README.md", "docs/service.md", "docs/recorder.md"} <= {doc for doc, _ in CASES}


@pytest.mark.parametrize(("doc", "line"), CASES, ids=[f"{doc}:{line[:60]}" for doc, line in CASES])
def test_each_documented_command_and_option_exists(doc, line):
    command, rest = resolve(line.split())
    known = options_of(command)
    used = {re.split(r"[=\[\]|]", word.strip("[]"))[0] for word in rest if word.strip("[]").startswith("--")}
    assert used <= known, f"{doc}: `{line}` uses {sorted(used - known)}, which `{command.name}` does not define"
