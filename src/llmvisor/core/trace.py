"""Read, validate and write step traces (format versions 1 to 4, `docs/trace-format.md`).

A trace has one row per request slice per step. In memory it is a `StepTrace`: columnar numpy arrays with
the slices of each step made contiguous and ordered by (run_id, step_id), plus per-step views
(`step_offsets`, `step_latency_s_per_step`, ...) that the features, the model and attribution use.

Every rejection the contract lists is a `TraceError` whose message names the file, the row (1-based data
row: the JSONL line, the CSV line after the header, the Parquet row) or the step, and the reason.

Version 2 adds two optional per-slice columns describing KV blocks shared between the slices of a step
(prefix caching): ``num_shared_context_tokens`` and ``effective_context_tokens``. A trace without them (v1)
means nothing is shared; a trace gives both or neither.

The format's columns are in `llmvisor.core.trace_schema`, the `StepTrace` structure in `llmvisor.core.step_trace`
and the writers in `llmvisor.core.trace_writer`; this module reads and validates, and re-exports their names so
that `llmvisor.core.trace` stays the one import path for traces.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
from collections.abc import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from llmvisor.core.fingerprint import FINGERPRINT_COLUMN, is_fingerprint_id
from llmvisor.core.kv_trace import check_kv_columns, kv_columns_present
from llmvisor.core.lora_trace import check_lora_columns, lora_columns_present
from llmvisor.core.step_trace import RunIds, StepTrace, concat_traces
from llmvisor.core.trace_schema import (
    ARROW_SCHEMA,
    CHECKED_COLUMNS,
    FLOAT_COLUMNS,
    FORMAT_VERSION,
    INTEGER_COLUMNS,
    KNOWN_COLUMNS,
    KNOWN_SET,
    METADATA_KEY,
    OPTIONAL_COLUMNS,
    PHASES,
    REQUIRED_COLUMNS,
    SHARING_ARROW_FIELDS,
    SHARING_COLUMNS,
    SHARING_TOLERANCE,
    STRING_COLUMNS,
    SUFFIXES,
    WARMUP_FALSE,
    WARMUP_TRUE,
    columns_together,
    first_disagreement,
    format_version,
    parse_is_warmup,
    rejection,
    sharing_columns_from_blocks,
    step_place,
    trace_suffix,
)
from llmvisor.core.trace_writer import TraceWriter, write_trace
from llmvisor.errors import TraceError, plain, unknown_name

__all__ = [
    "ARROW_SCHEMA", "CHECKED_COLUMNS", "FLOAT_COLUMNS", "FORMAT_VERSION", "INTEGER_COLUMNS", "KNOWN_COLUMNS", "KNOWN_SET",
    "METADATA_KEY", "OPTIONAL_COLUMNS", "PHASES", "REQUIRED_COLUMNS", "SHARING_ARROW_FIELDS", "SHARING_COLUMNS",
    "SHARING_TOLERANCE", "STRING_COLUMNS", "SUFFIXES", "WARMUP_FALSE", "WARMUP_TRUE", "RunIds", "StepTrace", "TraceWriter",
    "build_trace", "check_known_columns", "concat_traces", "format_version", "iter_trace", "iter_traces",
    "parse_is_warmup", "read_trace", "read_traces", "sharing_columns_from_blocks", "trace_columns_from_arrow",
    "trace_from_rows", "write_trace",
]


# ---------------------------------------------------------------------------------------------------------
# Building and validating


def _check_required(path: str, names: Sequence[str]) -> None:
    """The header holds no column the format does not know and every required column. Unknown names are checked
    first: a misspelled required column (``tenat``) is better named with its suggestion than reported missing."""
    check_known_columns(path, names)
    missing = [name for name in REQUIRED_COLUMNS if name not in names]
    if missing:
        raise rejection(path, "header", f"missing column(s) {', '.join(missing)}")


def check_known_columns(path: str, names: Sequence[str], *, where: str = "header", kind: str = "column") -> None:
    """Refuse a column not in `KNOWN_COLUMNS`, naming it and the closest known name."""
    unknown = unknown_name(names, KNOWN_COLUMNS, kind=kind)
    if unknown:
        raise rejection(path, where, unknown)


def build_trace(
    columns: dict[str, np.ndarray],
    *,
    path: str = "<memory>",
    row_numbers: np.ndarray | None = None,
    metadata: dict | None = None,
    speculative_decoding: bool = False,
) -> StepTrace:
    """Validate typed columns against the contract and group slices by step.

    ``columns`` holds the required columns with their contract types (strings as object arrays) and any
    optional/unknown columns. ``row_numbers`` are the 1-based file rows, used in error messages.
    """
    _check_required(path, list(columns))
    n = len(columns["run_id"])
    if row_numbers is None:
        row_numbers = np.arange(1, n + 1)
    latency = np.asarray(columns["step_latency_s"], dtype=np.float64)
    new_tokens = np.asarray(columns["num_new_tokens"], dtype=np.int64)
    context_tokens = np.asarray(columns["num_context_tokens"], dtype=np.int64)
    phase = np.asarray(columns["phase"], dtype=object)

    def first_bad(mask: np.ndarray, column: str, reason: str) -> None:
        if mask.any():
            i = int(np.argmax(mask))
            raise rejection(path, f"row {row_numbers[i]}", f"{column}: {reason} (got {plain(columns[column][i])!r})")

    first_bad(~np.isfinite(latency), "step_latency_s", "latency must be finite")
    first_bad(latency <= 0, "step_latency_s", "latency must be > 0")
    first_bad(new_tokens < 0, "num_new_tokens", "token count must be >= 0")
    first_bad(new_tokens == 0, "num_new_tokens", "a slice must run at least one new token")
    first_bad(context_tokens < 0, "num_context_tokens", "token count must be >= 0")
    is_prefill = phase == "prefill"
    first_bad(~(is_prefill | (phase == "decode")), "phase", 'must be "prefill" or "decode"')
    if not speculative_decoding:
        first_bad(
            ~is_prefill & (new_tokens != 1),
            "num_new_tokens",
            "a decode slice runs exactly 1 new token (speculative decoding not declared)",
        )
    sharing = columns_together(path, columns, SHARING_COLUMNS, "sharing", 2)
    if FINGERPRINT_COLUMN in columns:
        fingerprints = np.asarray(columns[FINGERPRINT_COLUMN], dtype=object)
        malformed = np.fromiter((not (v is None or v == "" or v != v or is_fingerprint_id(v)) for v in fingerprints), bool, n)
        first_bad(malformed, FINGERPRINT_COLUMN, "expected an engine fingerprint id (16 lowercase hex digits) or nothing")
    shared_tokens = None
    if sharing:
        columns = dict(columns)
        shared_tokens = columns["num_shared_context_tokens"] = np.asarray(columns["num_shared_context_tokens"], dtype=np.int64)
        effective = columns["effective_context_tokens"] = np.asarray(columns["effective_context_tokens"], dtype=np.float64)
        first_bad(shared_tokens < 0, "num_shared_context_tokens", "token count must be >= 0")
        first_bad(shared_tokens > context_tokens, "num_shared_context_tokens", "shared tokens must be <= num_context_tokens")
        first_bad(~np.isfinite(effective), "effective_context_tokens", "must be finite")
        first_bad(effective < 0, "effective_context_tokens", "must be >= 0")
        slack = SHARING_TOLERANCE * np.maximum(context_tokens, 1)
        first_bad(effective > context_tokens + slack, "effective_context_tokens", "must be <= num_context_tokens")
        first_bad(
            effective < context_tokens - shared_tokens - slack,
            "effective_context_tokens",
            "must be >= num_context_tokens - num_shared_context_tokens (the unshared context is read by this slice alone)",
        )
        first_bad(
            effective > context_tokens - shared_tokens / 2 + slack,
            "effective_context_tokens",
            "must be <= num_context_tokens - num_shared_context_tokens / 2 (a shared block has at least two readers)",
        )

    run_id = np.asarray(columns["run_id"], dtype=object)
    step_id = np.asarray(columns["step_id"], dtype=np.int64)
    request_id = np.asarray(columns["request_id"], dtype=object)
    if n == 0:
        order = np.zeros(0, dtype=np.int64)
        run_codes = np.zeros(0, dtype=np.int64)
    else:
        run_codes = pc.dictionary_encode(pa.array(run_id, pa.string())).indices.to_numpy(zero_copy_only=False)
        order = np.lexsort((step_id, run_codes))

    run_codes = run_codes[order]
    sorted_step = step_id[order]
    new_step = np.ones(n, dtype=bool)
    if n > 1:
        new_step[1:] = (run_codes[1:] != run_codes[:-1]) | (sorted_step[1:] != sorted_step[:-1])
    starts = np.flatnonzero(new_step)
    offsets = np.append(starts, n).astype(np.int64)

    sorted_latency = latency[order]
    if n:
        found = first_disagreement(sorted_latency, starts)
        if found is not None:
            k, low, high = found
            raise rejection(
                path,
                step_place(sorted_step[starts[k]], run_id[order[starts[k]]], row_numbers[order[offsets[k] : offsets[k + 1]]]),
                f"rows disagree on step_latency_s ({float(low)!r} vs {float(high)!r})",
            )
        request_codes = pc.dictionary_encode(pa.array(request_id[order], pa.string())).indices.to_numpy(
            zero_copy_only=False
        )
        step_index = np.repeat(np.arange(starts.size), np.diff(offsets))
        pair = np.lexsort((request_codes, step_index))
        same = (step_index[pair][1:] == step_index[pair][:-1]) & (request_codes[pair][1:] == request_codes[pair][:-1])
        if same.any():
            j = int(np.argmax(same))
            a, b = order[pair[j]], order[pair[j + 1]]
            raise rejection(
                path,
                f"step {step_id[a]} of run {plain(run_id[a])!r} (rows {row_numbers[min(a, b)]} and {row_numbers[max(a, b)]})",
                f"request {plain(request_id[a])!r} appears twice in one step",
            )

    if kv_columns_present(path, columns):
        check_kv_columns(columns, path=path, order=order, starts=starts, offsets=offsets, row_numbers=row_numbers,
                         run_id=run_id, step_id=step_id)
    if lora_columns_present(path, columns):
        check_lora_columns(columns, path=path, order=order, starts=starts, offsets=offsets, row_numbers=row_numbers,
                           run_id=run_id, step_id=step_id, request_id=request_id)

    if shared_tokens is not None and n:
        sharers = np.add.reduceat((shared_tokens[order] > 0).astype(np.int64), starts)
        lone = np.flatnonzero(sharers == 1)
        if lone.size:
            k = lone[0]
            raise rejection(
                path,
                step_place(sorted_step[starts[k]], run_id[order[starts[k]]], row_numbers[order[offsets[k] : offsets[k + 1]]]),
                "num_shared_context_tokens: only one slice of the step has shared context (a shared block has at least two readers)",
            )

    extra = {
        name: np.asarray(values)[order]
        for name, values in columns.items()
        if name not in REQUIRED_COLUMNS
    }
    return StepTrace(
        run_id=run_id[order],
        step_id=sorted_step,
        step_latency_s=sorted_latency,
        request_id=request_id[order],
        tenant=np.asarray(columns["tenant"], dtype=object)[order],
        num_new_tokens=new_tokens[order],
        num_context_tokens=context_tokens[order],
        is_prefill=is_prefill[order],
        step_offsets=offsets,
        extra=extra,
        metadata=dict(metadata or {}),
        sources=(path,),
    )


# ---------------------------------------------------------------------------------------------------------
# Typed columns from each file type


def _python_value_type_error(column: str, value) -> str | None:
    if value is None:
        return "missing value"
    if column in STRING_COLUMNS:
        if not isinstance(value, str):
            return f"expected a string, got {value!r}"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return f"not valid Unicode text (cannot be encoded as UTF-8): {value!r}"
        return None
    if column in INTEGER_COLUMNS:
        ok = isinstance(value, int) and not isinstance(value, bool)
        if ok and not -(2**63) <= value < 2**63:
            return f"integer out of range (64-bit): {value}"
        return None if ok else f"expected an integer, got {value!r}"
    if column in FLOAT_COLUMNS:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else f"expected a number, got {value!r}"
    return None


def _values_are_valid(name: str, values: list) -> bool:
    """Whether every value of a required column has its contract type, checked a column at a time: the
    common case, all valid, then costs no Python call per value. False sends the column to the per-value
    check, which finds the first bad row."""
    types = set(map(type, values))
    if not values:
        return True
    if name in STRING_COLUMNS:
        if types != {str}:
            return False
        try:
            "".join(values).encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if name in INTEGER_COLUMNS:
        if types != {int}:
            return False
        return -(2**63) <= min(values) and max(values) < 2**63
    if name in FLOAT_COLUMNS:
        return types <= {int, float}
    return True


def _columns_from_records(path: str, records: list[dict], row_numbers: list[int]) -> dict[str, np.ndarray]:
    names = dict.fromkeys(itertools.chain.from_iterable(records))
    if records:
        if not names.keys() <= KNOWN_SET:
            k = next(k for k, record in enumerate(records) if not record.keys() <= KNOWN_SET)
            check_known_columns(path, list(records[k]), where=f"row {row_numbers[k]}", kind="field")
        _check_required(path, list(names))
    columns: dict[str, np.ndarray] = {}
    for name in names:
        values = [record.get(name) for record in records]
        if name in CHECKED_COLUMNS and not _values_are_valid(name, values):
            for value, row in zip(values, row_numbers):
                reason = _python_value_type_error(name, value)
                if reason:
                    raise rejection(path, f"row {row}", f"{name}: {reason}")
        if name in INTEGER_COLUMNS:
            columns[name] = np.array(values, dtype=np.int64)
        elif name in FLOAT_COLUMNS:
            columns[name] = np.array(values, dtype=np.float64)
        else:
            array = np.empty(len(values), dtype=object)
            array[:] = values
            columns[name] = array
    if not records:
        columns = {name: np.zeros(0) for name in REQUIRED_COLUMNS}
    return columns


def _read_jsonl(path: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    records: list[dict] = []
    rows: list[int] = []
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise rejection(path, f"row {line_number}", f"not valid JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise rejection(path, f"row {line_number}", "expected a JSON object")
            records.append(record)
            rows.append(line_number)
    return _columns_from_records(path, records, rows), np.array(rows, dtype=np.int64)


def _parse_strings(path: str, name: str, values: pa.Array, row_numbers: np.ndarray) -> np.ndarray:
    """Convert a string column to its contract type, naming the first row that does not parse."""
    if name in STRING_COLUMNS or name not in CHECKED_COLUMNS:
        if name in REQUIRED_COLUMNS:
            empty = np.asarray(pc.equal(values, "").to_numpy(zero_copy_only=False), dtype=bool)
            if empty.any():
                raise rejection(path, f"row {row_numbers[int(np.argmax(empty))]}", f"{name}: missing value")
        return np.asarray(values.to_numpy(zero_copy_only=False), dtype=object)
    target = pa.int64() if name in INTEGER_COLUMNS else pa.float64()
    try:
        return pc.cast(values, target).to_numpy(zero_copy_only=False)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        parse = int if name in INTEGER_COLUMNS else float
        for i, text in enumerate(values.to_pylist()):
            try:
                parse(text)
            except (TypeError, ValueError):
                kind = "an integer" if name in INTEGER_COLUMNS else "a number"
                reason = "missing value" if text in ("", None) else f"expected {kind}, got {text!r}"
                raise rejection(path, f"row {row_numbers[i]}", f"{name}: {reason}") from None
        raise


def _read_csv(path: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    with open(path, encoding="utf-8", newline="") as handle:
        header = next(csv.reader(handle), None)
    if not header:
        raise rejection(path, "header", "empty file (a CSV trace needs a header row)")
    _check_required(path, header)
    try:
        table = pa_csv.read_csv(
            path,
            convert_options=pa_csv.ConvertOptions(
                column_types={name: pa.string() for name in header},
                strings_can_be_null=False,
                quoted_strings_can_be_null=False,
            ),
        )
    except pa.ArrowInvalid as error:
        raise rejection(path, "file", f"not a valid CSV table ({error})") from None
    row_numbers = np.arange(1, table.num_rows + 1)
    columns = {
        name: _parse_strings(path, name, table.column(name).combine_chunks(), row_numbers)
        for name in table.column_names
    }
    return columns, row_numbers


_ARROW_KIND = {
    **{name: ("string", pa.types.is_string) for name in STRING_COLUMNS},
    **{name: ("integer", pa.types.is_integer) for name in INTEGER_COLUMNS},
    **{name: ("number", lambda t: pa.types.is_floating(t) or pa.types.is_integer(t)) for name in FLOAT_COLUMNS},
}


def _is_string_like(data_type: pa.DataType) -> bool:
    if pa.types.is_dictionary(data_type):
        return pa.types.is_string(data_type.value_type) or pa.types.is_large_string(data_type.value_type)
    return pa.types.is_string(data_type) or pa.types.is_large_string(data_type)


def trace_columns_from_arrow(path: str, table: pa.Table, first_row: int = 1) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Check an Arrow table's required columns (presence, types, nulls) and convert every column for
    `build_trace`; rows are numbered from ``first_row`` in messages. Parquet files and the service use it."""
    _check_required(path, table.column_names)
    row_numbers = np.arange(first_row, first_row + table.num_rows)
    columns: dict[str, np.ndarray] = {}
    for name in table.column_names:
        column = table.column(name)
        if name in CHECKED_COLUMNS:
            kind, accepts = _ARROW_KIND[name]
            ok = _is_string_like(column.type) if kind == "string" else accepts(column.type)
            if not ok:
                raise rejection(path, f"column {name}", f"expected {kind} values, got Arrow type {column.type}")
            if column.null_count:
                nulls = column.is_null().to_numpy(zero_copy_only=False)
                raise rejection(path, f"row {row_numbers[int(np.argmax(nulls))]}", f"{name}: missing value")
        if pa.types.is_dictionary(column.type):
            column = column.cast(column.type.value_type)
        values = column.to_numpy(zero_copy_only=False)
        if name in STRING_COLUMNS:
            values = np.asarray(values, dtype=object)
        columns[name] = values
    return columns, row_numbers


_PARQUET_ERRORS = (pa.ArrowException, OSError, ValueError)
"""What reading a damaged Parquet file can raise (bad UTF-8 in its metadata is a UnicodeDecodeError)."""


def _trace_metadata(schema_metadata: dict | None) -> dict:
    if not schema_metadata or METADATA_KEY not in schema_metadata:
        return {}
    try:
        metadata = json.loads(schema_metadata[METADATA_KEY])
    except (ValueError, UnicodeDecodeError):
        return {}
    metadata.pop("format_version", None)
    return metadata if isinstance(metadata, dict) else {}


def read_trace(path: str | os.PathLike, *, speculative_decoding: bool = False) -> StepTrace:
    """Read and validate one trace file; the file type follows from its extension."""
    path = str(path)
    suffix = trace_suffix(path)
    if not os.path.isfile(path):
        raise rejection(path, "file", "no such file")
    metadata: dict = {}
    if suffix == ".jsonl":
        columns, rows = _read_jsonl(path)
    elif suffix == ".csv":
        columns, rows = _read_csv(path)
    else:
        try:
            table = pq.read_table(path)
            _check_required(path, table.column_names)  # decoding the names is where bad UTF-8 fails
        except TraceError:
            raise
        except _PARQUET_ERRORS as error:
            raise rejection(path, "file", f"not a readable Parquet file ({error})") from None
        metadata = _trace_metadata(table.schema.metadata)
        columns, rows = trace_columns_from_arrow(path, table)
    return build_trace(columns, path=path, row_numbers=rows, metadata=metadata, speculative_decoding=speculative_decoding)


def read_traces(paths: Sequence[str | os.PathLike], **kwargs) -> StepTrace:
    """Read several files into one trace; runs keep their ids, so they must not collide across files."""
    traces = [read_trace(path, **kwargs) for path in paths]
    return concat_traces(traces)


def iter_trace(path: str | os.PathLike, *, batch_rows: int = 1 << 20) -> Iterator[StepTrace]:
    """Yield a trace file in pieces of whole steps, so memory stays bounded for large Parquet files.

    Parquet is read by record batches; JSONL and CSV files are read whole. Streaming needs the rows of a
    step to be contiguous in the file (as every llmvisor writer leaves them); a step whose rows are split
    by another step's rows is rejected, naming the step, since it cannot be attributed piecewise.
    """
    path = str(path)
    if trace_suffix(path) != ".parquet":
        yield read_trace(path)
        return
    try:
        parquet = pq.ParquetFile(path)
        names = parquet.schema_arrow.names
    except _PARQUET_ERRORS as error:
        raise rejection(path, "file", f"not a readable Parquet file ({error})") from None
    _check_required(path, names)
    metadata = _trace_metadata(parquet.schema_arrow.metadata)
    finished: set[tuple[str, int]] = set()
    pending: pa.Table | None = None
    first_row = 1
    batches = parquet.iter_batches(batch_size=batch_rows)
    while True:
        try:
            batch = next(batches, None)
        except _PARQUET_ERRORS as error:
            raise rejection(path, f"rows from {first_row}", f"not a readable Parquet file ({error})") from None
        if batch is None:
            break
        table = pa.Table.from_batches([batch])
        if pending is not None:
            table = pa.concat_tables([pending, table.cast(pending.schema)])
        keys_run = table.column("run_id").to_numpy(zero_copy_only=False)
        keys_step = table.column("step_id").to_numpy(zero_copy_only=False)
        last = (keys_run[-1], keys_step[-1])
        tail = np.flatnonzero((keys_run == last[0]) & (keys_step == last[1]))
        cut = int(tail[0]) if tail.size and np.all(np.diff(tail) == 1) and tail[-1] == len(keys_run) - 1 else len(keys_run)
        head, pending = table.slice(0, cut), table.slice(cut)
        if head.num_rows:
            trace = _build_piece(path, head, first_row, metadata, finished)
            first_row += head.num_rows
            yield trace
    if pending is not None and pending.num_rows:
        yield _build_piece(path, pending, first_row, metadata, finished)


def iter_traces(paths: Sequence[str | os.PathLike], *, batch_rows: int = 1 << 20) -> Iterator[StepTrace]:
    """`iter_trace` over several files, refusing a run id already read from another file as `read_traces` does."""
    runs = RunIds()
    for k, path in enumerate(paths):
        for piece in iter_trace(path, batch_rows=batch_rows):
            runs.claim(piece, k, str(path))
            yield piece


def _build_piece(path: str, table: pa.Table, first_row: int, metadata: dict, finished: set) -> StepTrace:
    columns, rows = trace_columns_from_arrow(path, table, first_row)
    trace = build_trace(columns, path=path, row_numbers=rows, metadata=metadata)
    for run, step in zip(trace.run_id_per_step.tolist(), trace.step_id_per_step.tolist()):
        if (run, step) in finished:
            raise rejection(path, f"step {step} of run {run!r}", "rows of this step are not contiguous in the file")
        finished.add((run, step))
    return trace


def trace_from_rows(rows: Sequence[dict], *, path: str = "<memory>", metadata: dict | None = None) -> StepTrace:
    """Validate in-memory rows (dicts with the contract's columns), as the JSONL reader would."""
    row_numbers = list(range(1, len(rows) + 1))
    columns = _columns_from_records(path, list(rows), row_numbers)
    return build_trace(columns, path=path, row_numbers=np.array(row_numbers), metadata=metadata)

