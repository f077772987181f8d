"""docs/trace-format.md lists every reason the trace reader rejects a file with; this keeps the two in step."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / "src" / "llmvisor" / "core"
TRACE_MODULES = [CORE / name for name in ("trace.py", "trace_schema.py", "step_trace.py", "trace_writer.py", "kv_trace.py",
                                              "lora_trace.py")]
"""The reader (`llmvisor.core.trace`) and the modules it re-exports: every rejection is worded in one of them."""
DOC = REPO / "docs" / "trace-format.md"


def text_fragments(node: ast.AST) -> list[str]:
    """The literal text of a string or f-string, split where values are filled in."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [part.value for part in node.values if isinstance(part, ast.Constant)]
    if isinstance(node, ast.IfExp):
        return text_fragments(node.body) + text_fragments(node.orelse)
    return []


def rejection_reasons() -> list[list[str]]:
    """Every reason text in the trace modules: arguments of `rejection`, `first_bad` and `TraceError`, and the
    strings the type checks return or assign as a reason."""
    reasons = []
    nodes = [node for module in TRACE_MODULES for node in ast.walk(ast.parse(module.read_text(encoding="utf-8")))]
    for node in nodes:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("rejection", "first_bad") and len(node.args) == 3:
                reasons.append(text_fragments(node.args[2]))
            elif node.func.id == "TraceError":
                reasons.append(text_fragments(node.args[0]))
        elif isinstance(node, ast.FunctionDef) and node.name == "_python_value_type_error":
            reasons += [text_fragments(n.value) for n in ast.walk(node) if isinstance(n, ast.Return) and n.value is not None]
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "reason" for t in node.targets):
            reasons.append(text_fragments(node.value))
    return [fragments for fragments in reasons if fragments]


def words(fragment: str) -> str | None:
    """The part of a literal fragment worth finding in the doc: trimmed, and only if it holds a word."""
    fragment = fragment.strip(" :;,()")
    return fragment if re.search(r"[A-Za-z]{2}", fragment) else None


def rejection_tables(doc: str) -> str:
    """The text of every "### Rejections..." section of the doc (one per version), up to the next heading."""
    sections = re.split(r"^#{2,3} ", doc, flags=re.MULTILINE)
    return "\n".join(section for section in sections if section.startswith("Rejections"))


def test_the_rejection_tables_are_found():
    tables = rejection_tables(DOC.read_text(encoding="utf-8"))
    assert "missing column(s)" in tables and "num_shared_context_tokens" in tables
    assert "## Version 2" not in tables


def test_the_scan_finds_the_reader_rejections():
    found = {fragment for fragments in rejection_reasons() for fragment in fragments}
    assert len(rejection_reasons()) >= 20
    assert "rows of this step are not contiguous in the file" in found
    assert "latency must be > 0" in found


def test_every_rejection_reason_is_in_the_doc():
    section = rejection_tables(DOC.read_text(encoding="utf-8"))
    undocumented = sorted(
        {fragment for fragments in rejection_reasons() for fragment in map(words, fragments) if fragment and fragment not in section}
    )
    assert undocumented == [], "add these to the Rejections table of docs/trace-format.md"
