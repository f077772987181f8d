"""Write step traces: a whole `StepTrace` at once (`write_trace`) or step by step as an engine runs (`TraceWriter`).

The file type follows from the extension (JSONL, CSV or Parquet); `llmvisor.core.trace` re-exports both names.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from llmvisor.core.files import replaced_atomically
from llmvisor.core.step_trace import StepTrace
from llmvisor.core.trace_schema import (
    ARROW_SCHEMA,
    METADATA_KEY,
    REQUIRED_COLUMNS,
    SHARING_ARROW_FIELDS,
    format_version,
    trace_suffix,
)


def write_trace(trace: StepTrace, path: str | os.PathLike) -> None:
    """Write a whole trace; the file type follows from the extension. Parquet keeps the trace metadata."""
    path = str(path)
    suffix = trace_suffix(path)
    table = trace.to_arrow()
    with replaced_atomically(path) as tmp:
        if suffix == ".parquet":
            pq.write_table(table, tmp, row_group_size=1 << 18)
        elif suffix == ".csv":
            pa_csv.write_csv(table, tmp)
        else:
            with open(tmp, "w", encoding="utf-8") as handle:
                for row in table.to_pylist():
                    handle.write(json.dumps(row) + "\n")


class TraceWriter:
    """Append steps to a trace file as they happen.

    JSONL and CSV files grow by whole steps, each flushed with one write, so a crash loses at most the
    steps not yet flushed and never leaves a half row. Parquet has its footer written only on ``close``, so
    it is written to a temporary file renamed into place then; use JSONL for recording live engines.
    """

    def __init__(self, path: str | os.PathLike, *, flush_every_steps: int = 1, metadata: dict | None = None):
        self.path = str(path)
        self.suffix = trace_suffix(self.path)
        self.flush_every_steps = flush_every_steps
        self.metadata = dict(metadata or {})
        self._buffer: list[dict] = []
        self._buffered_steps = 0
        self._columns: list[str] | None = None
        self._parquet: pq.ParquetWriter | None = None
        self._tmp = f"{self.path}.partial"
        self.n_steps_written = 0
        if self.suffix == ".csv" and os.path.exists(self.path) and os.path.getsize(self.path) > 0:
            with open(self.path, encoding="utf-8", newline="") as handle:
                self._columns = next(csv.reader(handle))

    def write_step(self, rows: Sequence[dict]) -> None:
        """Add one step's rows (dicts holding at least the required columns)."""
        self._buffer.extend(rows)
        self._buffered_steps += 1
        if self._buffered_steps >= self.flush_every_steps:
            self.flush()

    def flush(self) -> None:
        if not self._buffer:
            return
        if self.suffix == ".jsonl":
            text = "".join(json.dumps(row) + "\n" for row in self._buffer)
            self._append(text.encode())
        elif self.suffix == ".csv":
            if self._columns is None:
                self._columns = list(REQUIRED_COLUMNS) + sorted({k for r in self._buffer for k in r} - set(REQUIRED_COLUMNS))
                header = True
            else:
                header = False
            out = io.StringIO()
            writer = csv.DictWriter(out, fieldnames=self._columns, extrasaction="ignore", lineterminator="\n")
            if header:
                writer.writeheader()
            writer.writerows(self._buffer)
            self._append(out.getvalue().encode())
        else:
            table = pa.Table.from_pylist(self._buffer)
            table = table.select(list(REQUIRED_COLUMNS) + [c for c in table.column_names if c not in REQUIRED_COLUMNS])
            extra_fields = [
                pa.field(f.name, SHARING_ARROW_FIELDS.get(f.name, f.type)) for f in table.schema if f.name not in REQUIRED_COLUMNS
            ]
            table = table.cast(pa.schema(list(ARROW_SCHEMA) + extra_fields))
            if self._parquet is None:
                version = format_version(table.column_names)
                metadata = {METADATA_KEY: json.dumps({"format_version": version, **self.metadata}).encode()}
                self._parquet = pq.ParquetWriter(self._tmp, table.schema.with_metadata(metadata))
            self._parquet.write_table(table)
        self.n_steps_written += self._buffered_steps
        self._buffer.clear()
        self._buffered_steps = 0

    def _append(self, data: bytes) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.flush()
        if self._parquet is not None:
            self._parquet.close()
            os.replace(self._tmp, self.path)
            self._parquet = None

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
