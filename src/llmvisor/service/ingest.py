"""From a POST /v1/steps body to attributed `StepRecords`: parse, validate, attribute, hash.

A body holds trace rows (format v1) of whole steps, in one of three forms:

- JSON ``{"steps": [[row, ...], ...]}``: one list of row objects per step, validated by the trace reader's
  row validator (`llmvisor.core.trace.trace_from_rows`);
- JSON ``{"columns": {"run_id": [...], "step_id": [...], ...}}``: the same rows as one list per column,
  validated by the trace reader's Arrow validator (the one Parquet files go through), vectorised, so several
  times cheaper per row; rows are grouped into steps by (run_id, step_id);
- a trace-format Parquet file (``Content-Type: application/vnd.apache.parquet``), e.g. one the recorder
  wrote, through the same Arrow validator, without the JSON parsing: the cheapest form.

This module adds only the envelope (one group per step) and the limits of storage (string lengths, NUL,
magnitudes); the trace contract itself is checked by `llmvisor.core.trace`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from llmvisor.core.attribution import attribute
from llmvisor.core.fingerprint import FINGERPRINT_COLUMN
from llmvisor.core.lora_trace import decode_adapters, encode_adapters
from llmvisor.core.model import StepLatencyModel
from llmvisor.core.rounding import apportion_ns
from llmvisor.core.tokens import CACHED_PROMPT_COLUMN
from llmvisor.core.trace import (
    REQUIRED_COLUMNS,
    SHARING_COLUMNS,
    StepTrace,
    build_trace,
    check_known_columns,
    trace_columns_from_arrow,
    trace_from_rows,
)
from llmvisor.core.trace_schema import KV_COLUMNS, KV_RUN_COLUMNS, KV_STEP_COLUMNS, LORA_COLUMNS, LORA_STEP_COLUMNS
from llmvisor.errors import LlmvisorError, TraceError, unknown_name
from llmvisor.ledger import StepRecords, StoredSteps

BODY_PATH = "request body"
MAX_STRING_CHARS = 512
MAX_STEP_LATENCY_S = 1e6
MAX_TOKENS = 10**9
MAX_TIMESTAMP_S = 1e11


class PayloadError(LlmvisorError):
    """A request body the service cannot take; ``status`` is the HTTP status, ``reason`` the metric label."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(message)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class PreparedBatch:
    records: StepRecords
    residual_s: np.ndarray
    predicted_step_s: np.ndarray


PARQUET_MEDIA_TYPE = "application/vnd.apache.parquet"


def read_batch(
    body: bytes, *, max_steps: int, max_rows: int, max_decoded_bytes: int, content_type: str | None = None
) -> StepTrace:
    """The validated trace of a body in any form; size limits are a 413, the rest a 400/422.
    ``max_decoded_bytes`` bounds what a Parquet body may decode to (see `_trace_from_parquet`)."""
    if content_type is not None and content_type.split(";")[0].strip().lower() == PARQUET_MEDIA_TYPE:
        trace = _trace_from_parquet(body, max_rows=max_rows, max_decoded_bytes=max_decoded_bytes)
        if trace.n_steps > max_steps:
            raise PayloadError(413, "too_large", f"{BODY_PATH}: {trace.n_steps} steps, at most {max_steps} per request")
        return trace
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as error:
        raise PayloadError(400, "bad_json", f"{BODY_PATH}: not valid JSON ({error})") from None
    if isinstance(payload, dict) and len(payload) > 1 and ("steps" in payload or "columns" in payload):
        extra = unknown_name(payload, ("steps",) if "steps" in payload else ("columns",))
        raise PayloadError(422, "bad_shape", f"{BODY_PATH}: {extra}")
    if isinstance(payload, dict) and "steps" in payload:
        trace = validate_trace(_step_groups(payload["steps"], max_steps=max_steps, max_rows=max_rows))
    elif isinstance(payload, dict) and "columns" in payload:
        trace = _trace_from_columns(payload["columns"], max_rows=max_rows)
        if trace.n_steps > max_steps:
            raise PayloadError(413, "too_large", f"{BODY_PATH}: {trace.n_steps} steps, at most {max_steps} per request")
    else:
        raise PayloadError(
            422, "bad_shape", f'{BODY_PATH}: expected a JSON object {{"steps": [[row, ...], ...]}} or {{"columns": {{...}}}}'
        )
    return trace


def _step_groups(groups, *, max_steps: int, max_rows: int) -> list[list[dict]]:
    if not isinstance(groups, list):
        raise PayloadError(422, "bad_shape", f'{BODY_PATH}: "steps" must be a list of steps, each a list of rows')
    if len(groups) > max_steps:
        raise PayloadError(413, "too_large", f"{BODY_PATH}: {len(groups)} steps, at most {max_steps} per request")
    n_rows = 0
    for i, group in enumerate(groups):
        if not isinstance(group, list) or not group:
            raise PayloadError(422, "bad_shape", f"{BODY_PATH}: steps[{i}]: expected a non-empty list of trace rows")
        for j, row in enumerate(group):
            if not isinstance(row, dict):
                raise PayloadError(422, "bad_shape", f"{BODY_PATH}: steps[{i}][{j}]: expected a JSON object (a trace row)")
        n_rows += len(group)
    if n_rows > max_rows:
        raise PayloadError(413, "too_large", f"{BODY_PATH}: {n_rows} rows, at most {max_rows} per request")
    return groups


STORED_OPTIONAL_COLUMNS = ("timestamp_s",)
TOKEN_COLUMNS = (CACHED_PROMPT_COLUMN,)
"""Kept in the slices' blob and metered (the prefix-cache hit, `llmvisor.core.tokens`), not in the content hash:
a v1 trace without it counts 0 cached prompt tokens."""
RUN_COLUMNS = (FINGERPRINT_COLUMN,)
"""Read, not stored and not in a step's content hash (the idempotency key): the engine fingerprint id the
service compares with its model's (`step_fingerprint_ids`)."""
CHECKED_COLUMNS = (*REQUIRED_COLUMNS, *SHARING_COLUMNS, *KV_COLUMNS, *LORA_COLUMNS)
"""Columns read from every body form and checked by the trace reader; the sharing columns (format v2) are
not stored but priced: shared KV blocks are split among their readers, whichever form the body takes. The KV memory
columns (format v3) are checked (all or none, the pool adding up per step), kept in the slices' blob and in the
step's content hash, and metered: each slice's ``kv_block_ns`` and its run's ``kv_block_bytes`` go to the usage rows.
The LoRA columns (format v4) are checked, priced by a LoRA model (`llmvisor.core.attribution.attribute`), kept in the
slices' blob and in the step's content hash; each slice's ``lora_name`` goes to the usage rows (ledger schema 10)."""
READ_COLUMNS = (*CHECKED_COLUMNS, *STORED_OPTIONAL_COLUMNS, *RUN_COLUMNS, *TOKEN_COLUMNS)
"""Every column the service reads, in every body form (rows, columns, Parquet): a column one form skipped would be
billed differently by form (the Parquet form once dropped the cached prompt tokens)."""


def _trace_from_columns(columns, *, max_rows: int) -> StepTrace:
    """Columns to Arrow arrays (Arrow infers each column's type from the JSON values), then the trace
    reader's Arrow validator. Columns that are not stored are not read."""
    if not isinstance(columns, dict):
        raise PayloadError(422, "bad_shape", f'{BODY_PATH}: "columns" must map column names to lists of values')
    _check_known(list(columns))
    used = [name for name in READ_COLUMNS if name in columns]
    for name in used:
        if not isinstance(columns[name], list):
            raise PayloadError(422, "bad_shape", f"{BODY_PATH}: column {name}: expected a list of values")
    lengths = {len(columns[name]) for name in used}
    if len(lengths) > 1:
        described = ", ".join(f"{name}: {len(columns[name])}" for name in used)
        raise PayloadError(422, "bad_shape", f"{BODY_PATH}: columns differ in length ({described})")
    n_rows = lengths.pop() if lengths else 0
    if n_rows > max_rows:
        raise PayloadError(413, "too_large", f"{BODY_PATH}: {n_rows} rows, at most {max_rows} per request")
    if n_rows == 0:
        return trace_from_rows([], path=BODY_PATH)
    arrays = {}
    for name in used:
        if name in CHECKED_COLUMNS:
            try:
                arrays[name] = pa.array(columns[name])
            except (pa.ArrowException, OverflowError, UnicodeError, TypeError, ValueError) as error:
                raise PayloadError(422, "invalid_trace", f"{BODY_PATH}: column {name}: {error}") from None
        else:
            try:
                arrays[name] = _optional_numbers(pa.array(columns[name]))
            except (pa.ArrowException, OverflowError, UnicodeError, TypeError, ValueError):
                arrays[name] = _objects(columns[name])
    try:
        typed, row_numbers = trace_columns_from_arrow(BODY_PATH, pa.table({k: v for k, v in arrays.items() if isinstance(v, pa.Array)}))
        typed.update({k: v for k, v in arrays.items() if not isinstance(v, pa.Array)})
        trace = build_trace(typed, path=BODY_PATH, row_numbers=row_numbers)
    except TraceError as error:
        raise PayloadError(422, "invalid_trace", str(error)) from None
    _check_storage_limits(trace)
    return trace


def _check_known(names: list) -> None:
    """Refuse a column the trace format does not know (422 naming it and the closest known name), before the
    columns the service reads are picked out: an unknown one would otherwise be dropped in silence."""
    try:
        check_known_columns(BODY_PATH, names)
    except TraceError as error:
        raise PayloadError(422, "invalid_trace", str(error)) from None


def _optional_numbers(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A float64 array when every value is a number; else the values as given (object array), for
    `_step_timestamps` to name the first bad one or to date the steps without one."""
    if (pa.types.is_floating(values.type) or pa.types.is_integer(values.type)) and values.null_count == 0:
        return values.to_numpy().astype(np.float64)
    return _objects(values.to_pylist())


def _objects(values: list) -> np.ndarray:
    """A 1-d object array of the values, whatever they are (lists stay elements)."""
    array = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        array[i] = value
    return array


def check_parquet_footer(parquet: pq.ParquetFile, columns: list[str], *, body_bytes: int, max_decoded_bytes: int) -> None:
    """Refuse, from the footer alone, a file whose columns to read are nested or whose row groups declare more
    uncompressed bytes than ``max_decoded_bytes``."""
    schema = parquet.schema_arrow
    for name in columns:
        kind = schema.field(name).type
        if pa.types.is_nested(kind):
            raise PayloadError(422, "invalid_trace", f"{BODY_PATH}: column {name}: expected a flat column, got Arrow type {kind}")
    metadata = parquet.metadata
    # Row-group totals only: asking pyarrow for a damaged file's column-chunk metadata can abort the process
    # (a C++ exception it does not translate), so no column chunk is looked at before the body is trusted.
    declared_bytes = 0
    for g in range(metadata.num_row_groups):
        declared_bytes += metadata.row_group(g).total_byte_size
    if declared_bytes > max_decoded_bytes:
        raise PayloadError(
            413,
            "too_large",
            f"{BODY_PATH}: Parquet columns declare {declared_bytes} bytes uncompressed, at most {max_decoded_bytes}",
        )


def decoded_string_bytes(column: pa.ChunkedArray) -> int:
    """The bytes a string column takes once its dictionary is expanded, counted without expanding it."""
    total = 0
    for chunk in column.chunks:
        if pa.types.is_dictionary(chunk.type):
            per_row = pc.take(pc.binary_length(chunk.dictionary), chunk.indices)
            total += pc.sum(per_row).as_py() or 0
        elif pa.types.is_string(chunk.type) or pa.types.is_binary(chunk.type):
            total += chunk.buffers()[2].size if chunk.buffers()[2] is not None else 0
    return int(total)


def _trace_from_parquet(body: bytes, *, max_rows: int, max_decoded_bytes: int) -> StepTrace:
    """A Parquet body through the trace reader's Arrow validator; only stored columns are read.

    A small file can decode to a huge table (zstd, or a long string repeated through a dictionary), so
    before any column is read the footer must declare at most ``max_rows`` rows and at most
    ``max_decoded_bytes`` uncompressed bytes in the columns read; string columns are then read as
    dictionaries, and the bytes they would expand to must also stay within ``max_decoded_bytes`` before
    they are expanded. ``max_decoded_bytes`` is the body limit: a Parquet body may not decode to more than a
    JSON body may hold.
    """
    try:
        parquet = pq.ParquetFile(pa.BufferReader(body))
        n_rows = parquet.metadata.num_rows
        if n_rows > max_rows:
            raise PayloadError(413, "too_large", f"{BODY_PATH}: {n_rows} rows, at most {max_rows} per request")
        names = parquet.schema_arrow.names
        _check_known(names)
        columns = [n for n in READ_COLUMNS if n in names]
        check_parquet_footer(parquet, columns, body_bytes=len(body), max_decoded_bytes=max_decoded_bytes)
        physical = {parquet.schema.column(i).path: parquet.schema.column(i).physical_type for i in range(len(parquet.schema))}
        byte_columns = [n for n in columns if physical.get(n) == "BYTE_ARRAY"]
        if byte_columns:
            parquet = pq.ParquetFile(pa.BufferReader(body), metadata=parquet.metadata, read_dictionary=byte_columns)
        table = parquet.read(columns=columns, use_threads=False)
        string_bytes = sum(decoded_string_bytes(table.column(n)) for n in byte_columns)
        if string_bytes > max_decoded_bytes:
            raise PayloadError(
                413, "too_large", f"{BODY_PATH}: Parquet string columns expand to {string_bytes} bytes, at most {max_decoded_bytes}"
            )
        for name in byte_columns:
            column = table.column(name)
            if pa.types.is_dictionary(column.type):
                table = table.set_column(table.schema.get_field_index(name), name, column.cast(column.type.value_type))
    except (pa.ArrowException, OSError, ValueError) as error:  # a damaged file can fail anywhere, even in UTF-8
        raise PayloadError(400, "bad_parquet", f"{BODY_PATH}: not a readable Parquet file ({error})") from None
    if table.num_rows == 0:
        return trace_from_rows([], path=BODY_PATH)
    optional = {name: _optional_numbers(table.column(name))
                for name in (*STORED_OPTIONAL_COLUMNS, *TOKEN_COLUMNS) if name in table.column_names}
    table = table.drop_columns(list(optional))
    try:
        typed, row_numbers = trace_columns_from_arrow(BODY_PATH, table)
        typed.update(optional)
        trace = build_trace(typed, path=BODY_PATH, row_numbers=row_numbers)
    except TraceError as error:
        raise PayloadError(422, "invalid_trace", str(error)) from None
    except (pa.ArrowException, ValueError) as error:
        raise PayloadError(400, "bad_parquet", f"{BODY_PATH}: not a readable Parquet file ({error})") from None
    _check_storage_limits(trace)
    return trace


def _check_one_group_per_step(groups: list[list[dict]]) -> None:
    """Each group holds the rows of one step, and no step is split over two groups.

    Keys of rows whose run_id/step_id have the wrong type are skipped: the trace validator names those.
    """
    seen: dict[tuple[str, int], int] = {}
    for i, group in enumerate(groups):
        first = group[0]
        key = (first.get("run_id"), first.get("step_id"))
        if type(key[0]) is not str or type(key[1]) is not int:
            continue
        for j, row in enumerate(group):
            if row.get("run_id") != key[0] or row.get("step_id") != key[1]:
                if type(row.get("run_id")) is str and type(row.get("step_id")) is int:
                    raise PayloadError(
                        422,
                        "bad_shape",
                        f"{BODY_PATH}: steps[{i}][{j}]: row of step {row['step_id']} of run {row['run_id']!r} in the group "
                        f"of step {key[1]} of run {key[0]!r}; send each step's rows as one group",
                    )
        if key in seen:
            raise PayloadError(
                422,
                "bad_shape",
                f"{BODY_PATH}: steps[{i}]: step {key[1]} of run {key[0]!r} is also steps[{seen[key]}]; send each step once",
            )
        seen[key] = i


def _row_locations(message: str, groups: list[list[dict]]) -> str:
    """Name rows as steps[i][j] as well as by their number in the flattened batch."""
    group_of_row = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
    starts = np.concatenate(([0], np.cumsum([len(g) for g in groups])))

    def name(match: re.Match) -> str:
        row = int(match.group(1))
        if not 1 <= row <= group_of_row.size:
            return match.group(0)
        i = int(group_of_row[row - 1])
        return f"{match.group(0)} (steps[{i}][{row - 1 - int(starts[i])}])"

    return re.sub(r"\brow (\d+)", name, message)


def validate_trace(groups: list[list[dict]]) -> StepTrace:
    """The batch as a validated `StepTrace`, or a `PayloadError` carrying the validator's message."""
    _check_one_group_per_step(groups)
    rows = [row for group in groups for row in group]
    try:
        trace = trace_from_rows(rows, path=BODY_PATH)
    except TraceError as error:
        raise PayloadError(422, "invalid_trace", _row_locations(str(error), groups)) from None
    except OverflowError:
        raise PayloadError(422, "invalid_trace", f"{BODY_PATH}: a number is out of range (integers must fit in 64 bits)") from None
    except UnicodeError:
        raise PayloadError(422, "invalid_trace", f"{BODY_PATH}: a string is not valid Unicode (unpaired surrogate)") from None
    _check_storage_limits(trace)
    return trace


def _check_storage_limits(trace: StepTrace) -> None:
    for name in ("run_id", "request_id", "tenant"):
        values = getattr(trace, name).tolist()
        if not values:
            continue
        if "\x00" in "".join(values):
            raise PayloadError(422, "invalid_trace", f"{BODY_PATH}: {name}: must not contain NUL characters")
        longest = max(map(len, values))
        if longest > MAX_STRING_CHARS:
            raise PayloadError(
                422, "invalid_trace", f"{BODY_PATH}: {name}: {longest} characters, at most {MAX_STRING_CHARS}"
            )
    for name in ("num_new_tokens", "num_context_tokens"):
        values = getattr(trace, name)
        if values.size and values.max() > MAX_TOKENS:
            raise PayloadError(422, "invalid_trace", f"{BODY_PATH}: {name}: {values.max()} tokens, at most {MAX_TOKENS}")
    latency = trace.step_latency_s_per_step
    if latency.size and latency.max() > MAX_STEP_LATENCY_S:
        raise PayloadError(
            422, "invalid_trace", f"{BODY_PATH}: step_latency_s: {float(latency.max())} s, at most {MAX_STEP_LATENCY_S:g} s"
        )


def cached_prompt_tokens(trace: StepTrace) -> np.ndarray | None:
    """Per slice the ``num_cached_prompt_tokens`` fact (a missing value: 0), or None where no row has it; a value
    that is not an integer in [0, num_context_tokens] is refused naming its step (the prefix-cache hit is context the
    request found cached)."""
    values = trace.extra.get(CACHED_PROMPT_COLUMN)
    if values is None:
        return None
    out = np.zeros(trace.n_slices, dtype=np.int64)
    context = trace.num_context_tokens
    for k, value in enumerate(np.asarray(values, dtype=object).tolist()):
        if value is None:
            continue
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= context[k]:
            step = int(trace.slice_step_index[k])
            raise PayloadError(
                422, "invalid_trace",
                f"{BODY_PATH}: step {trace.step_id_per_step[step]} of run {trace.run_id_per_step[step]!r}: {CACHED_PROMPT_COLUMN}: "
                f"expected an integer from 0 to the slice's num_context_tokens ({int(context[k])}), got {value!r}",
            )
        out[k] = int(value)
    return out


def _step_timestamps(trace: StepTrace) -> list[float | None]:
    """Each step's ``timestamp_s`` (Unix seconds) or None; rows of a step must agree."""
    values = trace.extra.get("timestamp_s")
    if values is None:
        return [None] * trace.n_steps
    per_step = values[trace.step_starts]
    out: list[float | None] = []
    for k, value in enumerate(per_step.tolist()):
        if value is not None:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not ok or not math.isfinite(value) or not 0 <= value < MAX_TIMESTAMP_S:
                raise PayloadError(
                    422,
                    "invalid_trace",
                    f"{BODY_PATH}: step {trace.step_id_per_step[k]} of run {trace.run_id_per_step[k]!r}: timestamp_s: "
                    f"expected Unix seconds (a number >= 0), got {value!r}",
                )
            value = float(value)
        out.append(value)
    disagree = np.flatnonzero(values != np.repeat(per_step, trace.batch_size_per_step))
    if disagree.size:
        k = int(trace.slice_step_index[disagree[0]])
        raise PayloadError(
            422,
            "invalid_trace",
            f"{BODY_PATH}: step {trace.step_id_per_step[k]} of run {trace.run_id_per_step[k]!r}: rows disagree on timestamp_s",
        )
    return out


def content_digests(trace: StepTrace, timestamps_s: list[float | None], *, with_run_id: bool = True) -> list[bytes]:
    """SHA-256 of each step's canonical content (encoding v1, which stored ledgers hold, so it must not
    change): ``v1␞{len(run_id)}␟{run_id}␟{step_id}␟{repr(latency_s)}␟{repr(timestamp_s)}␞`` followed by one
    ``{len(request_id)}␟{request_id}␟{len(tenant)}␟{tenant}␟{new}␟{context}␟{0|1 prefill}␟`` per slice, sorted
    by request id (␞ = 0x1e, ␟ = 0x1f, lengths in characters). Columns other than the required ones and
    ``timestamp_s`` are not stored and so not hashed. ``with_run_id=False``: the same content with the header
    ``run-v1␞{step_id}␟…`` (no run id), the digest a run re-sent under another run id repeats (`run_digests`).
    A step with the KV memory columns (format 3) adds ``kv3␟{step and run KV values}␞`` after the header and its
    ``kv_block_ns`` as each slice's last field before the closing ␟, so a re-send with other KV figures is a conflict;
    a step with the LoRA columns (format 4) adds ``lora4␟{its three adapter sets}␞`` after that and each slice's
    ``lora_name`` and ``lora_rank`` after those; a step without them hashes as it always did."""
    n = trace.n_slices
    if n == 0:
        return []
    request = pa.array(trace.request_id, pa.string())
    order = pc.sort_indices(
        pa.table({"step": trace.slice_step_index, "request": request}),
        sort_keys=[("step", "ascending"), ("request", "ascending")],
    )
    request = request.take(order)
    tenant = pa.array(trace.tenant, pa.string()).take(order)
    fields = [
        pc.cast(pc.utf8_length(request), pa.string()),
        request,
        pc.cast(pc.utf8_length(tenant), pa.string()),
        tenant,
        pc.cast(pa.array(trace.num_new_tokens).take(order), pa.string()),
        pc.cast(pa.array(trace.num_context_tokens).take(order), pa.string()),
        pa.array(trace.is_prefill).take(order).cast(pa.int8()).cast(pa.string()),
    ]
    kv = kv_columns(trace)
    if kv is not None:  # format 3: each slice's block-ns too (a step without them hashes as before)
        fields.append(pc.cast(pa.array(kv["kv_block_ns"]).take(order), pa.string()))
    lora = lora_columns(trace)
    if lora is not None:  # format 4: each slice's adapter and rank too
        fields.append(pa.array(lora["lora_name"], pa.string()).take(order))
        fields.append(pc.cast(pa.array(lora["lora_rank"], pa.int64()).take(order), pa.string()))
    fields.append(pa.scalar("", pa.string()))
    lines = pc.binary_join_element_wise(*fields, "\x1f").cast(pa.large_string())
    line_offsets = np.frombuffer(lines.buffers()[1], dtype=np.int64)[lines.offset : lines.offset + n + 1]
    data = memoryview(lines.buffers()[2]) if lines.buffers()[2] is not None else memoryview(b"")
    slice_bounds = line_offsets[trace.step_offsets].tolist()
    digests = []
    for k, (run_id, step_id, latency_s, timestamp_s) in enumerate(
        zip(trace.run_id_per_step.tolist(), trace.step_id_per_step.tolist(), trace.step_latency_s_per_step.tolist(), timestamps_s)
    ):
        named = f"v1\x1e{len(run_id)}\x1f{run_id}\x1f" if with_run_id else "run-v1\x1e"
        header = f"{named}{step_id}\x1f{latency_s!r}\x1f{timestamp_s!r}\x1e".encode()
        if kv is not None:
            first = int(trace.step_offsets[k])
            header += ("kv3\x1f" + "\x1f".join(str(int(kv[name][first])) for name in KV_STEP_AND_RUN) + "\x1e").encode()
        if lora is not None:
            first = int(trace.step_offsets[k])
            header += ("lora4\x1f" + "\x1f".join(canonical_adapters(lora[name][first]) for name in LORA_STEP_COLUMNS) + "\x1e").encode()
        digest = hashlib.sha256(header)
        digest.update(data[slice_bounds[k] : slice_bounds[k + 1]])
        digests.append(digest.digest())
    return digests


KV_STEP_AND_RUN = (*KV_STEP_COLUMNS, *KV_RUN_COLUMNS)
"""The KV columns of a step and its run, in the content hash's order."""


def kv_columns(trace: StepTrace) -> dict[str, np.ndarray] | None:
    """The format-3 KV memory columns per slice as int64 (the reader checked them), or None where the trace has
    none (format 1 or 2: billed for time only)."""
    if not all(name in trace.extra for name in KV_COLUMNS):
        return None
    return {name: np.asarray(trace.extra[name], dtype=np.int64) for name in KV_COLUMNS}


def lora_columns(trace: StepTrace) -> dict[str, np.ndarray] | None:
    """The format-4 LoRA columns per slice (the reader checked them: ``lora_rank`` int64, the rest strings), or None
    where the trace has none (every slice ran the base model)."""
    if not all(name in trace.extra for name in LORA_COLUMNS):
        return None
    return {name: np.asarray(trace.extra[name], dtype=np.int64 if name == "lora_rank" else object) for name in LORA_COLUMNS}


def canonical_adapters(text: str) -> str:
    """An adapter set as the trace writer writes it (sorted, compact): the reader takes any order, the hash one."""
    return encode_adapters(decode_adapters(text) or ())


def run_digests(trace: StepTrace, timestamps_s: list[float | None]) -> list[bytes | None] | None:
    """Per step, for a run's step 0 that carries ``timestamp_s``, its content digest without the run id (the
    ledger refuses a new run whose step 0 repeats a stored run's: a re-send under a new run id); None for other
    steps, and None for a batch without such a step (the usual batch: the check costs one lookup per new run).
    A step 0 without ``timestamp_s`` is dated on arrival, so two runs doing the same work would be identical:
    it is not fingerprinted."""
    first = (trace.step_id_per_step == 0) & np.asarray([t is not None for t in timestamps_s], dtype=bool)
    if not first.any():
        return None
    part = trace.select_steps(first)
    digests = iter(content_digests(part, [t for t, keep in zip(timestamps_s, first.tolist()) if keep], with_run_id=False))
    return [next(digests) if keep else None for keep in first.tolist()]


@dataclass(frozen=True)
class ModelChoice:
    """How the steps of one engine class are attributed: by ``model`` (registry ``version``, None for the
    service's default model), or, with no model, stored pending."""

    model: StepLatencyModel | None
    version: int | None = None

    @property
    def pending(self) -> bool:
        return self.model is None


def prepare_batch(
    model: StepLatencyModel | None,
    trace: StepTrace,
    *,
    received_at_us: int,
    choose: Callable[[str], ModelChoice] | None = None,
    timestamps_us: np.ndarray | None = None,
) -> PreparedBatch:
    """Attribute a validated batch; steps without ``timestamp_s`` are dated ``received_at_us``.

    ``choose`` picks each engine class's model (the step's fingerprint id, `step_fingerprint_ids`); without
    it ``model`` attributes every step. Pending steps get no shares (``attributed_ns`` 0, ``predicted_s``
    NaN). ``timestamps_us`` dates the steps instead of their rows (steps read back from the ledger).
    """
    timestamps_s = _step_timestamps(trace) if timestamps_us is None else [t / 1e6 for t in timestamps_us.tolist()]
    classes = step_fingerprint_ids(trace)
    choices: dict[str, ModelChoice] = {}
    for engine_class in dict.fromkeys(classes.tolist()):
        choices[engine_class] = ModelChoice(model) if choose is None else choose(engine_class)
    measured_s = trace.step_latency_s_per_step
    share_s = np.zeros(trace.n_slices)
    predicted_s = np.full(trace.n_steps, np.nan)
    model_version = np.full(trace.n_steps, -1, dtype=np.int64)
    pending = np.zeros(trace.n_steps, dtype=bool)
    groups: dict[tuple[int, int | None], list[str]] = {}
    for engine_class, choice in choices.items():
        groups.setdefault((id(choice.model), choice.version), []).append(engine_class)
    for group_classes in groups.values():
        choice = choices[group_classes[0]]
        steps = np.isin(classes, group_classes) if len(choices) > 1 else np.ones(trace.n_steps, dtype=bool)
        if choice.pending:
            pending |= steps
            continue
        part = trace if steps.all() else trace.select_steps(steps)
        attribution = attribute(choice.model, part)
        share_s[np.repeat(steps, trace.batch_size_per_step)] = attribution.share_s
        predicted_s[steps] = attribution.predicted_step_s
        model_version[steps] = -1 if choice.version is None else choice.version
    measured_ns = np.rint(measured_s * 1e9).astype(np.int64)
    attributed_ns = apportion_ns(share_s, trace.step_offsets, measured_ns)
    if pending.any():
        attributed_ns[np.repeat(pending, trace.batch_size_per_step)] = 0
    if timestamps_us is None:
        timestamps_us = np.asarray([received_at_us if t is None else int(round(t * 1e6)) for t in timestamps_s], dtype=np.int64)
    sharing = trace.has_sharing_columns
    records = StepRecords(
        run_id=trace.run_id_per_step,
        step_id=trace.step_id_per_step,
        step_latency_s=measured_s,
        measured_ns=measured_ns,
        predicted_s=predicted_s,
        timestamp_us=timestamps_us,
        content_sha256=content_digests(trace, timestamps_s),
        run_sha256=run_digests(trace, timestamps_s),
        step_offsets=trace.step_offsets,
        request_id=trace.request_id,
        tenant=trace.tenant,
        num_new_tokens=trace.num_new_tokens,
        num_context_tokens=trace.num_context_tokens,
        is_prefill=trace.is_prefill,
        attributed_ns=attributed_ns,
        engine_class=classes,
        model_version=model_version,
        pending=pending,
        num_shared_context_tokens=trace.num_shared_context_tokens if sharing else None,
        effective_context_tokens=trace.effective_context_tokens if sharing else None,
        num_cached_prompt_tokens=cached_prompt_tokens(trace),
        kv_columns=kv_columns(trace),
        lora_columns=lora_columns(trace),
    )
    return PreparedBatch(records=records, residual_s=measured_s - predicted_s, predicted_step_s=predicted_s)


def trace_from_stored(stored: StoredSteps, engine_class: str) -> StepTrace:
    """The trace of steps read back from the ledger (`Ledger.stored_steps`), each carrying ``engine_class``.

    Sharing columns are kept where the blob holds them; slices stored without them read as unshared."""
    table = stored.slices
    if table.num_rows == 0:
        return trace_from_rows([], path="ledger")
    columns = {name: table[name] for name in REQUIRED_COLUMNS}
    if all(name in table.column_names for name in SHARING_COLUMNS):
        context = table["num_context_tokens"]
        columns["num_shared_context_tokens"] = pc.fill_null(table["num_shared_context_tokens"], 0)
        columns["effective_context_tokens"] = pc.coalesce(table["effective_context_tokens"], pc.cast(context, pa.float64()))
    phase = table["phase"]
    if pa.types.is_dictionary(phase.type):
        columns["phase"] = pc.cast(phase, pa.string())
    typed, row_numbers = trace_columns_from_arrow("ledger", pa.table(columns))
    typed[FINGERPRINT_COLUMN] = np.full(table.num_rows, engine_class, dtype=object)
    if CACHED_PROMPT_COLUMN in table.column_names:
        typed[CACHED_PROMPT_COLUMN] = np.asarray(pc.fill_null(table[CACHED_PROMPT_COLUMN], 0).to_pylist(), dtype=object)
    if all(name in table.column_names for name in KV_COLUMNS):  # a format-3 step keeps its KV memory through pending
        for name in KV_COLUMNS:
            typed[name] = table[name].to_numpy().astype(np.int64)
    if all(name in table.column_names for name in LORA_COLUMNS):  # a format-4 step keeps its adapters through pending
        # (a step stored without them, read with others that have them, ran the base model)
        for name, missing in zip(LORA_COLUMNS, ("", 0, "[]", "[]", "[]")):
            values = pc.fill_null(table[name], missing)
            typed[name] = values.to_numpy().astype(np.int64) if name == "lora_rank" else np.asarray(values.to_pylist(), dtype=object)
    return build_trace(typed, path="ledger", row_numbers=row_numbers)


def attribute_stored(model: StepLatencyModel, version: int | None, stored: StoredSteps, engine_class: str) -> PreparedBatch:
    """Attribute steps read back from the ledger with a model (the records `Ledger.resolve_pending` takes)."""
    trace = trace_from_stored(stored, engine_class)
    when = dict(zip(stored.keys, stored.timestamp_us.tolist()))
    timestamps_us = np.asarray(
        [when[(r, s)] for r, s in zip(trace.run_id_per_step.tolist(), trace.step_id_per_step.tolist())], dtype=np.int64
    )
    return prepare_batch(
        model, trace, received_at_us=0, choose=lambda _c: ModelChoice(model, version), timestamps_us=timestamps_us
    )


def step_fingerprint_ids(trace: StepTrace) -> np.ndarray:
    """Per step, the engine fingerprint id its first row carries (``""`` where none), as an object array."""
    ids = np.full(trace.n_steps, "", dtype=object)
    if FINGERPRINT_COLUMN in trace.extra and trace.n_steps:
        values = np.asarray(trace.extra[FINGERPRINT_COLUMN], dtype=object)[trace.step_starts]
        for k, value in enumerate(values):
            if isinstance(value, str) and len(value) <= MAX_STRING_CHARS:
                ids[k] = value
    return ids
