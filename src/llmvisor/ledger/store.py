"""The ledger store: attributed steps in, usage out, over SQLite (WAL) or PostgreSQL.

Each ingest is one transaction. Steps are keyed by (run_id, step_id): a step already stored with the same
content hash is acknowledged and skipped, one stored with a different hash is a conflict and the whole
batch is rejected, so a batch is either stored whole or not at all and no second is ever counted twice.
What a transaction writes (`schema`): a row per new step, the new steps' slices as one Parquet blob, and the
per-request, per-second usage they add to, summed into existing rows. The blob and the sums are built
before the write lock is taken, and again inside it only if some steps turn out to be stored already.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from sqlalchemy import (
    Connection,
    Engine,
    and_,
    bindparam,
    case,
    create_engine,
    delete,
    event,
    func,
    insert,
    inspect,
    or_,
    select,
    update,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DatabaseError, DBAPIError, IntegrityError, OperationalError
from sqlalchemy.pool import StaticPool

from llmvisor import extras
from llmvisor.core.tokens import CACHED_PROMPT_COLUMN, add_counts, token_split
from llmvisor.errors import LlmvisorError
from llmvisor.ledger import keys as keys_module
from llmvisor.ledger.keys import Principal
from llmvisor.ledger.schema import (
    IN_PLACE_UPGRADES,
    SCHEMA_8_TABLES,
    SCHEMA_VERSION,
    TOKEN_SPLIT_COLUMNS,
    USAGE_RESOLUTION_US,
    active_models,
    adjustments,
    api_keys,
    duplicate_runs,
    engine_models,
    ledger_info,
    metadata,
    request_totals,
    run_digests,
    run_ends,
    slice_batches,
    step_ranges,
    steps,
    tenant_seconds,
    usage_per_second,
    windows,
)

BUCKET_US = {"minute": 60_000_000, "hour": 3_600_000_000, "day": 86_400_000_000}
SQLITE_BUSY_TIMEOUT_S = 30.0
SQLITE_CACHE_KIB = 65536
_LOOKUP_CHUNK = 500
_WRITE_ATTEMPTS = 5
_PARQUET_COMPRESSION = "zstd"
_USAGE_KEY = ("run_id", "request_id", "tenant", "second_us")
_USAGE_SUMS = ("attributed_ns", "num_slices", "num_new_tokens")
# `_StoredBatch` builds rows as tuples in these column orders.
assert [c.name for c in steps.columns] == [
    "run_id", "step_id", "measured_ns", "predicted_s", "batch_size", "timestamp_us", "ingested_at_us", "content_sha256",
    "slice_batch_id", "engine_class", "model_version", "pending",
]
assert [c.name for c in usage_per_second.columns] == [*_USAGE_KEY, *_USAGE_SUMS, "first_timestamp_us", "last_timestamp_us",
                                                     *TOKEN_SPLIT_COLUMNS]

class LedgerError(LlmvisorError):
    """The ledger cannot be opened or used as asked (bad URL, unreachable database, other schema)."""


HELD_ELSEWHERE = "covers steps the ledger already holds under another key (another window, or stored one by one)"


class StepConflictError(LlmvisorError):
    """Steps re-sent with a (run_id, step_id) already stored under different content, or steps a stored window
    already covers (``reason`` says which)."""

    def __init__(self, conflicts: Sequence[tuple[str, int]], reason: str = "is already stored with different content"):
        self.conflicts = list(conflicts)
        run_id, step_id = self.conflicts[0]
        more = f" (and {len(self.conflicts) - 1} more)" if len(self.conflicts) > 1 else ""
        super().__init__(
            f"step {step_id} of run {run_id!r}{more} {reason}; "
            "a (run_id, step_id) can be ingested once, re-sends must be identical"
        )


class WindowConflictError(LlmvisorError):
    """Window aggregates re-sent with a (run_id, window_start_us) already stored under different content, or
    windows covering steps the ledger already holds in another window or one by one (``reason`` says which)."""

    def __init__(self, conflicts: Sequence[tuple[str, int]], reason: str = "is already stored with different content"):
        self.conflicts = list(conflicts)
        run_id, start_us = self.conflicts[0]
        more = f" (and {len(self.conflicts) - 1} more)" if len(self.conflicts) > 1 else ""
        super().__init__(
            f"window {start_us} of run {run_id!r}{more} {reason}; "
            "a (run_id, window_start_us) can be ingested once, re-sends must be identical, and a step is billed once"
        )


class DuplicateRunError(LlmvisorError):
    """A new run whose first step (step 0, or the window covering it) has the content of a stored run's, its run
    id aside: the same run re-sent under a new run id, which would be billed twice. Raised inside the write
    transaction, so nothing of the batch is stored."""

    def __init__(self, run_id: str, other_run_id: str, form: str, *, earlier: bool = False):
        self.run_id = run_id
        self.other_run_id = other_run_id
        self.form = form
        self.earlier = earlier
        what = "step 0" if form == "step" else "first window (the one covering step 0)"
        super().__init__(
            f"run {run_id!r} repeats run {other_run_id!r}: its {what} has the same content, run id aside, so it is "
            f"run {other_run_id!r} re-sent under a new run id{' (refused when that step arrived)' if earlier else ''}; "
            "refused, nothing of the batch is stored"
        )


class RunEndConflictError(LlmvisorError):
    """An end-of-run record for a run that has one with other values: a run instance ends once."""

    def __init__(self, stored: RunEnd, last_step_id: int, num_steps: int):
        self.stored = stored
        super().__init__(
            f"run {stored.run_id!r} has an end-of-run record already (last step {stored.last_step_id}, "
            f"{stored.num_steps} steps); this one says last step {last_step_id}, {num_steps} steps: a run ends once, "
            "re-sends must be identical"
        )


class HeldStepsError(LlmvisorError):
    """New step ids of ``run_id`` that the ledger already holds (or that one batch holds twice): ``overlaps`` as
    ``(first, last)`` ranges. Raised inside the write transaction, so nothing of the batch is stored; the ingest
    methods answer it as a conflict of the steps or windows concerned."""

    def __init__(self, run_id: str, overlaps: Sequence[tuple[int, int]]):
        self.run_id = run_id
        self.overlaps = list(overlaps)
        first, last = self.overlaps[0]
        super().__init__(f"steps {first}-{last} of run {run_id!r} are already held")

    def covers(self, run_id: str, step_ids: np.ndarray) -> bool:
        """Whether any of ``step_ids`` of ``run_id`` lies in an overlap."""
        if run_id != self.run_id:
            return False
        ids = np.asarray(step_ids, dtype=np.int64)
        return any(bool(np.any((ids >= first) & (ids <= last))) for first, last in self.overlaps)


@dataclass(frozen=True)
class WindowOutcome:
    """Windows of a batch stored now and those already there, identical (duplicates)."""

    inserted: int
    duplicate: int
    stored: tuple = ()
    """The aggregates stored now (the service counts them on its metrics)."""
    reshaped_runs: tuple = ()
    """Runs whose held ranges changed other than by one range growing: only their gaps can have changed."""


@dataclass
class StepRecords:
    """Attributed steps ready to store.

    Per step (length ``n_steps``): ``run_id`` … ``content_sha256``; per slice: ``request_id`` …
    ``attributed_ns``, the slices of step k being ``step_offsets[k]:step_offsets[k + 1]``. Strings are object
    arrays. ``attributed_ns`` of a step sum to its ``measured_ns``.
    """

    run_id: np.ndarray
    step_id: np.ndarray
    step_latency_s: np.ndarray
    measured_ns: np.ndarray
    predicted_s: np.ndarray
    timestamp_us: np.ndarray
    content_sha256: list[bytes]
    step_offsets: np.ndarray
    request_id: np.ndarray
    tenant: np.ndarray
    num_new_tokens: np.ndarray
    num_context_tokens: np.ndarray
    is_prefill: np.ndarray
    attributed_ns: np.ndarray
    ingested_at_us: np.ndarray | None = None
    """Per step; None stamps them with the time they are stored (a migration keeps the original times)."""
    engine_class: np.ndarray | None = None
    """Per step, the engine fingerprint id ('' where none); None: '' for every step."""
    model_version: np.ndarray | None = None
    """Per step, the registry version of the model that attributed it, -1 for none (the default model)."""
    pending: np.ndarray | None = None
    """Per step, stored unattributed (``attributed_ns`` 0, ``predicted_s`` NaN) until its class has a model."""
    num_shared_context_tokens: np.ndarray | None = None
    effective_context_tokens: np.ndarray | None = None
    """Per slice, the sharing columns (trace format v2), kept in the blob: pending steps are priced from them
    later, and a refit from the ledger (`llmvisor refit`) fits the shared-KV term on them."""
    num_cached_prompt_tokens: np.ndarray | None = None
    """Per slice, the prompt tokens its request found in the prefix cache, counted on the request's first slice
    only (`llmvisor.core.tokens`); None: 0 for every slice (the step did not say). Kept in the blob."""
    run_sha256: list[bytes | None] | None = None
    """Per step, for a run's step 0, its content digest without the run id (`run_digests`: a new run repeating a
    stored run's is refused, `DuplicateRunError`); None elsewhere, and None for a batch without one."""

    def per_step(self, name: str, default) -> np.ndarray:
        """A per-step column, or ``default`` for every step where it is None."""
        value = getattr(self, name)
        return np.full(self.n_steps, default, dtype=object if isinstance(default, str) else type(default)) if value is None else value

    @property
    def n_steps(self) -> int:
        return int(self.step_offsets.shape[0] - 1)

    @property
    def n_slices(self) -> int:
        return int(self.step_offsets[-1])

    def select_steps(self, step_mask: np.ndarray) -> StepRecords:
        """The records of the steps where ``step_mask`` is true."""
        step_mask = np.asarray(step_mask, dtype=bool)
        sizes = np.diff(self.step_offsets)
        slice_mask = np.repeat(step_mask, sizes)
        values = {}
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name == "step_offsets":
                value = np.concatenate(([0], np.cumsum(sizes[step_mask]))).astype(np.int64)
            elif value is None:
                pass
            elif item.name in ("content_sha256", "run_sha256"):
                value = [digest for digest, keep in zip(value, step_mask.tolist()) if keep]
            else:
                value = value[step_mask if item.name in _PER_STEP else slice_mask]
            values[item.name] = value
        return StepRecords(**values)


_PER_STEP = frozenset((
    "run_id", "step_id", "step_latency_s", "measured_ns", "predicted_s", "timestamp_us", "ingested_at_us", "engine_class",
    "model_version", "pending",
))
SHARING_BLOB_COLUMNS = ("num_shared_context_tokens", "effective_context_tokens")


class _StoredBatch:
    """What one ingest writes, built from the records of its new steps: step rows, the slices' Parquet
    blob and usage rows (one per request per second, sorted by key so concurrent upserts lock in one order)."""

    def __init__(self, records: StepRecords):
        self.n_steps = records.n_steps
        self.n_slices = records.n_slices
        sizes = np.diff(records.step_offsets)
        step_of_slice = np.repeat(np.arange(self.n_steps), sizes)
        run_names, run_codes = np.unique(records.run_id.astype(str), return_inverse=True)
        run_id = pa.DictionaryArray.from_arrays(pa.array(run_codes[step_of_slice], pa.int32()), pa.array(run_names))
        timestamp_us = records.timestamp_us[step_of_slice]
        table = pa.table(
            {
                "run_id": run_id,
                "step_id": records.step_id[step_of_slice],
                "step_latency_s": records.step_latency_s[step_of_slice],
                "request_id": pa.array(records.request_id, pa.string()),
                "tenant": pa.array(records.tenant, pa.string()),
                "num_new_tokens": records.num_new_tokens,
                "num_context_tokens": records.num_context_tokens,
                "phase": pa.DictionaryArray.from_arrays(
                    pa.array(records.is_prefill.astype(np.int8)), pa.array(["decode", "prefill"])
                ),
                "timestamp_s": timestamp_us / 1e6,
                "attributed_ns": records.attributed_ns,
            }
        )
        pending = records.per_step("pending", False).astype(bool)
        if records.effective_context_tokens is not None:
            for name in SHARING_BLOB_COLUMNS:
                table = table.append_column(name, pa.array(getattr(records, name)))
        if records.num_cached_prompt_tokens is not None:
            table = table.append_column(CACHED_PROMPT_COLUMN, pa.array(records.num_cached_prompt_tokens, pa.int64()))
        uncached, cached, output = token_split(records.num_new_tokens, records.is_prefill, records.num_cached_prompt_tokens)
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, compression=_PARQUET_COMPRESSION)
        self.slices_parquet = sink.getvalue().to_pybytes()

        second_us = (timestamp_us // USAGE_RESOLUTION_US) * USAGE_RESOLUTION_US
        billed = pa.table(
            {
                "run_id": run_id,
                "request_id": table["request_id"],
                "tenant": table["tenant"],
                "second_us": second_us,
                "attributed_ns": records.attributed_ns,
                "num_new_tokens": records.num_new_tokens,
                "timestamp_us": timestamp_us,
                **dict(zip(TOKEN_SPLIT_COLUMNS, (uncached, cached, output))),
            }
        )
        if pending.any():  # pending slices add to usage only once attributed
            billed = billed.filter(pa.array(~pending[step_of_slice]))
        usage = (
            billed
            .group_by(list(_USAGE_KEY), use_threads=False)
            .aggregate(
                [
                    ("attributed_ns", "sum"),
                    ("attributed_ns", "count"),
                    ("num_new_tokens", "sum"),
                    ("timestamp_us", "min"),
                    ("timestamp_us", "max"),
                    *((name, "sum") for name in TOKEN_SPLIT_COLUMNS),
                ]
            )
        )
        usage = usage.set_column(usage.schema.get_field_index("run_id"), "run_id", pc.cast(usage["run_id"], pa.string()))
        usage = usage.sort_by([(name, "ascending") for name in _USAGE_KEY])
        names = [*_USAGE_KEY, "attributed_ns_sum", "attributed_ns_count", "num_new_tokens_sum", "timestamp_us_min", "timestamp_us_max",
                 *(f"{name}_sum" for name in TOKEN_SPLIT_COLUMNS)]
        self.usage_columns = [usage[name].to_pylist() for name in names]
        self.records = records

    def step_rows(self, slice_batch_id: int, ingested_at_us: int) -> list[tuple]:
        records = self.records
        pending_list = records.per_step("pending", False).astype(bool).tolist()
        return list(
            zip(
                records.run_id.tolist(),
                records.step_id.tolist(),
                records.measured_ns.tolist(),
                [None if p else x for x, p in zip(records.predicted_s.tolist(), pending_list)],
                np.diff(records.step_offsets).tolist(),
                records.timestamp_us.tolist(),
                [ingested_at_us] * self.n_steps if records.ingested_at_us is None else records.ingested_at_us.tolist(),
                records.content_sha256,
                [slice_batch_id] * self.n_steps,
                records.per_step("engine_class", "").tolist(),
                [None if p or v < 0 else v for v, p in zip(records.per_step("model_version", -1).tolist(), pending_list)],
                pending_list,
            )
        )


@dataclass(frozen=True)
class IngestOutcome:
    """Which steps of a batch were stored now (``inserted[k]``) and which were already there, identical."""

    inserted: list[bool]

    @property
    def n_inserted(self) -> int:
        return sum(self.inserted)

    @property
    def n_duplicate(self) -> int:
        return len(self.inserted) - self.n_inserted


@dataclass(frozen=True)
class UsageRow:
    tenant: str
    bucket_start_us: int | None
    attributed_ns: int
    num_slices: int
    num_new_tokens: int
    num_uncached_prompt_tokens: int | None = None
    """The token split (`llmvisor.core.tokens`); None where some of the rows summed were stored before schema 6."""
    num_cached_prompt_tokens: int | None = None
    num_output_tokens: int | None = None


@dataclass(frozen=True)
class RequestUsageRow:
    run_id: str
    request_id: str
    tenant: str
    attributed_ns: int
    num_steps: int
    num_new_tokens: int
    first_timestamp_us: int
    last_timestamp_us: int
    num_uncached_prompt_tokens: int | None = None
    num_cached_prompt_tokens: int | None = None
    num_output_tokens: int | None = None


@dataclass(frozen=True)
class Totals:
    """What reconciles: Σ attributed_ns over slices equals Σ measured_ns over steps, exactly."""

    num_steps: int
    measured_ns: int
    num_slices: int
    attributed_ns: int
    pending_steps: int = 0
    """Steps stored unattributed (their class had no active model), not counted in ``num_steps``."""
    pending_measured_ns: int = 0


@dataclass(frozen=True)
class SliceShare:
    request_id: str
    tenant: str
    num_new_tokens: int
    num_context_tokens: int
    phase: str
    attributed_ns: int


@dataclass(frozen=True)
class StepDetail:
    """A stored step as an audit sees it: what was measured and predicted, and each slice's share."""

    run_id: str
    step_id: int
    measured_ns: int
    predicted_s: float | None
    timestamp_us: int
    ingested_at_us: int
    content_sha256: bytes
    slices: list[SliceShare]
    engine_class: str = ""
    model_version: int | None = None
    pending: bool = False


@dataclass(frozen=True)
class ModelVersion:
    """A fitted model of an engine class, as the registry keeps it."""

    engine_class: str
    version: int
    source: str
    created_at_us: int
    active: bool


@dataclass(frozen=True)
class StoredWindow:
    """A stored window aggregate's facts: where it is and the model version that attributed it."""

    run_id: str
    window_start_us: int
    window_end_us: int
    engine_class: str
    model_version: int | None
    pending: bool
    num_steps: int = 0
    measured_ns: int = 0


@dataclass(frozen=True)
class StoredSteps:
    """Steps read back from the ledger with their slices (``slices``: a trace-format table sorted by
    ``(run_id, step_id)``, with ``timestamp_s`` and, where stored, the sharing columns)."""

    keys: list[tuple[str, int]]
    timestamp_us: np.ndarray
    slices: pa.Table
    model_version: np.ndarray | None = None
    """Per key, the registry version that billed the step (-1: the service's default model); read by
    ``billed_steps`` only."""


@dataclass(frozen=True)
class AdjustmentRow:
    """One tenant's correction of one period's bill (``schema.adjustments``)."""

    engine_class: str
    period_start_us: int
    period_end_us: int
    to_version: int
    tenant: str
    from_versions: str
    billed_ns: int
    reattributed_ns: int
    delta_ns: int
    num_steps: int
    created_at_us: int


@dataclass(frozen=True)
class StepGap:
    """Step ids ``first_step_id..last_step_id`` (inclusive) of a run that never arrived, though a later one did
    at ``since_us`` (the gap is that old)."""

    first_step_id: int
    last_step_id: int
    since_us: int

    @property
    def num_steps(self) -> int:
        return self.last_step_id - self.first_step_id + 1


@dataclass(frozen=True)
class RunEnd:
    """A run's end-of-run record (`run_ends`): sent by the recorder at a clean engine shutdown."""

    run_id: str
    last_step_id: int
    num_steps: int
    received_at_us: int


@dataclass(frozen=True)
class RunGaps:
    """What the ledger holds of a run's step ids (numbered from 0 by the recorder) and what it misses: below the
    highest id received and, once the run's end-of-run record is stored (``end``), up to the last step it names. A
    run without one is open: steps after its highest id received cannot be known missing until a later one arrives."""

    run_id: str
    engine_class: str
    num_received: int
    last_step_id: int
    gaps: list[StepGap]
    end: RunEnd | None = None

    @property
    def ended(self) -> bool:
        return self.end is not None

    @property
    def num_missing(self) -> int:
        return sum(gap.num_steps for gap in self.gaps)


def gaps_of_ranges(run_id: str, ranges: Sequence[tuple[int, int, str, int]], end: RunEnd | None = None) -> RunGaps:
    """A run's gaps from its stored ranges ``(first_step_id, last_step_id, engine_class, first_received_us)``:
    the ids below each range not covered by an earlier one, from 0. A gap is as old as the earliest range after it.
    With an end-of-run record, the ids after the last range up to ``end.last_step_id`` are a gap too (a lost tail),
    as old as the record."""
    ranges = sorted(ranges)
    gaps: list[StepGap] = []
    earliest_after = [0] * len(ranges)
    running = None
    for k in range(len(ranges) - 1, -1, -1):
        received = ranges[k][3]
        running = received if running is None else min(running, received)
        earliest_after[k] = running
    expected = min(0, ranges[0][0]) if ranges else 0
    for k, (first, last, _class, _received) in enumerate(ranges):
        if first > expected:
            gaps.append(StepGap(expected, first - 1, earliest_after[k]))
        expected = max(expected, last + 1)
    if end is not None and end.last_step_id >= expected:
        gaps.append(StepGap(expected, end.last_step_id, end.received_at_us))
    return RunGaps(
        run_id=run_id,
        engine_class=ranges[0][2] if ranges else "",
        num_received=sum(last - first + 1 for first, last, _c, _r in ranges),
        last_step_id=max((last for _f, last, _c, _r in ranges), default=-1),
        gaps=gaps,
        end=end,
    )


@dataclass(frozen=True)
class RunHoldings:
    """What the ledger holds of one run instance, for a delivery process that replaces one that died
    (``GET /v1/windows/held``): the step ids received at or after ``from_step_id`` (stored one by one and in
    window aggregates alike), as sorted, disjoint ranges ``(first, last)``, and the run's windows: how many and
    where the last one ends (a window the run starts later must start at or after it, so its key is new)."""

    run_id: str
    from_step_id: int
    step_ranges: list[tuple[int, int]]
    num_windows: int
    last_window_end_us: int | None


def merge_ranges(ranges: Sequence[tuple[int, int, str, int]]) -> list[tuple[int, int, str, int]]:
    """Overlapping or adjacent ranges joined; a joined range keeps the earliest receipt and that range's class."""
    merged: list[list] = []
    for first, last, engine_class, received in sorted(ranges):
        if merged and first <= merged[-1][1] + 1:
            top = merged[-1]
            top[1] = max(top[1], last)
            if received < top[3]:
                top[2], top[3] = engine_class, received
        else:
            merged.append([first, last, engine_class, received])
    return [tuple(item) for item in merged]


def range_overlaps(ours: Sequence[tuple[int, int]], theirs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ids two lists of sorted, disjoint ``(first, last)`` ranges share, as ranges (one sweep)."""
    out, i, j = [], 0, 0
    while i < len(ours) and j < len(theirs):
        first, last = max(ours[i][0], theirs[j][0]), min(ours[i][1], theirs[j][1])
        if first <= last:
            out.append((first, last))
        if ours[i][1] < theirs[j][1]:
            i += 1
        else:
            j += 1
    return out


def step_id_ranges(step_ids: np.ndarray) -> list[tuple[int, int]]:
    """Sorted, distinct step ids as runs of consecutive ids ``(first, last)``."""
    ids = np.unique(np.asarray(step_ids, dtype=np.int64))
    if not ids.size:
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1)
    firsts = np.concatenate(([ids[0]], ids[breaks + 1]))
    lasts = np.concatenate((ids[breaks], [ids[-1]]))
    return list(zip(firsts.tolist(), lasts.tolist()))


@dataclass(frozen=True)
class KeyInfo:
    key_id: str
    tenant: str | None
    is_admin: bool
    created_at_us: int
    revoked_at_us: int | None


def _tenant_usage_rows(*, with_class: bool = False):
    """Per-second usage of stored steps and the per-second tenant rows of window aggregates as one relation
    ([engine_class,] tenant, second_us, attributed_ns, num_slices, num_new_tokens and the token split), so a tenant's
    total is the same whichever way it was metered. A stored step's class is its run's (a run is one engine
    instance: its first class seen in `step_ranges`); a window's is its own."""
    w = tenant_seconds
    u = usage_per_second

    def sums(table):
        return [table.c.tenant, table.c.second_us, table.c.attributed_ns, table.c.num_slices, table.c.num_new_tokens,
                *(table.c[name] for name in TOKEN_SPLIT_COLUMNS)]

    if not with_class:
        return select(*sums(u)).union_all(select(*sums(w))).subquery("usage")
    run_class = select(step_ranges.c.run_id, func.min(step_ranges.c.engine_class).label("engine_class")).group_by(step_ranges.c.run_id).subquery()
    per_step = select(func.coalesce(run_class.c.engine_class, "").label("engine_class"), *sums(u)).select_from(
        u.outerjoin(run_class, run_class.c.run_id == u.c.run_id))
    return per_step.union_all(select(w.c.engine_class, *sums(w))).subquery("usage")


def _request_usage_rows():
    """Per-second request usage of stored steps and request totals of aggregates as one relation."""
    u = usage_per_second
    r = request_totals
    return select(u.c.run_id, u.c.request_id, u.c.tenant, u.c.second_us, u.c.attributed_ns, u.c.num_slices, u.c.num_new_tokens,
                  u.c.first_timestamp_us, u.c.last_timestamp_us, *(u.c[name] for name in TOKEN_SPLIT_COLUMNS)).union_all(
        select(r.c.run_id, r.c.request_id, r.c.tenant, r.c.first_second_us, r.c.attributed_ns, r.c.num_slices, r.c.num_new_tokens,
               r.c.first_timestamp_us, r.c.last_timestamp_us, *(r.c[name] for name in TOKEN_SPLIT_COLUMNS))
    ).subquery("usage")


def split_sums(table) -> list:
    """SQL sums of the token split over a group: NULL where any row of the group has its split NULL (stored before
    schema 6), so an unknown part is never read as 0."""
    return [case((func.count(table.c[name]) == func.count(), func.coalesce(func.sum(table.c[name]), 0)), else_=None)
            for name in TOKEN_SPLIT_COLUMNS]


def _counts(values) -> dict:
    return {name: None if value is None else int(value) for name, value in zip(TOKEN_SPLIT_COLUMNS, values)}


def now_us() -> int:
    return time.time_ns() // 1000


def normalize_url(url: str) -> str:
    """Accept plain ``postgresql://`` URLs by choosing the psycopg 3 driver the project installs."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise LedgerError(f"not a database URL: {url!r} (expected sqlite:///PATH or postgresql+psycopg://...)") from None
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() == "postgresql":
        extras.require("a PostgreSQL ledger", "postgres")
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise LedgerError(f"unsupported database {parsed.get_backend_name()!r}; use SQLite or PostgreSQL")
    return parsed.render_as_string(hide_password=False)


def _sqlite_engine(url: str, *, immediate: bool) -> Engine:
    """A SQLite engine in WAL mode; ``immediate`` takes the write lock at BEGIN, so a read-then-insert
    transaction cannot be overtaken by another writer between its read and its insert."""
    parsed = make_url(url)
    in_memory = parsed.database in (None, "", ":memory:")
    kwargs = {"poolclass": StaticPool} if in_memory else {}
    engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S, "check_same_thread": False}, **kwargs)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        if not in_memory:
            cursor.execute("PRAGMA journal_mode=WAL")
        # FULL: a commit is on disk before it is acknowledged, so an acknowledged step survives power loss too.
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        cursor.execute("PRAGMA foreign_keys=ON")
        # 64 MiB of page cache instead of 2: usage rows land all over their indexes (measured: 2.1k -> 3.7k steps/s
        # with a row per slice, the worst case; 25k -> 28k at 20 ms a step).
        cursor.execute(f"PRAGMA cache_size=-{SQLITE_CACHE_KIB}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection):
        connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


def _add_usage(row: dict, more: dict) -> None:
    """Add a usage row's sums (``more``) onto ``row``; an unknown token-split part keeps the sum unknown, as NULL + x
    in SQL."""
    for name in ("attributed_ns", "measured_ns", "num_slices", "num_new_tokens"):
        row[name] += more[name]
    for name in TOKEN_SPLIT_COLUMNS:
        row[name] = add_counts(row[name], more[name])


@dataclass(eq=False)
class _WindowBatch:
    """One caller's windows waiting for a group commit, and what came of them."""

    unique: list
    digests: dict
    received: int
    new: list = field(default_factory=list)
    outcome: WindowOutcome | None = None
    error: BaseException | None = None


class _GroupCommit:
    """Leader/follower group commit: a caller whose batch is queued while another caller's commit runs waits;
    when that commit ends, one waiting caller commits every queued batch in one go. Under load the transactions
    grow and their number stays about one at a time; alone, a caller commits at once."""

    MAX_BATCHES = 512

    def __init__(self):
        self._lock = threading.Condition()
        self._queue: list[_WindowBatch] = []
        self._busy = False

    def submit(self, batch: _WindowBatch, commit) -> WindowOutcome:
        """Commit ``batch`` (with ``commit(batches)``, which sets each one's outcome or error), alone or with others."""
        with self._lock:
            self._queue.append(batch)
            while batch.outcome is None and batch.error is None and self._busy:
                self._lock.wait()
            if batch.outcome is None and batch.error is None:  # no commit runs, and none took this batch: lead one
                self._busy = True
                rest = [other for other in self._queue if other is not batch]
                taken, self._queue = [batch, *rest[: self.MAX_BATCHES - 1]], rest[self.MAX_BATCHES - 1 :]
            else:
                taken = []
        if taken:
            try:
                commit(taken)
            except BaseException as error:  # noqa: BLE001 - handed to every caller of the commit
                for other in taken:
                    if other.outcome is None and other.error is None:
                        other.error = error
            finally:
                with self._lock:
                    self._busy = False
                    self._lock.notify_all()
        if batch.error is not None:
            raise batch.error
        return batch.outcome


class Ledger:
    """Durable record of attributed time (per step, per slice, per request per second), with usage queries
    and API keys.

    Parameters
    ----------
    url : SQLAlchemy database URL: ``sqlite:///PATH`` (WAL mode) or ``postgresql+psycopg://USER@HOST/DB``.
    """

    def __init__(self, url: str, *, request_totals: bool = True):
        self.url = normalize_url(url)
        self.request_totals = request_totals
        """Keep a row per request of window aggregates (``request_totals``); off at fleet scale, where a request's
        usage is read from the raw-step archive (schema 7 note in `llmvisor.ledger.schema`)."""
        self.backend = make_url(self.url).get_backend_name()
        try:
            if self.backend == "sqlite":
                self._write_engine = _sqlite_engine(self.url, immediate=True)
                self._read_engine = self._write_engine if make_url(self.url).database in (None, "", ":memory:") else _sqlite_engine(self.url, immediate=False)
            else:
                self._write_engine = create_engine(self.url, pool_pre_ping=True, pool_size=8, max_overflow=8)
                self._read_engine = self._write_engine
        except Exception as error:  # a missing driver or a malformed option: report, do not trace back
            raise LedgerError(f"cannot use database {self.safe_url}: {error}") from None
        # SQLite allows one writer; waiting here is cheaper than SQLite's sleep-and-retry busy handler.
        self._write_lock = threading.Lock() if self.backend == "sqlite" else None
        self._known_versions: set[tuple[str, int]] = set()  # stored model versions are never changed nor removed
        self._commit = _GroupCommit()
        self._create_schema()

    @property
    def safe_url(self) -> str:
        return make_url(self.url).render_as_string(hide_password=True)

    def _create_schema(self) -> None:
        """Create the tables of an empty database, add schema 8's to a schema-7 one (`IN_PLACE_UPGRADES`); refuse,
        before writing anything, one of another schema."""
        try:
            with self._write_engine.begin() as conn:
                if inspect(conn).has_table(ledger_info.name):
                    version = conn.execute(select(ledger_info.c.value).where(ledger_info.c.name == "schema_version")).scalar()
                    if version in IN_PLACE_UPGRADES:  # later schemas only added tables: create them, record the version
                        metadata.create_all(conn, tables=list(SCHEMA_8_TABLES), checkfirst=True)
                        conn.execute(update(ledger_info).where(ledger_info.c.name == "schema_version").values(value=str(SCHEMA_VERSION)))
                    elif version is not None and version != str(SCHEMA_VERSION):
                        raise LedgerError(
                            f"{self.safe_url}: ledger schema version {version}, this llmvisor reads {SCHEMA_VERSION}; "
                            "the database was left as it is"
                        )
                metadata.create_all(conn, checkfirst=True)
                version = conn.execute(select(ledger_info.c.value).where(ledger_info.c.name == "schema_version")).scalar()
                if version is None:
                    conn.execute(insert(ledger_info).values(name="schema_version", value=str(SCHEMA_VERSION)))
        except IntegrityError:
            # Another process created the schema at the same moment; it is there now.
            pass
        except DatabaseError as error:  # unreachable, or not a database at all ("file is not a database")
            raise LedgerError(f"cannot open database {self.safe_url}: {' '.join(str(error.orig).split())}") from None

    def ping(self) -> bool:
        """Whether the database answers."""
        try:
            with self._read_engine.connect() as conn:
                conn.execute(select(1))
        except OperationalError:
            return False
        return True

    def close(self) -> None:
        self._write_engine.dispose()
        if self._read_engine is not self._write_engine:
            self._read_engine.dispose()

    @contextmanager
    def write_transaction(self) -> Iterator[Connection]:
        """One write transaction; on SQLite writers take turns on a lock (one writer at a time)."""
        if self._write_lock is None:
            with self._write_engine.begin() as conn:
                yield conn
        else:
            with self._write_lock, self._write_engine.begin() as conn:
                yield conn

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        with self._read_engine.begin() as conn:
            yield conn

    @contextmanager
    def read_transaction(self) -> Iterator[Connection]:
        """One read transaction, for queries kept beside their domain (``llmvisor.billing``)."""
        with self._read() as conn:
            yield conn

    # -----------------------------------------------------------------------------------------------------
    # Ingest

    def ingest(self, records: StepRecords) -> IngestOutcome:
        """Store the steps not yet stored, in one transaction; raise `StepConflictError` if any differs."""
        keys = list(zip(records.run_id.tolist(), records.step_id.tolist()))
        # Built outside the lock on the expectation that every step is new, which holds unless this is a retry.
        all_new = _StoredBatch(records) if records.n_steps else None
        for attempt in range(_WRITE_ATTEMPTS):
            try:
                with self.write_transaction() as conn:
                    stored = self._stored_hashes(conn, keys)
                    conflicts = [k for k, digest in zip(keys, records.content_sha256) if k in stored and stored[k] != digest]
                    if conflicts:
                        raise StepConflictError(conflicts)
                    inserted = [k not in stored for k in keys]
                    refused = self._refuse_duplicate_runs(conn, [k[0] for k, new in zip(keys, inserted) if new])
                    if refused:
                        raise next(iter(refused.values()))
                    if records.run_sha256 is not None:  # only a batch carrying a run's step 0: one lookup per new run
                        self._claim_run_digests(conn, [
                            (run, digest) for run, digest, new in zip(records.run_id.tolist(), records.run_sha256, inserted)
                            if new and digest is not None
                        ], "step")
                    if all(inserted):
                        batch = all_new
                    elif any(inserted):
                        batch = _StoredBatch(records.select_steps(np.asarray(inserted)))
                    else:
                        batch = None
                    if batch is not None:
                        self._insert(conn, batch)
                return IngestOutcome(inserted)
            except DuplicateRunError as duplicate:  # rolled back: nothing of the batch is stored
                if not duplicate.earlier:
                    self._remember_duplicate(duplicate)
                raise
            except HeldStepsError as held:  # rolled back: nothing of the batch is stored
                covered = [k for k, new in zip(keys, inserted) if new and held.covers(k[0], np.asarray([k[1]]))]
                raise StepConflictError(covered or [(held.run_id, held.overlaps[0][0])],
                                        "is already held in a stored window (or twice in this batch)") from None
            except (IntegrityError, OperationalError):
                # A concurrent writer (another thread, or another service process on the same PostgreSQL)
                # stored some of these keys after this transaction looked them up: its insert waits for that
                # commit and fails on the primary key, or the database was busy. The next attempt sees the
                # commit and answers those steps as duplicates (200) or conflicts (409), never twice stored.
                if attempt == _WRITE_ATTEMPTS - 1:
                    raise
                time.sleep(0.01 * 2**attempt)
        raise AssertionError("unreachable")

    def ingest_windows(self, aggregates: Sequence) -> WindowOutcome:
        """Store the window aggregates (`llmvisor.metering.WindowAggregate`) not yet stored: per window its row, its
        tenants' usage added to the per-second rows, its requests to their totals (if kept) and its step ids merged
        into the run's ranges. An identical re-send is a duplicate; `WindowConflictError` (nothing of the batch
        stored) if one differs, also from another in the same batch.

        Group commit: the batches of concurrent callers (a service process's concurrent POSTs) are stored in one
        transaction, each caller answered for its own batch, so a fleet's windows cost one transaction, and one
        row per tenant and second, per commit instead of per window (schema 7 note)."""
        digests: dict[tuple[str, int], bytes] = {}
        unique = []
        conflicts: list[tuple[str, int]] = []
        for w in aggregates:
            key, digest = (w.run_id, w.window_start_us), w.content_sha256()
            if key in digests:
                if digests[key] != digest:
                    conflicts.append(key)
                continue
            digests[key] = digest
            unique.append(w)
        if conflicts:
            raise WindowConflictError(conflicts)
        return self._commit.submit(_WindowBatch(unique, digests, len(aggregates)), self._commit_window_batches)

    def _commit_window_batches(self, batches: list[_WindowBatch]) -> None:
        """Store ``batches`` in one transaction, setting each one's ``outcome`` or ``error``; a batch that covers
        steps held under another key makes the others go one by one, so only it is refused."""
        for attempt in range(_WRITE_ATTEMPTS):
            try:
                with self.write_transaction() as conn:
                    for batch in batches:
                        batch.outcome = batch.error = None
                    duplicates: list[DuplicateRunError] = []
                    keys = list(dict.fromkeys(k for batch in batches for k in batch.digests))
                    stored = self._stored_window_hashes(conn, keys)
                    taken: dict[tuple[str, int], bytes] = {}  # stored before, or by an earlier batch of this commit
                    # a run's first window (the one covering step 0): its digest without the run id, one lookup per commit
                    firsts = {(w.run_id, w.window_start_us): w.first_step_sha256() for batch in batches for w in batch.unique
                              if w.step_ranges and w.step_ranges[0][0] == 0 and (w.run_id, w.window_start_us) not in stored}
                    run_held = self._held_run_digests(conn, list(firsts.values())) if firsts else {}
                    refused = self._refuse_duplicate_runs(conn, [k[0] for k in keys if k not in stored])
                    new = []
                    for batch in batches:
                        held = [(k, stored.get(k, taken.get(k)), d) for k, d in batch.digests.items()]
                        conflicts = [k for k, had, d in held if had is not None and had != d]
                        if conflicts:
                            batch.error = WindowConflictError(conflicts)
                            continue
                        batch.new = [w for w in batch.unique if (w.run_id, w.window_start_us) not in stored
                                     and (w.run_id, w.window_start_us) not in taken]
                        marked = [refused[w.run_id] for w in batch.new if w.run_id in refused]
                        if marked:
                            batch.new, batch.error = [], marked[0]
                            continue
                        claims = [(w.run_id, firsts[w.run_id, w.window_start_us]) for w in batch.new if (w.run_id, w.window_start_us) in firsts]
                        if claims:
                            try:
                                self._claim_run_digests(conn, claims, "window", run_held)
                            except DuplicateRunError as duplicate:
                                batch.new, batch.error = [], duplicate
                                duplicates.append(duplicate)
                                continue
                            run_held.update({d: r for r, d in claims})
                        taken.update({(w.run_id, w.window_start_us): batch.digests[w.run_id, w.window_start_us] for w in batch.new})
                        new.extend(batch.new)
                    reshaped = self._insert_windows(conn, new, taken) if new else []
                for duplicate in duplicates:
                    self._remember_duplicate(duplicate)
                for batch in batches:
                    if batch.error is None:
                        runs = {w.run_id for w in batch.unique}
                        batch.outcome = WindowOutcome(inserted=len(batch.new), duplicate=batch.received - len(batch.new),
                                                      stored=tuple(batch.new), reshaped_runs=tuple(r for r in reshaped if r in runs))
                return
            except HeldStepsError as held:  # rolled back: nothing of the commit is stored
                if len(batches) > 1:
                    for batch in batches:
                        self._commit_window_batches([batch])
                    return
                batch = batches[0]
                covered = [(w.run_id, w.window_start_us) for w in batch.new if held.covers(w.run_id, w.step_ids())]
                batch.outcome, batch.error = None, WindowConflictError(covered or [(held.run_id, batch.new[0].window_start_us)], HELD_ELSEWHERE)
                return
            except (IntegrityError, OperationalError) as error:
                if attempt == _WRITE_ATTEMPTS - 1:  # a concurrent writer stored some: the next look sees them
                    for batch in batches:
                        batch.outcome, batch.error = None, error
                    return
                time.sleep(0.01 * 2**attempt)

    def _refuse_duplicate_runs(self, conn: Connection, run_ids) -> dict[str, DuplicateRunError]:
        """The runs among ``run_ids`` refused before as re-sends of another run (`duplicate_runs`), with their error."""
        runs = sorted(set(run_ids))
        out: dict[str, DuplicateRunError] = {}
        for i in range(0, len(runs), _LOOKUP_CHUNK):
            query = select(duplicate_runs.c.run_id, duplicate_runs.c.duplicate_of, duplicate_runs.c.form).where(
                duplicate_runs.c.run_id.in_(runs[i : i + _LOOKUP_CHUNK]))
            for run_id, other, form in conn.execute(query):
                out[run_id] = DuplicateRunError(run_id, other, form, earlier=True)
        return out

    def _remember_duplicate(self, duplicate: DuplicateRunError) -> None:
        """Record a refused run (its own transaction: the refused batch was rolled back), so the rest of it is refused."""
        try:
            with self.write_transaction() as conn:
                if not self._refuse_duplicate_runs(conn, [duplicate.run_id]):
                    conn.execute(insert(duplicate_runs).values(run_id=duplicate.run_id, duplicate_of=duplicate.other_run_id,
                                                               form=duplicate.form, refused_at_us=now_us()))
        except IntegrityError:
            pass  # another process recorded it at the same moment

    def _claim_run_digests(self, conn: Connection, claims: Sequence[tuple[str, bytes]], form: str,
                           held: dict[bytes, str] | None = None) -> None:
        """Record ``claims`` (new run, its first-step digest) in `run_digests` with one lookup for all of them
        (or against ``held``, looked up already); `DuplicateRunError` if a digest is held by another run, or
        claimed by two runs of the batch. Two writers claiming one digest at once: the later insert fails on the
        key and its retry sees the earlier one's."""
        if not claims:
            return
        if held is None:
            held = self._held_run_digests(conn, [d for _r, d in claims])
        mine: dict[bytes, str] = {}
        for run_id, digest in claims:
            other = held.get(digest, mine.get(digest))
            if other is not None and other != run_id:
                raise DuplicateRunError(run_id, other, form)
            mine[digest] = run_id
        new = [{"digest": d, "run_id": r, "form": form, "created_at_us": now_us()} for d, r in mine.items() if d not in held]
        if new:
            conn.execute(insert(run_digests), new)

    @staticmethod
    def _held_run_digests(conn: Connection, digests: Sequence[bytes]) -> dict[bytes, str]:
        rows = conn.execute(select(run_digests.c.digest, run_digests.c.run_id).where(run_digests.c.digest.in_(list(set(digests))))).all()
        return {bytes(digest): run_id for digest, run_id in rows}

    def _stored_window_hashes(self, conn: Connection, keys: list[tuple[str, int]]) -> dict[tuple[str, int], bytes]:
        out: dict[tuple[str, int], bytes] = {}
        for run in sorted({k[0] for k in keys}):
            starts = [k[1] for k in keys if k[0] == run]
            for i in range(0, len(starts), _LOOKUP_CHUNK):
                rows = conn.execute(
                    select(windows.c.window_start_us, windows.c.content_sha256).where(
                        windows.c.run_id == run, windows.c.window_start_us.in_(starts[i : i + _LOOKUP_CHUNK])
                    )
                )
                out.update({(run, int(start)): bytes(digest) for start, digest in rows})
        return out

    def _insert_windows(self, conn: Connection, new: Sequence, digests: dict) -> list[str]:
        received_us = now_us()
        conn.execute(insert(windows), [
            {"run_id": w.run_id, "window_start_us": w.window_start_us, "window_end_us": w.window_end_us,
             "engine_class": w.engine_class, "model_version": w.model_version, "pending": w.pending, "num_steps": w.num_steps,
             "measured_ns": w.measured_ns, "attributed_ns": w.attributed_ns, "residual_count": w.residual.count,
             "residual_sum_s": w.residual.sum_s, "residual_sum_sq_s2": w.residual.sum_sq_s2, "residual_min_s": w.residual.min_s,
             "residual_max_s": w.residual.max_s, "content_sha256": digests[w.run_id, w.window_start_us], "ingested_at_us": received_us}
            for w in new
        ])
        tenant_rows: dict[tuple, dict] = {}
        request_rows: dict[tuple, dict] = {}
        for w in new:
            second_us = w.window_start_us // USAGE_RESOLUTION_US * USAGE_RESOLUTION_US
            for tenant, t in w.tenant_totals().items():
                key = (tenant, w.engine_class, 0 if w.pending else w.model_version, second_us)
                row = tenant_rows.get(key)
                if row is None:
                    tenant_rows[key] = {"tenant": tenant, "engine_class": key[1], "model_version": key[2], "second_us": second_us, **t}
                else:
                    _add_usage(row, t)
            if not self.request_totals:
                continue
            for q in w.requests:
                key = (w.run_id, q.request_id, q.tenant)
                row = request_rows.get(key)
                if row is None:
                    request_rows[key] = {"run_id": w.run_id, "request_id": q.request_id, "tenant": q.tenant, "first_second_us": second_us,
                                         "attributed_ns": q.attributed_ns, "measured_ns": q.measured_ns, "num_slices": q.num_steps,
                                         "num_new_tokens": q.num_new_tokens, "first_timestamp_us": q.first_timestamp_us,
                                         "last_timestamp_us": q.last_timestamp_us,
                                         **{name: getattr(q, name) for name in TOKEN_SPLIT_COLUMNS}}
                else:
                    _add_usage(row, {"attributed_ns": q.attributed_ns, "measured_ns": q.measured_ns, "num_slices": q.num_steps,
                                     "num_new_tokens": q.num_new_tokens, **{name: getattr(q, name) for name in TOKEN_SPLIT_COLUMNS}})
                    row["first_second_us"] = min(row["first_second_us"], second_us)
                    row["first_timestamp_us"] = min(row["first_timestamp_us"], q.first_timestamp_us)
                    row["last_timestamp_us"] = max(row["last_timestamp_us"], q.last_timestamp_us)
        if tenant_rows:
            self._add_rows(conn, tenant_seconds, [tenant_rows[k] for k in sorted(tenant_rows)])
        if request_rows:
            # in key order, so concurrent writers lock the rows in one order
            self._add_rows(conn, request_totals, [request_rows[k] for k in sorted(request_rows)],
                           key=("run_id", "request_id", "tenant"),
                           sums=("attributed_ns", "measured_ns", "num_slices", "num_new_tokens", *TOKEN_SPLIT_COLUMNS),
                           least=("first_second_us", "first_timestamp_us"), greatest=("last_timestamp_us",))
        run_ids = np.asarray([w.run_id for w in new for _ in range(w.num_steps)], dtype=object)
        step_ids = np.concatenate([w.step_ids() for w in new])
        classes = np.asarray([w.engine_class for w in new for _ in range(w.num_steps)], dtype=object)
        return self.add_step_ranges(conn, run_ids, step_ids, classes, np.full(step_ids.size, received_us))

    def _stored_hashes(self, conn: Connection, keys: list[tuple[str, int]]) -> dict[tuple[str, int], bytes]:
        by_run: dict[str, list[int]] = {}
        for run_id, step_id in keys:
            by_run.setdefault(run_id, []).append(step_id)
        stored: dict[tuple[str, int], bytes] = {}
        for run_id, step_ids in by_run.items():
            for i in range(0, len(step_ids), _LOOKUP_CHUNK):
                chunk = step_ids[i : i + _LOOKUP_CHUNK]
                query = select(steps.c.step_id, steps.c.content_sha256).where(
                    steps.c.run_id == run_id, steps.c.step_id.in_(chunk)
                )
                for step_id, digest in conn.execute(query):
                    stored[(run_id, step_id)] = bytes(digest)
        return stored

    def _raw_cursor(self, conn: Connection, statement: str):
        """The driver's own cursor, with its errors wrapped the way SQLAlchemy would (IntegrityError...)."""
        driver = self._write_engine.dialect.dbapi

        @contextmanager
        def cursor():
            try:
                with conn.connection.driver_connection.cursor() as raw:
                    yield raw
            except driver.Error as error:
                raise DBAPIError.instance(statement, None, error, driver.Error) from error

        return cursor()

    @staticmethod
    def _insert_blob(conn: Connection, batch: _StoredBatch, ingested_at_us: int) -> int:
        return conn.execute(
            insert(slice_batches)
            .values(ingested_at_us=ingested_at_us, num_steps=batch.n_steps, num_slices=batch.n_slices,
                    slices_parquet=batch.slices_parquet)
            .returning(slice_batches.c.batch_id)
        ).scalar_one()

    def _insert(self, conn: Connection, batch: _StoredBatch) -> None:
        """Rows straight to the driver (COPY and one array-valued upsert on PostgreSQL, executemany on
        SQLite): SQLAlchemy's per-row parameter processing would cost more than the database's own work."""
        ingested_at_us = now_us()
        slice_batch_id = self._insert_blob(conn, batch, ingested_at_us)
        # In key order, like the usage rows: two transactions inserting overlapping steps then wait on each
        # other in one order (the later one fails on the unique key and retries) instead of deadlocking.
        step_rows = sorted(batch.step_rows(slice_batch_id, ingested_at_us), key=lambda row: (row[0], row[1]))
        step_columns = ", ".join(column.name for column in steps.columns)
        if self.backend == "postgresql":
            copy_statement = f"COPY steps ({step_columns}) FROM STDIN"
            with self._raw_cursor(conn, copy_statement) as cursor:
                with cursor.copy(copy_statement) as copy:
                    for row in step_rows:
                        copy.write_row(row)
        else:
            conn.exec_driver_sql(f"INSERT INTO steps ({step_columns}) VALUES ({', '.join(['?'] * len(steps.columns))})", step_rows)
        self._upsert_usage(conn, batch)
        records = batch.records
        received_us = np.full(records.n_steps, ingested_at_us) if records.ingested_at_us is None else records.ingested_at_us
        self.add_step_ranges(conn, records.run_id, records.step_id, records.per_step("engine_class", ""), received_us)

    def add_step_ranges(self, conn: Connection, run_id: np.ndarray, step_id: np.ndarray, engine_class: np.ndarray,
                        received_us: np.ndarray) -> list[str]:
        """Merge newly stored steps' ids into their runs' ranges (`step_ranges`), run by run in name order;
        `HeldStepsError` if a step id is held already (in a stored window, or stored one by one) or twice in
        this batch, so a step is billed once whatever key it came under: a delivery process that replaced a
        dead one and aggregated steps whose window was still on its way is refused, not counted twice.

        Last in the transaction, after every row lock it takes: on PostgreSQL a transaction-scoped advisory
        lock per run makes concurrent writers of one run take turns on its ranges, and taking those locks in
        one order while waiting on nothing else cannot deadlock. SQLite has one writer at a time anyway.

        Returns the runs whose ranges changed other than by their one range next to the new steps growing
        over them: a run's gaps (the holes between its ranges) are unchanged in that usual case."""
        run_id = np.asarray(run_id, dtype=object).astype(str)
        reshaped = []
        for run in sorted(set(run_id.tolist())):
            mine = run_id == run
            ids, counts = np.unique(np.asarray(step_id[mine], dtype=np.int64), return_counts=True)
            if np.any(counts > 1):
                raise HeldStepsError(run, step_id_ranges(ids[counts > 1]))
            islands = step_id_ranges(ids)
            engine_class_of_run = str(np.asarray(engine_class, dtype=object)[mine][0])
            received = int(np.min(np.asarray(received_us)[mine]))
            if self.backend == "postgresql":
                conn.execute(select(func.pg_advisory_xact_lock(func.hashtextextended(run, 0))))
            low, high = islands[0][0], islands[-1][1]
            table = step_ranges
            existing = conn.execute(
                select(table.c.first_step_id, table.c.last_step_id, table.c.engine_class, table.c.first_received_us).where(
                    table.c.run_id == run, table.c.last_step_id >= low - 1, table.c.first_step_id <= high + 1
                )
            ).all()
            overlaps = range_overlaps(islands, sorted((int(row[0]), int(row[1])) for row in existing))
            if overlaps:
                raise HeldStepsError(run, overlaps)
            merged = merge_ranges([*((a, b, engine_class_of_run, received) for a, b in islands), *map(tuple, existing)])
            if len(existing) == 1 and len(merged) == 1:  # the usual case: the new steps extend the run's one range
                a, b, c, r = merged[0]
                conn.execute(
                    update(table).where(table.c.run_id == run, table.c.first_step_id == existing[0][0])
                    .values(first_step_id=a, last_step_id=b, engine_class=c, first_received_us=r)
                )
                continue
            reshaped.append(run)
            if existing:
                conn.execute(
                    delete(table).where(table.c.run_id == run, table.c.first_step_id.in_([row[0] for row in existing]))
                )
            conn.execute(
                insert(table),
                [{"run_id": run, "first_step_id": a, "last_step_id": b, "engine_class": c, "first_received_us": r}
                 for a, b, c, r in merged],
            )
        return reshaped

    def _upsert_usage(self, conn: Connection, batch: _StoredBatch) -> None:
        if not batch.usage_columns[0]:
            return
        self._add_rows(conn, usage_per_second, batch.usage_columns, key=_USAGE_KEY, sums=(*_USAGE_SUMS, *TOKEN_SPLIT_COLUMNS),
                       least=("first_timestamp_us",), greatest=("last_timestamp_us",))

    def _add_rows(self, conn: Connection, table, rows: list, *, key: Sequence[str] = (), sums: Sequence[str] = (),
                  least: Sequence[str] = (), greatest: Sequence[str] = ()) -> None:
        """Insert ``rows`` (dicts by column name, or lists of values column by column in the table's order) in one
        statement; with a ``key``, a row already there instead adds ``sums`` and widens ``least``/``greatest``.
        On PostgreSQL the columns go as arrays through unnest: one round trip, where an executemany costs a
        pipelined statement per row (a fifth of a window's ingest)."""
        names = [column.name for column in table.columns]
        columns = [[row[name] for row in rows] for name in names] if isinstance(rows[0], dict) else rows
        conflict = ""
        if key:
            lowest, highest = ("LEAST", "GREATEST") if self.backend == "postgresql" else ("min", "max")
            sets = [*(f"{n} = {table.name}.{n} + excluded.{n}" for n in sums),
                    *(f"{n} = {lowest}({table.name}.{n}, excluded.{n})" for n in least),
                    *(f"{n} = {highest}({table.name}.{n}, excluded.{n})" for n in greatest)]
            conflict = f" ON CONFLICT ({', '.join(key)}) DO UPDATE SET {', '.join(sets)}"
        if self.backend == "postgresql":
            types = [column.type.compile(dialect=conn.dialect) for column in table.columns]
            statement = (f"INSERT INTO {table.name} ({', '.join(names)}) "
                         f"SELECT * FROM unnest({', '.join(f'%s::{t}[]' for t in types)}){conflict}")
            with self._raw_cursor(conn, statement) as cursor:
                cursor.execute(statement, columns)
        else:
            statement = f"INSERT INTO {table.name} ({', '.join(names)}) VALUES ({', '.join(['?'] * len(names))}){conflict}"
            conn.exec_driver_sql(statement, list(zip(*columns)))

    # -----------------------------------------------------------------------------------------------------
    # Queries; time ranges are [start_us, end_us) on the step's timestamp, None meaning unbounded, in whole
    # seconds (usage is kept per second).

    @staticmethod
    def _range(column, start_us: int | None, end_us: int | None) -> list:
        conditions = []
        for name, bound in (("start", start_us), ("end", end_us)):
            if bound is not None and bound % USAGE_RESOLUTION_US:
                raise LedgerError(f"{name}: usage is kept per second; give a whole second, not {bound / 1e6!r}")
        if start_us is not None:
            conditions.append(column >= start_us)
        if end_us is not None:
            conditions.append(column < end_us)
        return conditions

    def tenant_usage(
        self,
        start_us: int | None = None,
        end_us: int | None = None,
        bucket: str | None = None,
        tenant: str | None = None,
    ) -> list[UsageRow]:
        """Attributed time per tenant (and per UTC bucket of ``bucket`` if given), ordered by tenant and time;
        steps stored one by one and window aggregates alike."""
        usage = _tenant_usage_rows()
        conditions = self._range(usage.c.second_us, start_us, end_us)
        if tenant is not None:
            conditions.append(usage.c.tenant == tenant)
        columns = [usage.c.tenant]
        if bucket is not None:
            if bucket not in BUCKET_US:
                raise LedgerError(f"unknown bucket {bucket!r}; choose one of {', '.join(BUCKET_US)}")
            size = BUCKET_US[bucket]
            columns.append(((usage.c.second_us // size) * size).label("bucket_start_us"))
        query = (
            select(*columns, func.sum(usage.c.attributed_ns), func.sum(usage.c.num_slices), func.sum(usage.c.num_new_tokens),
                   *split_sums(usage))
            .where(and_(True, *conditions))
            .group_by(*columns)
            .order_by(*columns)
        )
        with self._read() as conn:
            rows = conn.execute(query).all()
        return [
            UsageRow(
                tenant=row[0],
                bucket_start_us=int(row[1]) if bucket is not None else None,
                attributed_ns=int(row[-6]),
                num_slices=int(row[-5]),
                num_new_tokens=int(row[-4]),
                **_counts(row[-3:]),
            )
            for row in rows
        ]

    def class_usage(
        self, start_us: int | None = None, end_us: int | None = None, bucket: str = "hour", tenant: str | None = None
    ) -> list[tuple]:
        """(engine_class, bucket_start_us, attributed_ns, num_slices, num_new_tokens, num_uncached_prompt_tokens,
        num_cached_prompt_tokens, num_output_tokens) per engine class and UTC bucket, a tenant's if given (the split
        None where unknown, `split_sums`). A request's class is its run's (a run is one engine instance; its first
        class seen in `step_ranges`), so this reads the per-second usage, not the steps."""
        if bucket not in BUCKET_US:
            raise LedgerError(f"unknown bucket {bucket!r}; choose one of {', '.join(BUCKET_US)}")
        usage = _tenant_usage_rows(with_class=True)  # steps stored one by one, and window aggregates
        size = BUCKET_US[bucket]
        conditions = self._range(usage.c.second_us, start_us, end_us)
        if tenant is not None:
            conditions.append(usage.c.tenant == tenant)
        columns = [usage.c.engine_class, ((usage.c.second_us // size) * size).label("bucket_start_us")]
        query = (
            select(*columns, func.sum(usage.c.attributed_ns), func.sum(usage.c.num_slices), func.sum(usage.c.num_new_tokens),
                   *split_sums(usage))
            .where(and_(True, *conditions))
            .group_by(*columns)
            .order_by(*columns)
        )
        with self._read() as conn:
            return [(str(r[0]), int(r[1]), int(r[2]), int(r[3]), int(r[4]), *_counts(r[5:]).values())
                    for r in conn.execute(query).all()]

    def billing_versions(self, start_us: int | None = None, end_us: int | None = None, tenant: str | None = None) -> list[tuple[str, int | None]]:
        """(engine_class, model_version) of the attributed steps of the runs a tenant (if given) had usage in, in
        the range: the model versions that billed it (None: the service's default model). No counts: a run's
        steps are other tenants' too."""
        usage = usage_per_second
        run_conditions = self._range(usage.c.second_us, start_us, end_us)
        if tenant is not None:
            run_conditions.append(usage.c.tenant == tenant)
        runs = select(usage.c.run_id).where(and_(True, *run_conditions)).distinct()
        conditions = [steps.c.run_id.in_(runs), steps.c.pending.is_(False)]
        if start_us is not None:
            conditions.append(steps.c.timestamp_us >= start_us)
        if end_us is not None:
            conditions.append(steps.c.timestamp_us < end_us)
        query = (
            select(steps.c.engine_class, steps.c.model_version)
            .where(and_(*conditions))
            .distinct()
            .order_by(steps.c.engine_class, steps.c.model_version)
        )
        w = tenant_seconds
        window_conditions = self._range(w.c.second_us, start_us, end_us)
        if tenant is not None:
            window_conditions.append(w.c.tenant == tenant)
        window_query = (  # metered in windows: the versions of the windows the tenant had usage in (0: pending)
            select(w.c.engine_class, w.c.model_version).where(and_(w.c.model_version != 0, *window_conditions)).distinct()
        )
        with self._read() as conn:
            found = {(str(r[0]), None if r[1] is None else int(r[1])) for r in [*conn.execute(query).all(), *conn.execute(window_query).all()]}
        return sorted(found, key=lambda cv: (cv[0], -1 if cv[1] is None else cv[1]))

    def request_usage(
        self,
        start_us: int | None = None,
        end_us: int | None = None,
        tenant: str | None = None,
        run_id: str | None = None,
        request_id: str | None = None,
        limit: int = 1000,
        offset: int = 0,
        request_id_prefix: str | None = None,
    ) -> list[RequestUsageRow]:
        """Attributed time per request, largest first. A request metered in windows counts in the range its
        first window starts in. ``request_id_prefix`` keeps the ids that start with it (matched as a literal: ``%``
        and ``_`` in it are not wildcards; SQLite's LIKE ignores ASCII case, so callers that need an exact prefix
        check the ids returned)."""
        usage = _request_usage_rows()
        conditions = self._range(usage.c.second_us, start_us, end_us)
        for column, value in ((usage.c.tenant, tenant), (usage.c.run_id, run_id), (usage.c.request_id, request_id)):
            if value is not None:
                conditions.append(column == value)
        if request_id_prefix is not None:
            conditions.append(usage.c.request_id.startswith(request_id_prefix, autoescape=True))
        total = func.sum(usage.c.attributed_ns)
        query = (
            select(
                usage.c.run_id,
                usage.c.request_id,
                usage.c.tenant,
                total,
                func.sum(usage.c.num_slices),
                func.sum(usage.c.num_new_tokens),
                func.min(usage.c.first_timestamp_us),
                func.max(usage.c.last_timestamp_us),
                *split_sums(usage),
            )
            .where(and_(True, *conditions))
            .group_by(usage.c.run_id, usage.c.request_id, usage.c.tenant)
            .order_by(total.desc(), usage.c.run_id, usage.c.request_id, usage.c.tenant)
            .limit(limit)
            .offset(offset)
        )
        with self._read() as conn:
            rows = conn.execute(query).all()
        return [RequestUsageRow(r[0], r[1], r[2], int(r[3]), int(r[4]), int(r[5]), int(r[6]), int(r[7]), **_counts(r[8:]))
                for r in rows]

    def top_tenants(self, n: int, start_us: int | None = None, end_us: int | None = None) -> list[UsageRow]:
        """The ``n`` tenants with the most attributed time, largest first."""
        usage = _tenant_usage_rows()
        total = func.sum(usage.c.attributed_ns)
        query = (
            select(usage.c.tenant, total, func.sum(usage.c.num_slices), func.sum(usage.c.num_new_tokens))
            .where(and_(True, *self._range(usage.c.second_us, start_us, end_us)))
            .group_by(usage.c.tenant)
            .order_by(total.desc(), usage.c.tenant)
            .limit(n)
        )
        with self._read() as conn:
            rows = conn.execute(query).all()
        return [UsageRow(r[0], None, int(r[1]), int(r[2]), int(r[3])) for r in rows]

    def totals(self, start_us: int | None = None, end_us: int | None = None) -> Totals:
        """Steps and measured time, slices and attributed time, read in one snapshot so they reconcile."""
        step_query = (
            select(steps.c.pending, func.count(), func.coalesce(func.sum(steps.c.measured_ns), 0))
            .where(and_(True, *self._range(steps.c.timestamp_us, start_us, end_us)))
            .group_by(steps.c.pending)
        )
        window_query = (
            select(windows.c.pending, func.coalesce(func.sum(windows.c.num_steps), 0), func.coalesce(func.sum(windows.c.measured_ns), 0))
            .where(and_(True, *self._range(windows.c.window_start_us // USAGE_RESOLUTION_US * USAGE_RESOLUTION_US, start_us, end_us)))
            .group_by(windows.c.pending)
        )
        usage = _tenant_usage_rows()
        usage_query = select(
            func.coalesce(func.sum(usage.c.num_slices), 0), func.coalesce(func.sum(usage.c.attributed_ns), 0)
        ).where(and_(True, *self._range(usage.c.second_us, start_us, end_us)))
        engine = self._read_engine
        if self.backend == "postgresql":
            engine = engine.execution_options(isolation_level="REPEATABLE READ")
        with engine.begin() as conn:
            by_state = {bool(pending): (int(n), int(ns)) for pending, n, ns in conn.execute(step_query)}
            for pending, n, ns in conn.execute(window_query):
                have = by_state.get(bool(pending), (0, 0))
                by_state[bool(pending)] = (have[0] + int(n), have[1] + int(ns))
            n_slices, attributed = conn.execute(usage_query).one()
        (n_steps, measured), (n_pending, pending_ns) = by_state.get(False, (0, 0)), by_state.get(True, (0, 0))
        return Totals(n_steps, measured, int(n_slices), int(attributed), n_pending, pending_ns)

    def step_detail(self, run_id: str, step_id: int) -> StepDetail | None:
        """One stored step with its slices and their shares, read back from its batch's Parquet blob."""
        with self._read() as conn:
            row = conn.execute(
                select(steps, slice_batches.c.slices_parquet)
                .join(slice_batches, slice_batches.c.batch_id == steps.c.slice_batch_id)
                .where(steps.c.run_id == run_id, steps.c.step_id == step_id)
            ).first()
        if row is None:
            return None
        table = pq.read_table(
            pa.BufferReader(bytes(row.slices_parquet)), filters=[("run_id", "=", run_id), ("step_id", "=", step_id)]
        )
        table = table.sort_by([("request_id", "ascending")])
        return StepDetail(
            run_id=row.run_id,
            step_id=int(row.step_id),
            measured_ns=int(row.measured_ns),
            predicted_s=None if row.predicted_s is None else float(row.predicted_s),
            timestamp_us=int(row.timestamp_us),
            ingested_at_us=int(row.ingested_at_us),
            content_sha256=bytes(row.content_sha256),
            engine_class=row.engine_class,
            model_version=row.model_version,
            pending=bool(row.pending),
            slices=[
                SliceShare(
                    request_id=r["request_id"], tenant=r["tenant"], num_new_tokens=r["num_new_tokens"],
                    num_context_tokens=r["num_context_tokens"], phase=r["phase"], attributed_ns=r["attributed_ns"],
                )
                for r in table.select(
                    ["request_id", "tenant", "num_new_tokens", "num_context_tokens", "phase", "attributed_ns"]
                ).to_pylist()
            ],
        )

    # -----------------------------------------------------------------------------------------------------
    # Gaps: step ids a run never delivered

    def run_gaps(self, run_id: str) -> RunGaps | None:
        """The run's received ids and gaps (with its end-of-run record, if stored); None if neither a step of it
        nor its end record is stored."""
        table = step_ranges
        with self._read() as conn:
            rows = conn.execute(
                select(table.c.first_step_id, table.c.last_step_id, table.c.engine_class, table.c.first_received_us)
                .where(table.c.run_id == run_id)
            ).all()
            end = self._run_ends(conn, [run_id]).get(run_id)
        return gaps_of_ranges(run_id, [tuple(r) for r in rows], end) if rows or end else None

    @staticmethod
    def _run_ends(conn: Connection, run_ids: Sequence[str]) -> dict[str, RunEnd]:
        out: dict[str, RunEnd] = {}
        for i in range(0, len(run_ids), _LOOKUP_CHUNK):
            query = select(run_ends.c.run_id, run_ends.c.last_step_id, run_ends.c.num_steps, run_ends.c.received_at_us).where(
                run_ends.c.run_id.in_(list(run_ids[i : i + _LOOKUP_CHUNK])))
            out.update({run: RunEnd(run, int(last), int(n), int(at)) for run, last, n, at in conn.execute(query)})
        return out

    def end_run(self, run_id: str, last_step_id: int, num_steps: int) -> tuple[RunEnd, bool]:
        """Store a run's end-of-run record; ``(record, True)`` when stored now, ``(stored record, False)`` for an
        identical re-send. `RunEndConflictError` if the run has one with other values (a run ends once)."""
        for attempt in range(_WRITE_ATTEMPTS):
            try:
                with self.write_transaction() as conn:
                    stored = self._run_ends(conn, [run_id]).get(run_id)
                    if stored is not None:
                        if (stored.last_step_id, stored.num_steps) != (last_step_id, num_steps):
                            raise RunEndConflictError(stored, last_step_id, num_steps)
                        return stored, False
                    record = RunEnd(run_id, last_step_id, num_steps, now_us())
                    conn.execute(insert(run_ends).values(run_id=run_id, last_step_id=last_step_id, num_steps=num_steps,
                                                         received_at_us=record.received_at_us))
                return record, True
            except (IntegrityError, OperationalError):  # stored by another writer meanwhile: the next look sees it
                if attempt == _WRITE_ATTEMPTS - 1:
                    raise
                time.sleep(0.01 * 2**attempt)
        raise AssertionError("unreachable")

    def run_holdings(self, run_id: str, from_step_id: int = 0) -> RunHoldings:
        """`RunHoldings` of ``run_id``: the one read a replacement delivery process resumes from (read-only; the
        step ranges and the windows read in one transaction)."""
        table = step_ranges
        with self._read() as conn:
            rows = conn.execute(
                select(table.c.first_step_id, table.c.last_step_id)
                .where(table.c.run_id == run_id, table.c.last_step_id >= from_step_id)
                .order_by(table.c.first_step_id)
            ).all()
            num_windows, last_end = conn.execute(
                select(func.count(), func.max(windows.c.window_end_us)).where(windows.c.run_id == run_id)
            ).one()
        return RunHoldings(
            run_id=run_id, from_step_id=from_step_id, step_ranges=[(max(int(a), from_step_id), int(b)) for a, b in rows],
            num_windows=int(num_windows), last_window_end_us=None if last_end is None else int(last_end),
        )

    def runs_with_gaps(self, limit: int = 1000) -> list[RunGaps]:
        """Runs missing steps (by most recent gap first, at most ``limit``), with their gaps: holes in their ranges,
        and a lost tail (an end-of-run record naming a later last step than the last one stored)."""
        table = step_ranges
        gapped = (
            select(table.c.run_id, func.max(table.c.first_received_us).label("since_us"))
            .group_by(table.c.run_id)
            .having(or_(func.count() > 1, func.min(table.c.first_step_id) > 0))
            .order_by(func.max(table.c.first_received_us).desc(), table.c.run_id)
            .limit(limit)
        )
        last_stored = select(func.max(table.c.last_step_id)).where(table.c.run_id == run_ends.c.run_id).scalar_subquery()
        tails = (
            select(run_ends.c.run_id, run_ends.c.received_at_us)
            .where(run_ends.c.last_step_id > func.coalesce(last_stored, -1))
            .order_by(run_ends.c.received_at_us.desc(), run_ends.c.run_id)
            .limit(limit)
        )
        with self._read() as conn:
            found = {run: int(since) for run, since in conn.execute(gapped)}
            for run, since in conn.execute(tails):
                found[run] = max(found.get(run, 0), int(since))
            runs = sorted(found, key=lambda run: (-found[run], run))[:limit]
            by_run: dict[str, list[tuple]] = {run: [] for run in runs}
            for i in range(0, len(runs), _LOOKUP_CHUNK):
                query = select(
                    table.c.run_id, table.c.first_step_id, table.c.last_step_id, table.c.engine_class, table.c.first_received_us
                ).where(table.c.run_id.in_(runs[i : i + _LOOKUP_CHUNK]))
                for run, *rest in conn.execute(query):
                    by_run[run].append(tuple(rest))
            ends = self._run_ends(conn, runs)
        return [gaps_of_ranges(run, ranges, ends.get(run)) for run, ranges in by_run.items()]

    # -----------------------------------------------------------------------------------------------------
    # API keys

    def create_key(self, tenant: str | None = None, *, is_admin: bool = False) -> str:
        """Store a new key and return it; it is not stored in the clear, so it cannot be shown again."""
        if is_admin == (tenant is not None):
            raise LedgerError("a key is either an admin key (no tenant) or a tenant key (with a tenant)")
        if tenant is not None and not tenant:
            raise LedgerError("the tenant name must not be empty")
        key_id, key, digest = keys_module.new_key()
        with self.write_transaction() as conn:
            conn.execute(
                insert(api_keys).values(
                    key_id=key_id, secret_sha256=digest, tenant=tenant, is_admin=is_admin, created_at_us=now_us()
                )
            )
        return key

    def authenticate(self, key: str) -> Principal | None:
        """The principal of a valid, unrevoked key, else None."""
        parts = keys_module.split_key(key)
        if parts is None:
            return None
        key_id, secret = parts
        with self._read() as conn:
            row = conn.execute(
                select(api_keys.c.secret_sha256, api_keys.c.tenant, api_keys.c.is_admin, api_keys.c.revoked_at_us).where(
                    api_keys.c.key_id == key_id
                )
            ).first()
        if not keys_module.secret_matches(secret, None if row is None else row[0]):
            return None
        if row[3] is not None:
            return None
        return Principal(key_id=key_id, tenant=row[1], is_admin=bool(row[2]))

    def list_keys(self) -> list[KeyInfo]:
        query = select(
            api_keys.c.key_id, api_keys.c.tenant, api_keys.c.is_admin, api_keys.c.created_at_us, api_keys.c.revoked_at_us
        ).order_by(api_keys.c.created_at_us, api_keys.c.key_id)
        with self._read() as conn:
            return [KeyInfo(r[0], r[1], bool(r[2]), int(r[3]), None if r[4] is None else int(r[4])) for r in conn.execute(query)]

    def revoke_key(self, key_id: str) -> bool:
        """Revoke a key; False if there is no such unrevoked key."""
        with self.write_transaction() as conn:
            result = conn.execute(
                update(api_keys)
                .where(api_keys.c.key_id == key_id, api_keys.c.revoked_at_us.is_(None))
                .values(revoked_at_us=now_us())
            )
        return result.rowcount > 0

    # -----------------------------------------------------------------------------------------------------
    # Model registry: fitted models per engine class (fingerprint id), versioned; one active per class.

    def add_model(self, engine_class: str, model_json: str, source: str, *, activate: bool = False) -> int:
        """Store a model as the next version of its class; returns the version (1, 2, ...)."""
        for attempt in range(_WRITE_ATTEMPTS):
            try:
                with self.write_transaction() as conn:
                    latest = conn.execute(
                        select(func.max(engine_models.c.version)).where(engine_models.c.engine_class == engine_class)
                    ).scalar()
                    version = int(latest or 0) + 1
                    conn.execute(
                        insert(engine_models).values(
                            engine_class=engine_class, version=version, model_json=model_json, source=source,
                            created_at_us=now_us(),
                        )
                    )
                    if activate:
                        self._set_active(conn, engine_class, version)
                return version
            except IntegrityError:  # another writer took the same version number
                if attempt == _WRITE_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    def list_models(self, engine_class: str | None = None) -> list[ModelVersion]:
        query = (
            select(engine_models.c.engine_class, engine_models.c.version, engine_models.c.source,
                   engine_models.c.created_at_us, active_models.c.version)
            .outerjoin(active_models, active_models.c.engine_class == engine_models.c.engine_class)
            .order_by(engine_models.c.engine_class, engine_models.c.version)
        )
        if engine_class is not None:
            query = query.where(engine_models.c.engine_class == engine_class)
        with self._read() as conn:
            return [ModelVersion(r[0], int(r[1]), r[2], int(r[3]), r[4] == r[1]) for r in conn.execute(query)]

    def active_versions(self) -> dict[str, int]:
        """Each class with an active model, and its version."""
        with self._read() as conn:
            return {r[0]: int(r[1]) for r in conn.execute(select(active_models.c.engine_class, active_models.c.version))}

    def model_json(self, engine_class: str, version: int) -> str | None:
        with self._read() as conn:
            return conn.execute(
                select(engine_models.c.model_json).where(
                    engine_models.c.engine_class == engine_class, engine_models.c.version == version
                )
            ).scalar()

    def has_model_version(self, engine_class: str, version: int) -> bool:
        """Whether version ``version`` of ``engine_class`` is registered; a version found is remembered (the
        windows route asks this of every window)."""
        key = (engine_class, int(version))
        if key in self._known_versions:
            return True
        with self._read() as conn:
            found = conn.execute(
                select(engine_models.c.version).where(engine_models.c.engine_class == engine_class, engine_models.c.version == version)
            ).first() is not None
        if found:
            self._known_versions.add(key)
        return found

    def activate_model(self, engine_class: str, version: int) -> None:
        """Make a stored version the one attributing its class (its pending steps are attributed separately:
        `resolve_pending`)."""
        with self.write_transaction() as conn:
            self._set_active(conn, engine_class, version)

    def _set_active(self, conn: Connection, engine_class: str, version: int) -> None:
        exists = conn.execute(
            select(engine_models.c.version).where(engine_models.c.engine_class == engine_class, engine_models.c.version == version)
        ).first()
        if exists is None:
            raise LedgerError(f"no model version {version} of engine class {engine_class!r} is stored (see `llmvisor models list`)")
        updated = conn.execute(
            update(active_models).where(active_models.c.engine_class == engine_class).values(version=version, activated_at_us=now_us())
        )
        if updated.rowcount == 0:
            conn.execute(insert(active_models).values(engine_class=engine_class, version=version, activated_at_us=now_us()))

    # -----------------------------------------------------------------------------------------------------
    # Pending steps and stored steps read back (for attributing pending steps and for refits)

    def pending_classes(self) -> dict[str, int]:
        """Classes with pending steps, and how many (reads every step's state: for reports, not per request)."""
        query = select(steps.c.engine_class, func.count()).where(steps.c.pending.is_(True)).group_by(steps.c.engine_class)
        with self._read() as conn:
            return {r[0]: int(r[1]) for r in conn.execute(query)}

    def has_pending(self, engine_class: str) -> bool:
        """Whether a class has a pending step (one index lookup)."""
        query = select(steps.c.step_id).where(steps.c.engine_class == engine_class, steps.c.pending.is_(True)).limit(1)
        with self._read() as conn:
            return conn.execute(query).first() is not None

    def stored_steps(self, engine_class: str, *, pending_only: bool = False, newest: int | None = None) -> StoredSteps:
        """Steps of a class (only the pending ones, or the ``newest`` by start time) with their slices."""
        query = select(steps.c.run_id, steps.c.step_id, steps.c.timestamp_us, steps.c.slice_batch_id).where(
            steps.c.engine_class == engine_class
        )
        if pending_only:
            query = query.where(steps.c.pending.is_(True))
        query = query.order_by(steps.c.timestamp_us.desc(), steps.c.run_id, steps.c.step_id)
        if newest is not None:
            query = query.limit(newest)
        with self._read() as conn:
            rows = conn.execute(query).all()
            return self._with_slices(conn, rows)

    def run_windows(self, run_ids: Sequence[str], start_us: int, end_us: int) -> list[StoredWindow]:
        """The stored windows of ``run_ids`` whose second (of their start) is in [start_us, end_us), by run and start."""
        win = windows
        out: list[StoredWindow] = []
        runs = sorted(set(run_ids))
        with self._read() as conn:
            for i in range(0, len(runs), _LOOKUP_CHUNK):
                query = (
                    select(win.c.run_id, win.c.window_start_us, win.c.window_end_us, win.c.engine_class, win.c.model_version, win.c.pending,
                           win.c.num_steps, win.c.measured_ns)
                    .where(win.c.run_id.in_(runs[i : i + _LOOKUP_CHUNK]),
                           *self._range(win.c.window_start_us // USAGE_RESOLUTION_US * USAGE_RESOLUTION_US, start_us, end_us))
                    .order_by(win.c.run_id, win.c.window_start_us)
                )
                out += [StoredWindow(str(r[0]), int(r[1]), int(r[2]), str(r[3]), None if r[4] is None else int(r[4]), bool(r[5]),
                                     int(r[6]), int(r[7]))
                        for r in conn.execute(query)]
        return out

    def windows_crossing(self, run_ids: Sequence[str], at_us: int, *, max_window_us: int = 86_400_000_000) -> list[StoredWindow]:
        """The stored windows of ``run_ids`` that start before ``at_us`` and end after it (a period bound that cuts
        them); windows are assumed no longer than ``max_window_us`` (a day, as the archive reader assumes)."""
        win = windows
        out: list[StoredWindow] = []
        runs = sorted(set(run_ids))
        with self._read() as conn:
            for i in range(0, len(runs), _LOOKUP_CHUNK):
                query = (
                    select(win.c.run_id, win.c.window_start_us, win.c.window_end_us, win.c.engine_class, win.c.model_version, win.c.pending,
                           win.c.num_steps, win.c.measured_ns)
                    .where(win.c.run_id.in_(runs[i : i + _LOOKUP_CHUNK]), win.c.window_start_us >= at_us - max_window_us,
                           win.c.window_start_us < at_us, win.c.window_end_us > at_us)
                    .order_by(win.c.run_id, win.c.window_start_us)
                )
                out += [StoredWindow(str(r[0]), int(r[1]), int(r[2]), str(r[3]), None if r[4] is None else int(r[4]), bool(r[5]),
                                     int(r[6]), int(r[7]))
                        for r in conn.execute(query)]
        return out

    def tenant_window_seconds(self, tenant: str, start_us: int, end_us: int) -> dict[tuple[int, str, int], int]:
        """``tenant``'s attributed time metered in (attributed, not pending) windows, per (second, engine class, model
        version), for the seconds in [start_us, end_us)."""
        w = tenant_seconds
        query = (
            select(w.c.second_us, w.c.engine_class, w.c.model_version, func.sum(w.c.attributed_ns))
            .where(w.c.tenant == tenant, w.c.model_version != 0, *self._range(w.c.second_us, start_us, end_us))
            .group_by(w.c.second_us, w.c.engine_class, w.c.model_version)
        )
        with self._read() as conn:
            return {(int(r[0]), str(r[1]), int(r[2])): int(r[3]) for r in conn.execute(query)}

    def class_window_usage(self, engine_class: str, start_us: int, end_us: int) -> dict[tuple[str, int], int]:
        """One class's attributed time metered in (attributed, not pending) windows whose second is in [start_us,
        end_us), per (tenant, model version): what window mode billed the class's period."""
        w = tenant_seconds
        query = (
            select(w.c.tenant, w.c.model_version, func.sum(w.c.attributed_ns))
            .where(w.c.engine_class == engine_class, w.c.model_version != 0, *self._range(w.c.second_us, start_us, end_us))
            .group_by(w.c.tenant, w.c.model_version)
        )
        with self._read() as conn:
            return {(str(r[0]), int(r[1])): int(r[2]) for r in conn.execute(query) if int(r[2])}

    def billed_steps(self, engine_class: str, start_us: int, end_us: int) -> StoredSteps:
        """The attributed (not pending) steps of a class starting in [start_us, end_us), with their slices as
        billed (the blob's ``attributed_ns``) and the model version that billed each."""
        query = (
            select(steps.c.run_id, steps.c.step_id, steps.c.timestamp_us, steps.c.slice_batch_id, steps.c.model_version)
            .where(steps.c.engine_class == engine_class, steps.c.pending.is_(False), *self._range(steps.c.timestamp_us, start_us, end_us))
        )
        with self._read() as conn:
            rows = conn.execute(query).all()
            return self._with_slices(conn, rows)

    @staticmethod
    def _with_slices(conn: Connection, rows: list) -> StoredSteps:
        """``StoredSteps`` of step rows (run_id, step_id, timestamp_us, slice_batch_id[, model_version]), their
        slices read from the blobs they were stored in."""
        by_batch: dict[int, set[str]] = {}
        for row in rows:
            by_batch.setdefault(int(row[3]), set()).add(f"{row[0]}\x1f{row[1]}")
        tables = []
        for batch_id, wanted in by_batch.items():
            blob = conn.execute(select(slice_batches.c.slices_parquet).where(slice_batches.c.batch_id == batch_id)).scalar_one()
            table = pq.read_table(pa.BufferReader(bytes(blob)))
            table = table.set_column(0, "run_id", pc.cast(table["run_id"], pa.string()))
            key = pc.binary_join_element_wise(table["run_id"], pc.cast(table["step_id"], pa.string()), "\x1f")
            tables.append(table.filter(pc.is_in(key, value_set=pa.array(sorted(wanted)))))
        rows = sorted(rows, key=lambda r: (r[0], r[1]))
        if tables:
            slices = pa.concat_tables(tables, promote_options="default").sort_by(
                [("run_id", "ascending"), ("step_id", "ascending")]
            )
        else:
            slices = pa.table({})
        with_versions = bool(rows) and len(rows[0]) > 4
        return StoredSteps(
            keys=[(r[0], int(r[1])) for r in rows],
            timestamp_us=np.asarray([r[2] for r in rows], dtype=np.int64),
            slices=slices,
            model_version=np.asarray([-1 if r[4] is None else int(r[4]) for r in rows], dtype=np.int64) if with_versions else None,
        )

    # -----------------------------------------------------------------------------------------------------
    # Adjustments: corrections of past bills, one entry per tenant and period, never a rewrite

    def adjustment_rows(self, engine_class: str | None = None, tenant: str | None = None) -> list[AdjustmentRow]:
        """Stored adjustments (of one class, one tenant, or all), oldest period first."""
        query = select(*adjustments.columns)
        if engine_class is not None:
            query = query.where(adjustments.c.engine_class == engine_class)
        if tenant is not None:
            query = query.where(adjustments.c.tenant == tenant)
        query = query.order_by(adjustments.c.period_start_us, adjustments.c.engine_class, adjustments.c.to_version, adjustments.c.tenant)
        with self._read() as conn:
            return [AdjustmentRow(*row) for row in conn.execute(query)]

    def add_adjustments(self, rows: Sequence[AdjustmentRow]) -> None:
        """Store one adjustment's entries (one per tenant) in one transaction; an adjustment already stored
        for the same class, period and version is refused whole (``LedgerError``), so a rerun never counts twice."""
        if not rows:
            return
        try:
            with self.write_transaction() as conn:
                conn.execute(insert(adjustments), [{f.name: getattr(row, f.name) for f in fields(row)} for row in rows])
        except IntegrityError:
            first = rows[0]
            raise LedgerError(
                f"engine class {first.engine_class!r}: the period is already adjusted to model version {first.to_version}; "
                "nothing was written"
            ) from None

    def resolve_pending(self, engine_class: str, version: int | None, records: StepRecords) -> IngestOutcome:
        """Store the attribution of pending steps (``records``: the same steps, attributed), in one
        transaction: their slices' new blob, their usage, and the steps marked attributed with ``version``.
        Steps no longer pending (another process attributed them first) are left alone (``inserted`` False)."""
        keys = list(zip(records.run_id.tolist(), records.step_id.tolist()))
        with self.write_transaction() as conn:
            still: set[tuple[str, int]] = set()
            by_run: dict[str, list[int]] = {}
            for run_id, step_id in keys:
                by_run.setdefault(run_id, []).append(step_id)
            for run_id, step_ids in by_run.items():
                for i in range(0, len(step_ids), _LOOKUP_CHUNK):
                    query = (
                        select(steps.c.step_id)
                        .where(steps.c.run_id == run_id, steps.c.step_id.in_(step_ids[i : i + _LOOKUP_CHUNK]),
                               steps.c.engine_class == engine_class, steps.c.pending.is_(True))
                        .with_for_update()
                    )
                    still.update((run_id, int(step_id)) for (step_id,) in conn.execute(query))
            resolved = [k in still for k in keys]
            if not any(resolved):
                return IngestOutcome(resolved)
            chosen = records.select_steps(np.asarray(resolved)) if not all(resolved) else records
            batch = _StoredBatch(chosen)
            slice_batch_id = self._insert_blob(conn, batch, now_us())
            conn.execute(
                update(steps)
                .where(steps.c.run_id == bindparam("k_run_id"), steps.c.step_id == bindparam("k_step_id"))
                .values(pending=False, model_version=version, predicted_s=bindparam("v_predicted_s"),
                        slice_batch_id=slice_batch_id),
                [
                    {"k_run_id": r, "k_step_id": s, "v_predicted_s": p}
                    for r, s, p in zip(chosen.run_id.tolist(), chosen.step_id.tolist(), chosen.predicted_s.tolist())
                ],
            )
            self._upsert_usage(conn, batch)
        return IngestOutcome(resolved)
