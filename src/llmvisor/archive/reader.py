"""Read a period (and tenant) of the step archive back as one `StepTrace` (DuckDB, over any fsspec URL).

Files are chosen by name (run, window) before any is opened, so reading an hour of a year-long archive opens
that hour's files. A step found in several files (a window written again after a delivery process was replaced)
is kept once, from the first file in name order.
"""

from __future__ import annotations

import json

import fsspec
import pyarrow as pa
import pyarrow.compute as pc

from llmvisor.archive.writer import parse_file_name
from llmvisor.core.trace import (
    METADATA_KEY,
    SHARING_COLUMNS,
    StepTrace,
    build_trace,
    trace_columns_from_arrow,
    trace_from_rows,
)
from llmvisor.core.trace_schema import KV_COLUMNS
from llmvisor.errors import LlmvisorError
from llmvisor.extras import require


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
    only the steps that ran at least one of its slices, each whole (attribution needs the whole batch).

    The files are read, filtered and de-duplicated by one DuckDB query (faster than reading them one by one with
    pyarrow: the measurement is in the commit that made the change); the rows keep the files' name order and each
    file's row order, so the trace is the one a file-by-file read gives."""
    table, first_file = _select(url, archive_files(url, start_us, end_us), start_us, end_us, tenant)
    if table is None:
        return trace_from_rows([], path=url)
    if not all(name in table.column_names for name in SHARING_COLUMNS) and any(n in table.column_names for n in SHARING_COLUMNS):
        table = table.drop_columns([n for n in SHARING_COLUMNS if n in table.column_names])
    for name in SHARING_COLUMNS:  # files of format 1 read together with format 2 ones: nothing shared
        if name in table.column_names and table[name].null_count:
            fill = table["num_context_tokens"] if name == "effective_context_tokens" else pa.scalar(0, pa.int64())
            values = pc.coalesce(table[name], pc.cast(fill, table[name].type) if name == "effective_context_tokens" else fill)
            table = table.set_column(table.column_names.index(name), name, values)
    kv = [name for name in KV_COLUMNS if name in table.column_names]
    if kv and any(table[name].null_count for name in kv):  # files of format 3 read with older ones: time only, as
        table = table.drop_columns(kv)                      # `read_traces` keeps only the columns every file has
    columns, rows = trace_columns_from_arrow(url, table)
    return build_trace(columns, path=url, row_numbers=rows, metadata=_metadata(first_file))


def _select(url: str, paths: list[str], start_us: int | None, end_us: int | None, tenant: str | None) -> tuple[pa.Table | None, dict]:
    """The rows to keep of ``paths`` as one Arrow table, and the trace metadata of the first file that gave any.

    A step's row is kept when it starts in the period and, with ``tenant``, its step (run_id, step_id) has a slice
    of the tenant in the same file; a step found in several files is kept from the first one in name order. The
    names DuckDB reports share one prefix (the archive's root) and differ from ``paths`` only by it, so sorting
    them orders the files as ``paths`` are ordered.
    """
    if not paths:
        return None, {}
    require("reading the raw-step archive", "archive", modules=("duckdb",))
    import duckdb

    connection = duckdb.connect()
    try:
        fs, _ = fsspec.core.url_to_fs(url)
        local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
        if not local:
            connection.register_filesystem(fs)
        files = [path.removeprefix("file://") if local else path for path in paths]
        schema = connection.execute(
            "SELECT file_name, bool_or(name = 'timestamp_s') FROM parquet_schema($files) GROUP BY file_name", {"files": files}
        ).fetchall()
        dated = {name: has for name, has in schema}
        undated = sorted(name for name, has in dated.items() if not has)
        if undated:
            raise ArchiveReadError(f"{_original(paths, undated[0])}: header: missing column(s) timestamp_s (an archive file dates its steps)")
        period = ["when_us IS NOT NULL"]
        if start_us is not None or end_us is not None:
            period.append("NOT isnan(when_us)")  # as pyarrow compares: NaN is in no period
        if start_us is not None:
            period.append(f"when_us >= {int(start_us)}")
        if end_us is not None:
            period.append(f"when_us < {int(end_us)}")
        names = sorted(dated)  # as DuckDB reports them: the files in name order
        params: dict = {"files": files, "names": names}
        of_tenant = ""
        if tenant is not None:
            of_tenant = "WHERE (file_index, run_id, step_id) IN (SELECT file_index, run_id, step_id FROM dated WHERE tenant = $tenant)"
            params["tenant"] = tenant
        query = f"""
            WITH dated AS (
                SELECT * FROM (
                    SELECT *, round_even(CAST(timestamp_s AS DOUBLE) * 1e6, 0) AS when_us
                    FROM read_parquet($files, union_by_name = true, filename = true, file_row_number = true)
                    JOIN (SELECT unnest($names) AS filename, generate_subscripts($names, 1) AS file_index) USING (filename)
                ) WHERE {" AND ".join(period)}
            ),
            kept AS (SELECT * FROM dated {of_tenant}),
            first AS (SELECT run_id, step_id, min(file_index) AS file_index FROM kept GROUP BY run_id, step_id)
            SELECT * EXCLUDE (filename, file_row_number, when_us) FROM kept SEMI JOIN first USING (run_id, step_id, file_index)
            ORDER BY file_index, file_row_number
        """
        table = connection.sql(query, params=params).to_arrow_table()
        if not table.num_rows:
            return None, {}
        first_file = names[table["file_index"][0].as_py() - 1]
        raw = connection.execute(
            "SELECT value FROM parquet_kv_metadata($file) WHERE key = $key", {"file": first_file, "key": METADATA_KEY}
        ).fetchone()
    except duckdb.Error as error:
        raise ArchiveReadError(f"archive {url}: file: not a readable Parquet file ({error})") from None
    finally:
        connection.close()
    return table.drop_columns(["file_index"]), {METADATA_KEY: raw[0]} if raw else {}


def _original(paths: list[str], reported: str) -> str:
    """The path of ``paths`` that DuckDB reports as ``reported`` (the same run folder and file name)."""
    tail = "/".join(reported.rsplit("/", 2)[-2:])
    return next((path for path in paths if path.endswith("/" + tail)), reported)


def _metadata(schema_metadata: dict) -> dict:
    raw = schema_metadata.get(METADATA_KEY)
    try:
        metadata = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    metadata.pop("format_version", None)
    metadata.pop("archive", None)
    return metadata if isinstance(metadata, dict) else {}

