"""What the ledger takes and gives: the records of steps to store, the rows its queries answer, and its errors.

Plain values, no database: every other ledger module and every caller of `llmvisor.ledger.Ledger` shares them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import pyarrow as pa

from llmvisor.errors import LlmvisorError


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
    kv_columns: dict[str, np.ndarray] | None = None
    """Per slice, the KV memory columns of trace format 3 (`llmvisor.core.trace_schema.KV_COLUMNS`, step and run
    values repeated on each slice, as the trace has them), kept in the blob; ``kv_block_ns`` and ``kv_block_bytes``
    are summed into the usage rows (schema 9). None: not metered (a format 1 or 2 trace), billed for time only."""
    lora_columns: dict[str, np.ndarray] | None = None
    """Per slice, the LoRA columns of trace format 4 (`llmvisor.core.trace_schema.LORA_COLUMNS`, step sets repeated on
    each slice), kept in the blob (a pending step is priced from them later); ``lora_name`` goes to the usage rows
    (schema 10). None: no adapter columns (the base model)."""
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
            elif item.name in ("kv_columns", "lora_columns"):
                value = {name: column[slice_mask] for name, column in value.items()}
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
    kv_block_ns: int | None = None
    """KV block-nanoseconds held (schema 9); None where none of the rows summed was metered."""
    kv_byte_ns: int | None = None
    """Σ block-ns × bytes per block: exact byte-nanoseconds (GiB-seconds = byte-ns / 2^30 / 10^9)."""
    lora_name: str | None = None
    """Usage read per adapter (``by_adapter``): its LoRA adapter, '' the base model; None: not read per adapter."""


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
    kv_block_ns: int | None = None
    kv_byte_ns: int | None = None
    lora_name: str = ""
    """The request's LoRA adapter (schema 10); '' the base model."""


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
    kv_block_ns: int | None = None
    """Σ KV block-ns of the usage rows (schema 9), None where nothing was metered; each step's pool conservation is
    checked when it is read (`llmvisor.core.kv_trace`)."""
    kv_byte_ns: int | None = None


@dataclass(frozen=True)
class SliceShare:
    request_id: str
    tenant: str
    num_new_tokens: int
    num_context_tokens: int
    phase: str
    attributed_ns: int
    kv_block_ns: int | None = None


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


@dataclass(frozen=True)
class KeyInfo:
    key_id: str
    tenant: str | None
    is_admin: bool
    created_at_us: int
    revoked_at_us: int | None
