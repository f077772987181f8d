"""Conventions every command shares, applied in one place rather than per option.

- Readable metavars (FILE, DIR, N, NUM, TEXT) instead of Python type names, and none on flags.
- Renamed options: an old spelling still works, with one warning line on stderr naming the new one.
- Output paths checked before any work starts, so a run never fails at the end for want of a folder.
- Period bounds (`--start`, `--end`) read one way: an ISO 8601 time (naive means UTC) or Unix seconds.
- A ledger a command only reads must exist: a mistyped SQLite path would be created empty and read as no usage.
"""

from __future__ import annotations

import os
import typing
from datetime import UTC, datetime
from pathlib import Path

import typer
from typer.core import TyperArgument

from llmvisor.errors import LlmvisorError

RENAMED_OPTIONS: dict[str, dict[str, str]] = {
    "profile": {"--model": "--engine-model"},
    "validate": {"--latency-model": "--model", "--n-bootstrap": "--bootstrap"},
    "fairness": {"--latency-model": "--model"},
    "fleet": {"--latency-model": "--model"},
    "demo": {"--output-dir": "--output"},
    "refit": {"--trace": "--from-trace"},
}
"""Per command, old option spelling -> new. ``--model`` is the latency model in every command that has one and
the engine model's old name in `llmvisor profile` only (which has no latency model); one concept, one name:
``--bootstrap``, ``--output``, ``--from-trace``."""


Bootstrap = typing.Annotated[int, typer.Option("--bootstrap", help="Bootstrap resamples for the 95% intervals (0: none).", min=0)]
"""Every command's bootstrap option (``--n-bootstrap`` was `llmvisor validate`'s older name)."""


def metavar(param) -> str:
    """A short, readable placeholder for the value of ``param`` (empty for a flag)."""
    if getattr(param, "is_flag", False) or getattr(param, "count", False):
        return ""
    described = getattr(param, "type_descriptor", None)  # typer >= 0.2x describes the annotation itself
    if described is not None:
        annotation = described.annotation
        while typing.get_origin(annotation) is list:
            (annotation,) = typing.get_args(annotation)
        info = described.parameter_info
        if described.choices is not None:
            return "|".join(str(getattr(c, "value", c)) for c in described.choices)
        if isinstance(annotation, type) and issubclass(annotation, os.PathLike):
            return "FILE" if not info.dir_okay else "DIR" if not info.file_okay else "PATH"
        kind = {int: "integer", float: "float"}.get(annotation, "text")
    else:  # older typer: click's parameter types
        kind = getattr(param.type, "name", "text").removesuffix(" range")
    if param.param_type_name == "argument":
        return param.name.upper()
    return {"integer": "N", "float": "NUM", "path": "PATH"}.get(kind, "TEXT")


class ReadableArgument(TyperArgument):
    """An argument whose help shows its metavar alone, not the Python type (``<list[Path]>``) beside it."""

    def display_type_rich(self, ctx) -> str:
        return ""


def tidy(command, ctx):
    """Give every parameter of ``command`` (its help option too) a readable metavar unless it has one."""
    for param in command.get_params(ctx):
        if param.metavar is None:
            param.metavar = metavar(param)
        if type(param) is TyperArgument:
            param.__class__ = ReadableArgument  # adds no state: only how help shows its type
    return command


def rename_deprecated(command, args: list[str], warn) -> list[str]:
    """``args`` with the command's old option spellings (`RENAMED_OPTIONS`) replaced by the new ones, calling
    ``warn`` once per old spelling used."""
    renamed = RENAMED_OPTIONS.get(command.name, {})
    names = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
    out: list[str] = []
    for k, word in enumerate(args):
        if word == "--":
            return out + args[k:]
        name, equals, value = word.partition("=")
        new = renamed.get(name)
        if new is not None and name not in names and new in names:
            warn(f"{name} is deprecated; use {new}")
            word = new + equals + value
        out.append(word)
    return out


def check_output_file(path: Path, option: str = "--output") -> Path:
    """Refuse, before any work, an output file that could not be written: a folder, a missing or read-only folder."""
    if path.is_dir():
        raise LlmvisorError(f"{option} {path}: is a folder; give a file path")
    folder = path.parent
    if not folder.is_dir():
        raise LlmvisorError(f"{option} {path}: no such folder {str(folder)!r}; create it first")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise LlmvisorError(f"{option} {path}: not writable")
    return path


def check_output_folder(path: Path, option: str = "--output") -> Path:
    """Refuse, before any work, an output folder that is a file or could not be created or written; create
    nothing (the command makes it when it writes), so a command refused later leaves no folder behind."""
    if path.exists() and not path.is_dir():
        raise LlmvisorError(f"{option} {path}: is a file; give a folder")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise LlmvisorError(f"{option} {path}: {str(existing)!r} is a file; the folder cannot be created")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise LlmvisorError(f"{option} {path}: {'not writable' if existing == path else f'cannot create the folder in {str(existing)!r} (not writable)'}")
    return path


def check_input_file(path: Path, option: str, what: str = "file") -> Path:
    """Refuse a path given as an input file that is a folder or does not exist, naming the option."""
    if path.is_dir():
        raise LlmvisorError(f"{option} {path}: is a folder, not a {what}")
    if not path.is_file():
        raise LlmvisorError(f"{option} {path}: no such {what}")
    return path


WHOLE_SECOND = (1, "is not a whole second at or after 1970 (usage is kept per second)")
"""Usage is kept per second: `adjust` and `audit` periods start and end on whole seconds."""
WHOLE_HOUR = (3600, "is not a whole UTC hour (charges are hourly)")
"""Charges are hourly: `export` periods start and end on whole UTC hours."""


def period_bound_us(option: str, value: str, whole: tuple[int, str] = WHOLE_SECOND) -> int:
    """``value`` of ``option`` (an ISO 8601 time, naive meaning UTC, or Unix seconds) as µs; it must be at or after
    1970 and a multiple of ``whole[0]`` seconds, else a one-line error ending in ``whole[1]``."""
    try:
        seconds = float(value)
    except ValueError:
        try:
            moment = datetime.fromisoformat(value.strip())
        except ValueError:
            raise LlmvisorError(f"{option}: expected an ISO 8601 time or Unix seconds, got {value!r}") from None
        seconds = (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()
    step_s, why = whole
    if not seconds >= 0 or seconds % step_s:
        raise LlmvisorError(f"{option}: {value!r} {why}")
    return int(seconds) * 1_000_000


def check_ledger_exists(db: str) -> None:
    """A SQLite ledger that does not exist would be created empty and every bill read as 0: refuse it instead."""
    if db.startswith("sqlite:///") and db != "sqlite:///:memory:" and not Path(db[len("sqlite:///"):]).is_file():
        raise LlmvisorError(f"--db {db}: no such ledger file")
