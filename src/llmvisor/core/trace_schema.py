"""The columns of the step-trace format (versions 1 to 4, `docs/trace-format.md`): their names, types and Arrow
schema, the reading of ``is_warmup``, the version-2 sharing columns, the version-3 KV memory columns, the version-4
LoRA adapter columns, and how a rejection is worded.

Shared by the in-memory `StepTrace` (`llmvisor.core.step_trace`), the readers (`llmvisor.core.trace`) and the
writers (`llmvisor.core.trace_writer`); `llmvisor.core.trace` re-exports every name here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from llmvisor.core.fingerprint import FINGERPRINT_COLUMN
from llmvisor.core.tokens import CACHED_PROMPT_COLUMN
from llmvisor.errors import TraceError, plain

FORMAT_VERSION = 4
"""The newest format version: 4 with the LoRA adapter columns, else 3 with the KV memory columns, else 2 with the
sharing columns, else 1."""
METADATA_KEY = b"llmvisor.trace"

SHARING_COLUMNS = ("num_shared_context_tokens", "effective_context_tokens")
"""The format-2 columns: per slice, context tokens in KV blocks other slices of the step also read, and the
context with each block divided among its readers. Both or neither."""
SHARING_TOLERANCE = 1e-9
"""Relative slack (of num_context_tokens, at least one token's worth) allowed in the bounds on
``effective_context_tokens``, a sum of fractions that floating point cannot always hit exactly."""
KV_SLICE_COLUMN = "kv_block_ns"
"""Format 3, per slice: the KV block-nanoseconds the request held since its previous slice (`llmvisor.core.kv_memory`)."""
KV_STEP_COLUMNS = ("kv_interval_ns", "kv_idle_block_ns", "kv_free_block_ns", "kv_carried_in_block_ns", "kv_carried_out_block_ns")
"""Format 3, per step (the same on every row of a step): the wall time the step's KV figures cover, the pool's idle
cache and free blocks over it, and the block-ns that cross steps (`llmvisor.core.kv_memory.StepKv`)."""
KV_RUN_COLUMNS = ("kv_pool_blocks", "kv_block_bytes")
"""Format 3, per run (the same on every row of a run): the blocks requests can be given, and bytes per block."""
KV_COLUMNS = (KV_SLICE_COLUMN, *KV_STEP_COLUMNS, *KV_RUN_COLUMNS)
"""The format-3 columns: all or none."""
LORA_SLICE_COLUMNS = ("lora_name", "lora_rank")
"""Format 4, per slice: the LoRA adapter the request runs with (empty for the base model) and its rank (0 for the
base model)."""
LORA_STEP_COLUMNS = ("step_loras", "step_lora_loads", "step_lora_disk_loads")
"""Format 4, per step (the same on every row of a step), each a set of adapter names written as a JSON array, sorted:
the distinct adapters the step ran, those loaded into a LoRA slot for it, and those of them read from their files
(`llmvisor.core.lora_trace`)."""
LORA_COLUMNS = (*LORA_SLICE_COLUMNS, *LORA_STEP_COLUMNS)
"""The format-4 columns: all or none."""
STRING_COLUMNS = ("run_id", "request_id", "tenant", "phase", "lora_name", *LORA_STEP_COLUMNS)
INTEGER_COLUMNS = ("step_id", "num_new_tokens", "num_context_tokens", "num_shared_context_tokens", *KV_COLUMNS, "lora_rank")
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
    FINGERPRINT_COLUMN, "is_drifted", CACHED_PROMPT_COLUMN, "model_version", "episode", *SHARING_COLUMNS, *KV_COLUMNS,
    *LORA_COLUMNS,
)
"""Every optional column of the format (v1's, and v2's sharing columns): what any llmvisor writer emits or reader
uses (``episode``: the fit's folds, `llmvisor.core.model.EPISODE_COLUMN`; ``model_version``: the raw-step archive)."""
KNOWN_COLUMNS = (*REQUIRED_COLUMNS, *OPTIONAL_COLUMNS)
"""The columns a trace may have. Any other is refused, naming the closest known one: a misspelled optional
column dropped in silence would bill wrongly (``engine_fingerprint_id``: billed as class ""), so a future
optional column comes with a new format version rather than by tolerance."""
KNOWN_SET = frozenset(KNOWN_COLUMNS)
CHECKED_COLUMNS = (*REQUIRED_COLUMNS, *SHARING_COLUMNS, *KV_COLUMNS, *LORA_COLUMNS)
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
    """4 with the LoRA adapter columns, 3 with the KV memory columns, 2 with the sharing columns, else 1: the version a
    file with these columns is."""
    if all(name in column_names for name in LORA_COLUMNS):
        return 4
    if all(name in column_names for name in KV_COLUMNS):
        return 3
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


def columns_together(path: str, names, group: tuple[str, ...], what: str, version: int) -> bool:
    """Whether the columns of an optional ``group`` (a format version's addition) are there; some of them without the
    others is refused, naming the first present and the missing ones."""
    present = [name for name in group if name in names]
    if present and len(present) != len(group):
        missing = [name for name in group if name not in names]
        raise rejection(path, "header", f"column {present[0]} without {', '.join(missing)}: the {what} columns come "
                                        f"together (format version {version})")
    return bool(present)


def shown_rows(rows) -> str:
    """File row numbers for a message: the first five, in order, then ``...``."""
    rows = sorted(int(r) for r in rows)
    return ", ".join(map(str, rows[:5])) + (", ..." if len(rows) > 5 else "")


def step_place(step_id, run_id, rows) -> str:
    """Where a step-level rejection points: ``step S of run 'R' (rows ...)``."""
    return f"step {plain(step_id)} of run {plain(run_id)!r} (rows {shown_rows(rows)})"


def first_disagreement(sorted_values: np.ndarray, starts: np.ndarray) -> tuple[int, object, object] | None:
    """The first group (rows from each of ``starts`` to the next) whose values differ, with its lowest and highest
    value; None when every group agrees. The values are sorted by group."""
    low, high = np.minimum.reduceat(sorted_values, starts), np.maximum.reduceat(sorted_values, starts)
    disagree = np.flatnonzero(low != high)
    if not disagree.size:
        return None
    k = int(disagree[0])
    return k, low[k], high[k]


def rejection(path: str, where: str, reason: str) -> TraceError:
    """The error for a trace the contract refuses: ``path: where: reason``."""
    return TraceError(f"{path}: {where}: {reason}")


def trace_suffix(path: str) -> str:
    """The file type of a trace path (one of `SUFFIXES`), from its extension; any other is refused."""
    suffix = Path(path).suffix.lower()
    if suffix not in SUFFIXES:
        raise rejection(path, "file", f"unknown extension {suffix or '(none)'!r}; expected one of {', '.join(SUFFIXES)}")
    return suffix
