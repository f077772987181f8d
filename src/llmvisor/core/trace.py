"""Read, validate and write step traces (format versions 1 and 2, `docs/trace-format.md`).

A trace has one row per request slice per step. In memory it is a `StepTrace`: columnar numpy arrays with
the slices of each step made contiguous and ordered by (run_id, step_id), plus per-step views
(`step_offsets`, `step_latency_s_per_step`, ...) that the features, the model and attribution use.

Every rejection the contract lists is a `TraceError` whose message names the file, the row (1-based data
row: the JSONL line, the CSV line after the header, the Parquet row) or the step, and the reason.

Version 2 adds two optional per-slice columns describing KV blocks shared between the slices of a step
(prefix caching): ``num_shared_context_tokens`` and ``effective_context_tokens``. A trace without them (v1)
means nothing is shared; a trace gives both or neither.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import itertools
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from llmvisor.core.files import replaced_atomically
from llmvisor.core.fingerprint import FINGERPRINT_COLUMN, is_fingerprint_id
from llmvisor.core.tokens import CACHED_PROMPT_COLUMN
from llmvisor.errors import TraceError, plain, unknown_name

FORMAT_VERSION = 2
"""The newest format version; files without the sharing columns are written as version 1."""
METADATA_KEY = b"llmvisor.trace"

SHARING_COLUMNS = ("num_shared_context_tokens", "effective_context_tokens")
"""The format-2 columns: per slice, context tokens in KV blocks other slices of the step also read, and the
context with each block divided among its readers. Both or neither."""
SHARING_TOLERANCE = 1e-9
"""Relative slack (of num_context_tokens, at least one token's worth) allowed in the bounds on
``effective_context_tokens``, a sum of fractions that floating point cannot always hit exactly."""
STRING_COLUMNS = ("run_id", "request_id", "tenant", "phase")
INTEGER_COLUMNS = ("step_id", "num_new_tokens", "num_context_tokens", "num_shared_context_tokens")
FLOAT_COLUMNS = ("step_latency_s", "effective_context_tokens")
REQUIRED_COLUMNS = (
    "run_id",
    "step_id",
    "step_latency_s",
    "request_id",
    "tenant",
    "num_new_tokens",
    "num_context_tokens",
    "phase",
)
OPTIONAL_COLUMNS = (
    "timestamp_s", "is_warmup", "engine", "engine_version", "model", "hardware", "tensor_parallel_size",
    FINGERPRINT_COLUMN, "is_drifted", CACHED_PROMPT_COLUMN, "model_version", "episode", *SHARING_COLUMNS,
)
"""Every optional column of the format (v1's, and v2's sharing columns): what any llmvisor writer emits or reader
uses (``episode``: the fit's folds, `llmvisor.core.model.EPISODE_COLUMN`; ``model_version``: the raw-step archive)."""
KNOWN_COLUMNS = (*REQUIRED_COLUMNS, *OPTIONAL_COLUMNS)
"""The columns a trace may have. Any other is refused, naming the closest known one: a misspelled optional
column dropped in silence would bill wrongly (``engine_fingerprint_id``: billed as class ""), so a future
optional column comes with a new format version rather than by tolerance."""
KNOWN_SET = frozenset(KNOWN_COLUMNS)
CHECKED_COLUMNS = (*REQUIRED_COLUMNS, *SHARING_COLUMNS)
"""Columns whose values the reader type-checks (the optional ones only when present)."""
PHASES = ("prefill", "decode")
SUFFIXES = (".jsonl", ".csv", ".parquet")

WARMUP_TRUE = frozenset({"true", "1", "yes", "y", "t"})
WARMUP_FALSE = frozenset({"false", "0", "no", "n", "f", ""})


def parse_is_warmup(values: np.ndarray, *, path: str = "<memory>") -> np.ndarray:
    """The optional ``is_warmup`` column as booleans: the one reading used by the model and the profiler.

    Booleans and numbers count as usual (nonzero is warm-up); text is read case-insensitively as
    true/1/yes/y/t or false/0/no/n/f/empty. Any other value is a ``TraceError`` naming it, rather than a
    guess (a bare ``bool("no")`` would be True).
    """
    values = np.asarray(values)
    if values.dtype == bool:
        return values
    if values.dtype.kind in "iuf":
        return values != 0
    flags = np.zeros(values.shape[0], dtype=bool)
    for i, value in enumerate(values.tolist()):
        if value is None:
            continue
        if isinstance(value, (bool, int, float)):
            flags[i] = bool(value)
            continue
        text = str(value).strip().lower()
        if text in WARMUP_TRUE:
            flags[i] = True
        elif text not in WARMUP_FALSE:
            raise TraceError(f"{path}: slice {i + 1}: is_warmup: expected true/false, yes/no or 1/0, got {value!r}")
    return flags


ARROW_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("step_id", pa.int64()),
        ("step_latency_s", pa.float64()),
        ("request_id", pa.string()),
        ("tenant", pa.string()),
        ("num_new_tokens", pa.int64()),
        ("num_context_tokens", pa.int64()),
        ("phase", pa.string()),
    ]
)
"""The one definition of the required columns, used by every reader and writer."""
SHARING_ARROW_FIELDS = {
    "num_shared_context_tokens": pa.int64(),
    "effective_context_tokens": pa.float64(),
}
"""The Arrow types of the version-2 columns, as the writers store them."""


def format_version(column_names) -> int:
    """2 when the sharing columns are present, else 1: the version a file with these columns is."""
    return 2 if all(name in column_names for name in SHARING_COLUMNS) else 1


def sharing_columns_from_blocks(num_context_tokens, block_readers) -> tuple[np.ndarray, np.ndarray]:
    """The version-2 columns of one step from its KV block structure.

    ``block_readers`` lists the step's context KV blocks as ``(tokens, reader indices)``: the tokens of the
    block that lie in its readers' contexts and the slices (indices into ``num_context_tokens``) reading it.
    Context tokens not covered by a listed block are read by their slice alone. Returns
    ``(num_shared_context_tokens, effective_context_tokens)``.
    """
    context = np.asarray(num_context_tokens, dtype=np.int64)
    shared = np.zeros(context.shape[0], dtype=np.int64)
    effective = context.astype(np.float64)
    covered = np.zeros(context.shape[0], dtype=np.int64)
    for tokens, readers in block_readers:
        readers = np.unique(np.asarray(readers, dtype=np.intp))
        covered[readers] += int(tokens)
        if readers.size >= 2:
            shared[readers] += int(tokens)
            effective[readers] -= tokens - tokens / readers.size
    if np.any(covered > context):
        i = int(np.argmax(covered > context))
        raise ValueError(f"slice {i}: its blocks hold {covered[i]} context tokens, more than its {context[i]}")
    return shared, effective


@dataclass
class StepTrace:
    """A validated step trace, slices grouped by step.

    Attributes
    ----------
    run_id, request_id, tenant : object arrays of str, one entry per slice.
    step_id, num_new_tokens, num_context_tokens : int64 arrays, one entry per slice.
    step_latency_s : float64 array, one entry per slice (equal within a step).
    is_prefill : bool array, one entry per slice.
    extra : optional and unknown columns, kept as given.
    metadata : trace-level facts (noise floor, provenance), carried by Parquet files.
    step_offsets : int64 array of n_steps + 1: the slices of step k are ``step_offsets[k]:step_offsets[k + 1]``.
    """

    run_id: np.ndarray
    step_id: np.ndarray
    step_latency_s: np.ndarray
    request_id: np.ndarray
    tenant: np.ndarray
    num_new_tokens: np.ndarray
    num_context_tokens: np.ndarray
    is_prefill: np.ndarray
    step_offsets: np.ndarray
    extra: dict[str, np.ndarray] = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)
    sources: tuple[str, ...] = ()

    # The three members below let scikit-learn treat a trace as X with one sample per step
    # (``_num_samples`` reads ``shape[0]``, ``_safe_indexing`` calls ``trace[indices, ...]``), so model
    # selection (GridSearchCV with GroupKFold) can split a trace by steps.
    @property
    def shape(self) -> tuple[int]:
        """``(n_steps,)``: a trace's samples are its steps."""
        return (self.n_steps,)

    def __len__(self) -> int:
        return self.n_steps

    def __getitem__(self, key) -> StepTrace:
        """The sub-trace of the steps ``key`` selects (integer indices in the given order, a boolean mask or a
        slice); a ``(key, ...)`` tuple, as scikit-learn passes, is the same."""
        if isinstance(key, tuple):
            if len(key) != 2 or key[1] is not Ellipsis:
                raise TypeError("a trace is indexed by steps only: trace[steps] or trace[steps, ...]")
            key = key[0]
        if isinstance(key, slice):
            return self.take_steps(np.arange(self.n_steps)[key])
        index = np.asarray(key)
        if index.dtype == bool:
            return self.select_steps(index)
        if index.ndim != 1 or index.dtype.kind not in "iu":
            raise TypeError(f"a trace is indexed by a 1-d array of step indices or a step mask, got {key!r}")
        return self.take_steps(index)

    def take_steps(self, steps: np.ndarray) -> StepTrace:
        """A trace of the steps at indices ``steps``, in that order (repeats allowed)."""
        steps = np.asarray(steps, dtype=np.intp)
        sizes = self.batch_size_per_step[steps]
        offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        starts = self.step_starts[steps]
        slices = np.repeat(starts - offsets[:-1], sizes) + np.arange(offsets[-1])
        return StepTrace(
            run_id=self.run_id[slices],
            step_id=self.step_id[slices],
            step_latency_s=self.step_latency_s[slices],
            request_id=self.request_id[slices],
            tenant=self.tenant[slices],
            num_new_tokens=self.num_new_tokens[slices],
            num_context_tokens=self.num_context_tokens[slices],
            is_prefill=self.is_prefill[slices],
            step_offsets=offsets,
            extra={name: values[slices] for name, values in self.extra.items()},
            metadata=dict(self.metadata),
            sources=self.sources,
        )

    @property
    def n_slices(self) -> int:
        return int(self.num_new_tokens.shape[0])

    @property
    def n_steps(self) -> int:
        return int(self.step_offsets.shape[0] - 1)

    @property
    def step_starts(self) -> np.ndarray:
        return self.step_offsets[:-1]

    @property
    def batch_size_per_step(self) -> np.ndarray:
        return np.diff(self.step_offsets)

    @property
    def slice_step_index(self) -> np.ndarray:
        """For every slice, the index of its step (0..n_steps-1)."""
        return np.repeat(np.arange(self.n_steps), self.batch_size_per_step)

    @property
    def step_latency_s_per_step(self) -> np.ndarray:
        return self.step_latency_s[self.step_starts]

    @property
    def run_id_per_step(self) -> np.ndarray:
        return self.run_id[self.step_starts]

    @property
    def step_id_per_step(self) -> np.ndarray:
        return self.step_id[self.step_starts]

    @property
    def is_prefill_per_step(self) -> np.ndarray:
        """A step is "prefill" if any of its slices is a prefill slice."""
        if self.n_steps == 0:
            return np.zeros(0, dtype=bool)
        return np.logical_or.reduceat(self.is_prefill, self.step_starts)

    @property
    def is_warmup_per_step(self) -> np.ndarray:
        """Steps the recorder marked as warm-up (optional column ``is_warmup`` on any of its rows)."""
        if "is_warmup" not in self.extra or self.n_steps == 0:
            return np.zeros(self.n_steps, dtype=bool)
        values = parse_is_warmup(self.extra["is_warmup"], path=", ".join(self.sources) or "<memory>")
        return np.logical_or.reduceat(values, self.step_starts)

    @property
    def is_drifted_per_step(self) -> np.ndarray:
        """Steps a profile flagged as run while the machine drifted (optional column ``is_drifted``, read as
        ``is_warmup`` is)."""
        if "is_drifted" not in self.extra or self.n_steps == 0:
            return np.zeros(self.n_steps, dtype=bool)
        values = parse_is_warmup(self.extra["is_drifted"], path=", ".join(self.sources) or "<memory>")
        return np.logical_or.reduceat(values, self.step_starts)

    def engine_fingerprint_ids(self) -> list[str]:
        """The distinct engine fingerprint ids of the trace's steps (column ``engine_fingerprint``), in order of
        first appearance; the metadata's fingerprint when the column is absent."""
        if "engine_fingerprint" in self.extra:
            values = [str(v) for v in np.asarray(self.extra["engine_fingerprint"], dtype=object) if v is not None and str(v)]
            return list(dict.fromkeys(values))
        recorded = self.metadata.get("engine_fingerprint")
        return [str(recorded["id"])] if isinstance(recorded, dict) and recorded.get("id") else []

    @property
    def has_sharing_columns(self) -> bool:
        """Whether the trace carries the version-2 sharing columns."""
        return all(name in self.extra for name in SHARING_COLUMNS)

    @property
    def num_shared_context_tokens(self) -> np.ndarray:
        """Per slice, context tokens in KV blocks other slices of its step also read (0 in a v1 trace)."""
        if not self.has_sharing_columns:
            return np.zeros(self.n_slices, dtype=np.int64)
        return np.asarray(self.extra["num_shared_context_tokens"], dtype=np.int64)

    @property
    def effective_context_tokens(self) -> np.ndarray:
        """Per slice, the context with each KV block divided among its readers in the step (the context
        itself in a v1 trace: nothing shared)."""
        if not self.has_sharing_columns:
            return self.num_context_tokens.astype(np.float64)
        return np.asarray(self.extra["effective_context_tokens"], dtype=np.float64)

    @property
    def has_shared_context_per_step(self) -> np.ndarray:
        """Steps where some slice reads context shared with another slice (num_shared_context_tokens > 0)."""
        if not self.has_sharing_columns or self.n_steps == 0:
            return np.zeros(self.n_steps, dtype=bool)
        return np.logical_or.reduceat(self.num_shared_context_tokens > 0, self.step_starts)

    @property
    def run_ids(self) -> list[str]:
        return list(dict.fromkeys(self.run_id_per_step.tolist()))

    @property
    def phase(self) -> np.ndarray:
        return np.where(self.is_prefill, "prefill", "decode").astype(object)

    def select_steps(self, step_mask: np.ndarray) -> StepTrace:
        """A trace holding only the steps where ``step_mask`` is true."""
        step_mask = np.asarray(step_mask, dtype=bool)
        slice_mask = np.repeat(step_mask, self.batch_size_per_step)
        sizes = self.batch_size_per_step[step_mask]
        offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        return StepTrace(
            run_id=self.run_id[slice_mask],
            step_id=self.step_id[slice_mask],
            step_latency_s=self.step_latency_s[slice_mask],
            request_id=self.request_id[slice_mask],
            tenant=self.tenant[slice_mask],
            num_new_tokens=self.num_new_tokens[slice_mask],
            num_context_tokens=self.num_context_tokens[slice_mask],
            is_prefill=self.is_prefill[slice_mask],
            step_offsets=offsets,
            extra={name: values[slice_mask] for name, values in self.extra.items()},
            metadata=dict(self.metadata),
            sources=self.sources,
        )

    def select_runs(self, run_ids: Sequence[str]) -> StepTrace:
        return self.select_steps(np.isin(self.run_id_per_step, list(run_ids)))

    def to_arrow(self) -> pa.Table:
        columns = {
            "run_id": pa.array(self.run_id, pa.string()),
            "step_id": pa.array(self.step_id, pa.int64()),
            "step_latency_s": pa.array(self.step_latency_s, pa.float64()),
            "request_id": pa.array(self.request_id, pa.string()),
            "tenant": pa.array(self.tenant, pa.string()),
            "num_new_tokens": pa.array(self.num_new_tokens, pa.int64()),
            "num_context_tokens": pa.array(self.num_context_tokens, pa.int64()),
            "phase": pa.array(self.phase, pa.string()),
        }
        for name, values in self.extra.items():
            columns[name] = pa.array(values.tolist() if values.dtype == object else values)
        for name, data_type in SHARING_ARROW_FIELDS.items():
            if name in columns:
                columns[name] = columns[name].cast(data_type)
        table = pa.table(columns)
        metadata = {METADATA_KEY: json.dumps({"format_version": format_version(columns), **self.metadata}).encode()}
        return table.replace_schema_metadata(metadata)


# ---------------------------------------------------------------------------------------------------------
# Building and validating


def _fail(path: str, where: str, reason: str) -> TraceError:
    return TraceError(f"{path}: {where}: {reason}")


def _check_required(path: str, names: Sequence[str]) -> None:
    """The header holds no column the format does not know and every required column. Unknown names are checked
    first: a misspelled required column (``tenat``) is better named with its suggestion than reported missing."""
    check_known_columns(path, names)
    missing = [name for name in REQUIRED_COLUMNS if name not in names]
    if missing:
        raise _fail(path, "header", f"missing column(s) {', '.join(missing)}")


def check_known_columns(path: str, names: Sequence[str], *, where: str = "header", kind: str = "column") -> None:
    """Refuse a column not in `KNOWN_COLUMNS`, naming it and the closest known name."""
    unknown = unknown_name(names, KNOWN_COLUMNS, kind=kind)
    if unknown:
        raise _fail(path, where, unknown)


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
            raise _fail(path, f"row {row_numbers[i]}", f"{column}: {reason} (got {plain(columns[column][i])!r})")

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
    sharing = [name for name in SHARING_COLUMNS if name in columns]
    if len(sharing) == 1:
        (other,) = set(SHARING_COLUMNS) - set(sharing)
        raise _fail(path, "header", f"column {sharing[0]} without {other}: the sharing columns come together (format version 2)")
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
        low = np.minimum.reduceat(sorted_latency, starts)
        high = np.maximum.reduceat(sorted_latency, starts)
        disagree = np.flatnonzero(low != high)
        if disagree.size:
            k = disagree[0]
            rows = row_numbers[order[offsets[k] : offsets[k + 1]]]
            raise _fail(
                path,
                f"step {sorted_step[starts[k]]} of run {plain(run_id[order[starts[k]]])!r} (rows {_rows(rows)})",
                f"rows disagree on step_latency_s ({float(low[k])!r} vs {float(high[k])!r})",
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
            raise _fail(
                path,
                f"step {step_id[a]} of run {plain(run_id[a])!r} (rows {row_numbers[min(a, b)]} and {row_numbers[max(a, b)]})",
                f"request {plain(request_id[a])!r} appears twice in one step",
            )

    if shared_tokens is not None and n:
        sharers = np.add.reduceat((shared_tokens[order] > 0).astype(np.int64), starts)
        lone = np.flatnonzero(sharers == 1)
        if lone.size:
            k = lone[0]
            rows = row_numbers[order[offsets[k] : offsets[k + 1]]]
            raise _fail(
                path,
                f"step {sorted_step[starts[k]]} of run {run_id[order[starts[k]]]!r} (rows {_rows(rows)})",
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


def _rows(rows: np.ndarray) -> str:
    rows = sorted(int(r) for r in rows)
    return ", ".join(map(str, rows[:5])) + (", ..." if len(rows) > 5 else "")


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
                    raise _fail(path, f"row {row}", f"{name}: {reason}")
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
                raise _fail(path, f"row {line_number}", f"not valid JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise _fail(path, f"row {line_number}", "expected a JSON object")
            records.append(record)
            rows.append(line_number)
    return _columns_from_records(path, records, rows), np.array(rows, dtype=np.int64)


def _parse_strings(path: str, name: str, values: pa.Array, row_numbers: np.ndarray) -> np.ndarray:
    """Convert a string column to its contract type, naming the first row that does not parse."""
    if name in STRING_COLUMNS or name not in CHECKED_COLUMNS:
        if name in REQUIRED_COLUMNS:
            empty = np.asarray(pc.equal(values, "").to_numpy(zero_copy_only=False), dtype=bool)
            if empty.any():
                raise _fail(path, f"row {row_numbers[int(np.argmax(empty))]}", f"{name}: missing value")
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
                raise _fail(path, f"row {row_numbers[i]}", f"{name}: {reason}") from None
        raise


def _read_csv(path: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    with open(path, encoding="utf-8", newline="") as handle:
        header = next(csv.reader(handle), None)
    if not header:
        raise _fail(path, "header", "empty file (a CSV trace needs a header row)")
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
        raise _fail(path, "file", f"not a valid CSV table ({error})") from None
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
                raise _fail(path, f"column {name}", f"expected {kind} values, got Arrow type {column.type}")
            if column.null_count:
                nulls = column.is_null().to_numpy(zero_copy_only=False)
                raise _fail(path, f"row {row_numbers[int(np.argmax(nulls))]}", f"{name}: missing value")
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


def _suffix(path: str) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in SUFFIXES:
        raise _fail(path, "file", f"unknown extension {suffix or '(none)'!r}; expected one of {', '.join(SUFFIXES)}")
    return suffix


def read_trace(path: str | os.PathLike, *, speculative_decoding: bool = False) -> StepTrace:
    """Read and validate one trace file; the file type follows from its extension."""
    path = str(path)
    suffix = _suffix(path)
    if not os.path.isfile(path):
        raise _fail(path, "file", "no such file")
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
            raise _fail(path, "file", f"not a readable Parquet file ({error})") from None
        metadata = _trace_metadata(table.schema.metadata)
        columns, rows = trace_columns_from_arrow(path, table)
    return build_trace(columns, path=path, row_numbers=rows, metadata=metadata, speculative_decoding=speculative_decoding)


def read_traces(paths: Sequence[str | os.PathLike], **kwargs) -> StepTrace:
    """Read several files into one trace; runs keep their ids, so they must not collide across files."""
    traces = [read_trace(path, **kwargs) for path in paths]
    return concat_traces(traces)


class RunIds:
    """The run ids of the traces read so far, each owned by the one trace (file) it came from: the check that
    no run is read twice (the same file given twice, or a renamed copy), shared by `concat_traces` and the
    streaming `iter_traces`."""

    def __init__(self) -> None:
        self._owners: dict[str, tuple[int, str]] = {}

    def claim(self, trace: StepTrace, owner: int, source: str) -> None:
        """Record ``trace``'s runs as ``owner``'s (a trace or file index); refuse one another owner holds."""
        for run in trace.run_ids:
            first = self._owners.setdefault(run, (owner, source))
            if first[0] != owner:
                raise TraceError(f"{source}: run {run!r}: run id also used in {first[1]}; run ids must be unique")


def concat_traces(traces: Sequence[StepTrace]) -> StepTrace:
    if len(traces) == 1:
        return traces[0]
    runs = RunIds()
    for k, trace in enumerate(traces):
        runs.claim(trace, k, trace.sources[0] if trace.sources else "<memory>")
    if any(t.has_sharing_columns for t in traces):
        traces = [t if t.has_sharing_columns else _with_sharing_columns(t) for t in traces]
    names = set.intersection(*(set(t.extra) for t in traces)) if traces else set()
    offsets = [np.zeros(1, dtype=np.int64)]
    base = 0
    for trace in traces:
        offsets.append(trace.step_offsets[1:] + base)
        base += trace.n_slices
    metadata: dict = {}
    for trace in traces:
        for key, value in trace.metadata.items():
            metadata.setdefault(key, value)
    return StepTrace(
        run_id=np.concatenate([t.run_id for t in traces]),
        step_id=np.concatenate([t.step_id for t in traces]),
        step_latency_s=np.concatenate([t.step_latency_s for t in traces]),
        request_id=np.concatenate([t.request_id for t in traces]),
        tenant=np.concatenate([t.tenant for t in traces]),
        num_new_tokens=np.concatenate([t.num_new_tokens for t in traces]),
        num_context_tokens=np.concatenate([t.num_context_tokens for t in traces]),
        is_prefill=np.concatenate([t.is_prefill for t in traces]),
        step_offsets=np.concatenate(offsets),
        extra={name: np.concatenate([t.extra[name] for t in traces]) for name in names},
        metadata=metadata,
        sources=tuple(s for t in traces for s in t.sources),
    )


def _with_sharing_columns(trace: StepTrace) -> StepTrace:
    """A v1 trace with the sharing columns filled in as "nothing shared", for joining with v2 traces."""
    extra = dict(trace.extra)
    extra["num_shared_context_tokens"] = trace.num_shared_context_tokens
    extra["effective_context_tokens"] = trace.effective_context_tokens
    return dataclasses.replace(trace, extra=extra)


def iter_trace(path: str | os.PathLike, *, batch_rows: int = 1 << 20) -> Iterator[StepTrace]:
    """Yield a trace file in pieces of whole steps, so memory stays bounded for large Parquet files.

    Parquet is read by record batches; JSONL and CSV files are read whole. Streaming needs the rows of a
    step to be contiguous in the file (as every llmvisor writer leaves them); a step whose rows are split
    by another step's rows is rejected, naming the step, since it cannot be attributed piecewise.
    """
    path = str(path)
    if _suffix(path) != ".parquet":
        yield read_trace(path)
        return
    try:
        parquet = pq.ParquetFile(path)
        names = parquet.schema_arrow.names
    except _PARQUET_ERRORS as error:
        raise _fail(path, "file", f"not a readable Parquet file ({error})") from None
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
            raise _fail(path, f"rows from {first_row}", f"not a readable Parquet file ({error})") from None
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
            raise _fail(path, f"step {step} of run {run!r}", "rows of this step are not contiguous in the file")
        finished.add((run, step))
    return trace


# ---------------------------------------------------------------------------------------------------------
# Writing


def write_trace(trace: StepTrace, path: str | os.PathLike) -> None:
    """Write a whole trace; the file type follows from the extension. Parquet keeps the trace metadata."""
    path = str(path)
    suffix = _suffix(path)
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


def trace_from_rows(rows: Sequence[dict], *, path: str = "<memory>", metadata: dict | None = None) -> StepTrace:
    """Validate in-memory rows (dicts with the contract's columns), as the JSONL reader would."""
    row_numbers = list(range(1, len(rows) + 1))
    columns = _columns_from_records(path, list(rows), row_numbers)
    return build_trace(columns, path=path, row_numbers=np.array(row_numbers), metadata=metadata)


class TraceWriter:
    """Append steps to a trace file as they happen.

    JSONL and CSV files grow by whole steps, each flushed with one write, so a crash loses at most the
    steps not yet flushed and never leaves a half row. Parquet has its footer written only on ``close``, so
    it is written to a temporary file renamed into place then; use JSONL for recording live engines.
    """

    def __init__(self, path: str | os.PathLike, *, flush_every_steps: int = 1, metadata: dict | None = None):
        self.path = str(path)
        self.suffix = _suffix(self.path)
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
