"""Raw engine steps archived as trace-format Parquet files, rotated per run and time window (issue 22).

The database keeps what is billed; the archive keeps every step as it was measured, cheaply (zstd Parquet on a
local directory or any fsspec URL: object storage in production, ``memory://`` in tests), so a period can be
re-attributed and audited (`llmvisor audit`) or refitted later. Each file is a valid trace-format file
(version 2 when the steps carry the sharing columns), so every trace reader reads it.

File names are deterministic: ``<root>/<run>/<window start, ms since 1970, 15 digits>-<part, 4 digits>.parquet``,
the run id percent-encoded. A window is written when a step of a later window of the same run arrives, when
`rotate` finds it ended (``now`` past its end plus ``grace_s``), and at `close`; a window written again (a late
step, a delivery process that replaced one that died) gets the next part number, never overwrites one.

A file appears whole or not at all: on a local directory it is written under a hidden temporary name and renamed
(atomic within a directory); elsewhere it is one ``pipe_file`` (an object store's PUT is atomic). A write that
fails is logged as an error and counted (``ArchiveStats.errors``), and its steps are kept and retried at the next
rotation; steps still unwritten at `close` are reported in the log with their number, never dropped silently.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import time
import urllib.parse
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from llmvisor.core.relayed import StepColumns
from llmvisor.core.trace import ARROW_SCHEMA, METADATA_KEY, SHARING_ARROW_FIELDS, format_version
from llmvisor.core.trace_schema import KV_COLUMNS, LORA_COLUMNS

log = logging.getLogger("llmvisor.archive")

ENV_ARCHIVE_URL = "LLMVISOR_ARCHIVE_URL"
ENV_ARCHIVE_WINDOW_S = "LLMVISOR_ARCHIVE_WINDOW_S"
DEFAULT_WINDOW_S = 60.0
DEFAULT_MAX_HELD_STEPS = 500_000
"""Steps kept for a retry while the archive cannot be written (about 3 minutes of 50 engines' steps); beyond it
the oldest failed window is dropped, with an ERROR line and ``ArchiveStats.steps_dropped``, so a long outage of
the storage cannot take the delivery process's memory."""
DEFAULT_GRACE_S = 2.0
"""How long after a window ends `rotate` waits for its last steps (a step is dated by its start)."""
COMPRESSION = "zstd"
ARCHIVE_METADATA = "archive"
"""Key, inside the trace metadata (``llmvisor.trace``), of the file's archive facts (run, window, part, versions)."""
_TYPES = {
    **{field.name: field.type for field in ARROW_SCHEMA}, **SHARING_ARROW_FIELDS,
    "timestamp_s": pa.float64(), "is_warmup": pa.bool_(), "engine_fingerprint": pa.string(), "model_version": pa.int64(),
    **dict.fromkeys(KV_COLUMNS, pa.int64()),  # format 3's KV memory columns, kept as the recorder relays them
    **dict.fromkeys(LORA_COLUMNS, pa.string()), "lora_rank": pa.int64(),  # format 4's adapters, likewise
}


class ArchiveError(Exception):
    """An archive file could not be written (kept for a retry; see `ArchiveWriter`)."""


def window_start_ms(timestamp_s: float, window_s: float) -> int:
    """Start of the window holding ``timestamp_s`` (Unix seconds), in integer milliseconds."""
    window_ms = round(window_s * 1000)
    return math.floor(timestamp_s * 1000 / window_ms) * window_ms


def file_name(run_id: str, window_ms: int, part: int) -> str:
    """``<run>/<window start ms>-<part>.parquet`` relative to the archive's root: sortable, deterministic."""
    return f"{urllib.parse.quote(run_id, safe='')}/{window_ms:015d}-{part:04d}.parquet"


def parse_file_name(relative: str) -> tuple[str, int, int] | None:
    """(run_id, window start ms, part) of an archive file's relative name, or None if it is not one."""
    parts = relative.replace("\\", "/").split("/")
    if len(parts) != 2 or not parts[1].endswith(".parquet") or parts[1].startswith("."):
        return None
    stem = parts[1][: -len(".parquet")]
    window, _, part = stem.partition("-")
    if not (window.isdigit() and part.isdigit()):
        return None
    return urllib.parse.unquote(parts[0]), int(window), int(part)


@dataclass
class ArchiveStats:
    """What the writer did: steps and bytes written, files, write errors, steps waiting for a retry."""

    steps_written: int = 0
    files_written: int = 0
    bytes_written: int = 0
    errors: int = 0
    steps_held: int = 0
    steps_dropped: int = 0


def rows_columns(rows: Sequence[dict]) -> dict[str, list]:
    """Trace rows (dicts, `llmvisor.core.relayed.step_rows`) as columns: every name any row has, in the order
    they first appear, None where a row lacks it."""
    names = list(dict.fromkeys(name for row in rows[:1] for name in row))
    expected = set(names)
    if any(row.keys() != expected for row in rows):
        names = list(dict.fromkeys(name for r in rows for name in r))
    return {name: [row.get(name) for row in rows] for name in names}


def columns_table(columns: dict[str, list], metadata: dict) -> pa.Table:
    """Trace columns (name → values, as `rows_columns` gathers them or `StepColumns.columns` gives them) as an Arrow
    table of the trace format's types, the trace metadata beside ``metadata``."""
    table = pa.table({name: pa.array(values, _TYPES.get(name)) for name, values in columns.items()})
    trace_metadata = {"format_version": format_version(list(columns)), **metadata}
    return table.replace_schema_metadata({METADATA_KEY: json.dumps(trace_metadata).encode()})


class _Buffer:
    """One (run, window)'s steps until written: trace rows (`ArchiveWriter.add_step`) or relayed steps kept as
    columns (`ArchiveWriter.add_relayed`), not both."""

    def __init__(self):
        self.rows: list[dict] = []
        self.relayed: StepColumns | None = None
        self.num_steps = 0

    def columns(self) -> dict[str, list]:
        return self.relayed.columns() if self.relayed is not None else rows_columns(self.rows)


class ArchiveWriter:
    """Steps to Parquet files rotated per (run, window); see the module docstring.

    ``metadata`` goes into every file's trace metadata (``engine_fingerprint``: the engine's fingerprint record);
    the file's own facts go under ``archive``: run id, window, part, step count, and ``model_versions``, the
    distinct ``model_version`` values its rows carry (the edge attribution's; empty when the rows have none)."""

    def __init__(self, url: str, *, window_s: float = DEFAULT_WINDOW_S, grace_s: float = DEFAULT_GRACE_S,
                 metadata: dict | None = None, clock: Callable[[], float] = time.time,
                 max_held_steps: int = DEFAULT_MAX_HELD_STEPS):
        if not (window_s >= 0.001 and math.isfinite(window_s)):
            raise ValueError(f"archive window must be at least 1 ms, got {window_s!r} s")
        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.window_s = float(window_s)
        self.grace_s = grace_s
        self.max_held_steps = max_held_steps
        self.metadata = dict(metadata or {})
        self.clock = clock
        self.stats = ArchiveStats()
        self._open: dict[tuple[str, int], _Buffer] = {}
        self._failed: list[tuple[str, int, _Buffer]] = []
        self._next_part: dict[tuple[str, int], int] = {}
        self._latest: dict[str, int] = {}
        self._listed_runs: set[str] = set()
        self._is_local = isinstance(self.fs, LocalFileSystem)
        self._retry_at_s = 0.0

    @classmethod
    def from_env(cls, metadata: dict | None = None) -> ArchiveWriter | None:
        """A writer for ``LLMVISOR_ARCHIVE_URL`` (window ``LLMVISOR_ARCHIVE_WINDOW_S``, default 60 s), or None."""
        url = os.environ.get(ENV_ARCHIVE_URL)
        if not url:
            return None
        window_s = float(os.environ.get(ENV_ARCHIVE_WINDOW_S) or DEFAULT_WINDOW_S)
        return cls(url, window_s=window_s, metadata=metadata)

    def add_step(self, rows: Sequence[dict]) -> None:
        """Buffer one step's rows (dated by ``timestamp_s``, else now); write the run's windows it closes."""
        if not rows:
            return
        first = rows[0]
        buffer, run_id, window = self._buffer(first["run_id"], first.get("timestamp_s"))
        if buffer.relayed is not None:
            raise ValueError(f"run {run_id}: an archive window takes trace rows or relayed steps, not both")
        buffer.rows.extend(rows)
        buffer.num_steps += 1
        self._closes_older(run_id, window)

    def add_relayed(self, header: dict, step: list) -> None:
        """Buffer one relayed step (`llmvisor.core.relayed`: what the recorder hands its delivery process) as
        columns, the same file its trace rows would make without a dict per slice; otherwise as `add_step`."""
        if not step[3]:
            return
        buffer, run_id, window = self._buffer(header["columns"]["run_id"], step[1])
        if buffer.relayed is None:
            if buffer.rows:
                raise ValueError(f"run {run_id}: an archive window takes trace rows or relayed steps, not both")
            buffer.relayed = StepColumns(header)
        elif buffer.relayed.header is not header and buffer.relayed.header != header:
            raise ValueError(f"run {run_id}: relayed steps of one archive window must share their header")
        buffer.relayed.add(step)
        buffer.num_steps += 1
        self._closes_older(run_id, window)

    def _buffer(self, run_id, timestamp_s) -> tuple[_Buffer, str, int]:
        window = window_start_ms(self.clock() if timestamp_s is None else float(timestamp_s), self.window_s)
        run_id = str(run_id)
        buffer = self._open.get((run_id, window))
        if buffer is None:
            buffer = self._open[(run_id, window)] = _Buffer()
        return buffer, run_id, window

    def _closes_older(self, run_id: str, window: int) -> None:
        if window > self._latest.get(run_id, window - 1):
            self._latest[run_id] = window
            older = [k for k in self._open if k[0] == run_id and k[1] < window]
            if older or self._failed:
                self._write_windows(older)

    def rotate(self, now_s: float | None = None) -> None:
        """Write every window that ended ``grace_s`` before ``now_s`` (default: the clock), and retry failed ones."""
        now_s = self.clock() if now_s is None else now_s
        window_ms = round(self.window_s * 1000)
        due = [k for k in self._open if k[1] + window_ms + self.grace_s * 1000 <= now_s * 1000]
        if due or (self._failed and now_s >= self._retry_at_s):  # failed windows: retried once a window at most
            self._write_windows(due)

    def close(self) -> bool:
        """Write everything buffered; True when every step handed over is in the archive."""
        self._write_windows(list(self._open))
        if self._failed:
            held = sum(b.num_steps for *_, b in self._failed)
            log.error("llmvisor: %d steps could not be archived to %s (%d write errors); they are not in the archive",
                      held, self.url, self.stats.errors)
            return False
        return True

    def _write_windows(self, keys: list[tuple[str, int]]) -> None:
        self._retry_at_s = self.clock() + self.window_s
        retry, self._failed = self._failed, []
        for run_id, window, buffer in retry:
            self._write(run_id, window, buffer)
        for key in keys:
            self._write(key[0], key[1], self._open.pop(key))
        self.stats.steps_held = sum(b.num_steps for *_, b in self._failed)
        while self.stats.steps_held > self.max_held_steps and len(self._failed) > 1:
            run_id, window, buffer = self._failed.pop(0)
            n_steps = buffer.num_steps
            self.stats.steps_held -= n_steps
            self.stats.steps_dropped += n_steps
            log.error("llmvisor: dropped %d steps of run %s (window at %d ms) from the archive queue: the archive %s has "
                      "failed for more than %d held steps; they are not in the archive", n_steps, run_id, window, self.url,
                      self.max_held_steps)

    def _write(self, run_id: str, window: int, buffer: _Buffer) -> None:
        n_steps = buffer.num_steps
        try:
            part = self._part(run_id, window)
            name = file_name(run_id, window, part)
            columns = buffer.columns()
            versions = sorted({v for v in columns.get("model_version", ()) if v is not None})
            facts = {"run_id": run_id, "window_start_ms": window, "window_s": self.window_s, "part": part,
                     "num_steps": n_steps, "model_versions": versions}
            table = columns_table(columns, {**self.metadata, ARCHIVE_METADATA: facts})
            out = io.BytesIO()
            pq.write_table(table, out, compression=COMPRESSION)
            data = out.getvalue()
            self._put(f"{self.root.rstrip('/')}/{name}", data)
        except Exception as error:  # noqa: BLE001 - any storage error: keep the steps, report, retry
            self.stats.errors += 1
            self._failed.append((run_id, window, buffer))
            log.error("llmvisor: cannot write %d steps of run %s to the archive %s (%s: %s); kept for a retry at the next rotation",
                      n_steps, run_id, self.url, type(error).__name__, error)
            return
        self._next_part[(run_id, window)] = part + 1
        self.stats.steps_written += n_steps
        self.stats.files_written += 1
        self.stats.bytes_written += len(data)

    def _part(self, run_id: str, window: int) -> int:
        """The next unused part number of a window. The run's directory is listed once, at its first write (a
        replacement delivery process finds the parts its predecessor wrote); after that this writer counts."""
        if run_id not in self._listed_runs:
            directory = f"{self.root.rstrip('/')}/{urllib.parse.quote(run_id, safe='')}"
            if self.fs.exists(directory):
                for path in self.fs.ls(directory, detail=False):
                    parsed = parse_file_name("/".join(str(path).rstrip("/").split("/")[-2:]))
                    if parsed is not None:
                        key = (run_id, parsed[1])
                        self._next_part[key] = max(self._next_part.get(key, 0), parsed[2] + 1)
            self._listed_runs.add(run_id)
        return self._next_part.get((run_id, window), 0)

    def _put(self, path: str, data: bytes) -> None:
        directory = path.rsplit("/", 1)[0]
        if self._is_local:
            os.makedirs(directory, exist_ok=True)
            tmp = f"{directory}/.{path.rsplit('/', 1)[1]}.{uuid.uuid4().hex}.tmp"
            try:
                with open(tmp, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
                if os.path.exists(path):
                    raise ArchiveError(f"{path} exists already")
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        else:
            self.fs.makedirs(directory, exist_ok=True)
            self.fs.pipe_file(path, data)
