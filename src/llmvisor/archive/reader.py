"""Read a period (and tenant) of the step archive back as one `StepTrace` (pyarrow, over any fsspec URL).

Files are chosen by name (run, window) before any is opened, so reading an hour of a year-long archive opens
that hour's files. A step found in several files (a window written again after a delivery process was replaced)
is kept once, from the first file in name order.
"""

from __future__ import annotations

import json

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from llmvisor.archive.writer import parse_file_name
from llmvisor.core.trace import (
    METADATA_KEY,
    SHARING_COLUMNS,
    StepTrace,
    build_trace,
    trace_columns_from_arrow,
    trace_from_rows,
)
from llmvisor.errors import LlmvisorError


class ArchiveReadError(LlmvisorError):
    """The archive cannot be read as asked (no such archive, a bad URL, a damaged file)."""


def archive_files(url: str, start_us: int | None = None, end_us: int | None = None) -> list[str]:
    """The archive's files whose window may hold steps starting in [start_us, end_us), in name order."""
    try:
        fs, root = fsspec.core.url_to_fs(url)
    except (ValueError, ImportError) as error:
        raise ArchiveReadError(f"archive {url}: not a usable URL ({error})") from None
    root = root.rstrip("/")
    try:
        if not fs.isdir(root):
            raise ArchiveReadError(f"archive {url}: no such directory")
        paths = fs.find(root)
    except OSError as error:
        raise ArchiveReadError(f"archive {url}: cannot list it ({error})") from None
    chosen = []
    for path in sorted(paths):
        relative = str(path)[len(root):].lstrip("/") if str(path).startswith(root) else str(path)
        parsed = parse_file_name(relative)
        if parsed is None:
            continue
        window_ms = parsed[1]
        # a window's length is in each file's metadata; the name only bounds its start, so keep any window that
        # starts before the period ends, and windows starting up to a day before the period starts
        if end_us is not None and window_ms * 1000 >= end_us:
            continue
        if start_us is not None and window_ms * 1000 < start_us - 86_400_000_000:
            continue
        chosen.append(path)
    return [fs.unstrip_protocol(path) if hasattr(fs, "unstrip_protocol") else path for path in chosen]


def read_archive(url: str, start_us: int | None = None, end_us: int | None = None, *, tenant: str | None = None) -> StepTrace:
    """Steps starting in [start_us, end_us) (µs since 1970, rounded as the ledger dates them); with ``tenant``,
    only the steps that ran at least one of its slices, each whole (attribution needs the whole batch)."""
    tables = []
    seen: set[tuple[str, int]] = set()
    for path in archive_files(url, start_us, end_us):
        try:
            with fsspec.open(path, "rb") as handle:
                table = pq.read_table(handle)
        except (pa.ArrowException, OSError, ValueError) as error:
            raise ArchiveReadError(f"{path}: file: not a readable Parquet file ({error})") from None
        if "timestamp_s" not in table.column_names:
            raise ArchiveReadError(f"{path}: header: missing column(s) timestamp_s (an archive file dates its steps)")
        when_us = pc.round(pc.multiply(table["timestamp_s"].cast(pa.float64()), 1e6))
        keep = pc.is_valid(when_us)
        if start_us is not None:
            keep = pc.and_(keep, pc.greater_equal(when_us, start_us))
        if end_us is not None:
            keep = pc.and_(keep, pc.less(when_us, end_us))
        table = table.filter(keep)
        if tenant is not None and table.num_rows:
            keys = table.filter(pc.equal(table["tenant"], tenant)).select(["run_id", "step_id"])
            step_keys = set(zip(keys["run_id"].to_pylist(), keys["step_id"].to_pylist()))
            table = _rows_of(table, step_keys)
        if not table.num_rows:
            continue
        step_keys = set(zip(table["run_id"].to_pylist(), table["step_id"].to_pylist()))
        if step_keys & seen:
            table = _rows_of(table, step_keys - seen)
        seen |= step_keys
        tables.append(table)
    if not tables:
        return trace_from_rows([], path=url)
    table = pa.concat_tables(tables, promote_options="permissive")
    if not all(name in table.column_names for name in SHARING_COLUMNS) and any(n in table.column_names for n in SHARING_COLUMNS):
        table = table.drop_columns([n for n in SHARING_COLUMNS if n in table.column_names])
    for name in SHARING_COLUMNS:  # files of format 1 read together with format 2 ones: nothing shared
        if name in table.column_names and table[name].null_count:
            fill = table["num_context_tokens"] if name == "effective_context_tokens" else pa.scalar(0, pa.int64())
            values = pc.coalesce(table[name], pc.cast(fill, table[name].type) if name == "effective_context_tokens" else fill)
            table = table.set_column(table.column_names.index(name), name, values)
    columns, rows = trace_columns_from_arrow(url, table)
    metadata = _metadata(tables[0])
    return build_trace(columns, path=url, row_numbers=rows, metadata=metadata)


def _rows_of(table: pa.Table, step_keys: set[tuple[str, int]]) -> pa.Table:
    mask = np.fromiter(((r, s) in step_keys for r, s in zip(table["run_id"].to_pylist(), table["step_id"].to_pylist())),
                       dtype=bool, count=table.num_rows)
    return table.filter(pa.array(mask))


def _metadata(table: pa.Table) -> dict:
    raw = (table.schema.metadata or {}).get(METADATA_KEY)
    try:
        metadata = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    metadata.pop("format_version", None)
    metadata.pop("archive", None)
    return metadata if isinstance(metadata, dict) else {}

