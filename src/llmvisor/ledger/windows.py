"""Window aggregates (`llmvisor.metering.WindowAggregate`): their ingest, with a group commit of concurrent callers'
batches, and the stored windows read back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from sqlalchemy import Connection, insert, select
from sqlalchemy.exc import IntegrityError, OperationalError

from llmvisor.core.tokens import add_counts
from llmvisor.ledger.connection import LOOKUP_CHUNK, WRITE_ATTEMPTS, now_us
from llmvisor.ledger.records import (
    HELD_ELSEWHERE,
    DuplicateRunError,
    HeldStepsError,
    StoredWindow,
    WindowConflictError,
    WindowOutcome,
)
from llmvisor.ledger.runs import RunStore
from llmvisor.ledger.schema import (
    LORA_USAGE_COLUMN,
    TOKEN_SPLIT_COLUMNS,
    USAGE_RESOLUTION_US,
    request_totals,
    tenant_seconds,
    windows,
)


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


class WindowStore(RunStore):
    """Window ingest and stored windows (module note)."""

    def __init__(self, url: str, *, request_totals: bool = True):
        self._commit = _GroupCommit()
        super().__init__(url, request_totals=request_totals)

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
        for attempt in range(WRITE_ATTEMPTS):
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
                if attempt == WRITE_ATTEMPTS - 1:  # a concurrent writer stored some: the next look sees them
                    for batch in batches:
                        batch.outcome, batch.error = None, error
                    return
                time.sleep(0.01 * 2**attempt)

    def _stored_window_hashes(self, conn: Connection, keys: list[tuple[str, int]]) -> dict[tuple[str, int], bytes]:
        out: dict[tuple[str, int], bytes] = {}
        for run in sorted({k[0] for k in keys}):
            starts = [k[1] for k in keys if k[0] == run]
            for i in range(0, len(starts), LOOKUP_CHUNK):
                rows = conn.execute(
                    select(windows.c.window_start_us, windows.c.content_sha256).where(
                        windows.c.run_id == run, windows.c.window_start_us.in_(starts[i : i + LOOKUP_CHUNK])
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
            # window format 2: each tenant's KV block-ns, kept per block size (GiB-seconds are block-ns × its bytes)
            block_bytes = w.kv.block_bytes if w.kv is not None else None
            # window format 3: per tenant and adapter (schema 10; NULL the base model, and every request of formats 1, 2)
            kv_by_tenant = w.tenant_kv_block_ns(by_adapter=True)
            for (tenant, adapter), t in w.tenant_adapter_totals().items():
                key = (tenant, w.engine_class, 0 if w.pending else w.model_version, second_us, block_bytes or 0, adapter or "")
                row = tenant_rows.get(key)
                if row is None:
                    tenant_rows[key] = {"tenant": tenant, "engine_class": key[1], "model_version": key[2], "second_us": second_us, **t,
                                        LORA_USAGE_COLUMN: adapter}
                    if block_bytes is not None:
                        tenant_rows[key].update(kv_block_ns=kv_by_tenant[tenant, adapter], kv_block_bytes=block_bytes)
                else:
                    _add_usage(row, t)
                    if block_bytes is not None:
                        row["kv_block_ns"] += kv_by_tenant[tenant, adapter]
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
                                         **{name: getattr(q, name) for name in TOKEN_SPLIT_COLUMNS},
                                         "kv_block_ns": q.kv_block_ns, "kv_block_bytes": block_bytes,
                                         LORA_USAGE_COLUMN: q.lora_name or None}
                else:
                    row["kv_block_ns"] = None if row["kv_block_ns"] is None or q.kv_block_ns is None else row["kv_block_ns"] + q.kv_block_ns
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
                           sums=("attributed_ns", "measured_ns", "num_slices", "num_new_tokens", *TOKEN_SPLIT_COLUMNS, "kv_block_ns"),
                           least=("first_second_us", "first_timestamp_us"), greatest=("last_timestamp_us",),
                           first=("kv_block_bytes", LORA_USAGE_COLUMN))
        run_ids = np.asarray([w.run_id for w in new for _ in range(w.num_steps)], dtype=object)
        step_ids = np.concatenate([w.step_ids() for w in new])
        classes = np.asarray([w.engine_class for w in new for _ in range(w.num_steps)], dtype=object)
        return self.add_step_ranges(conn, run_ids, step_ids, classes, np.full(step_ids.size, received_us))

    def run_windows(self, run_ids: Sequence[str], start_us: int, end_us: int) -> list[StoredWindow]:
        """The stored windows of ``run_ids`` whose second (of their start) is in [start_us, end_us), by run and start."""
        runs = sorted(set(run_ids))
        if not runs:
            return []
        win = windows
        return self._windows_of(runs, self._range(win.c.window_start_us // USAGE_RESOLUTION_US * USAGE_RESOLUTION_US, start_us, end_us))

    def windows_crossing(self, run_ids: Sequence[str], at_us: int, *, max_window_us: int = 86_400_000_000) -> list[StoredWindow]:
        """The stored windows of ``run_ids`` that start before ``at_us`` and end after it (a period bound that cuts
        them); windows are assumed no longer than ``max_window_us`` (a day, as the archive reader assumes)."""
        win = windows
        return self._windows_of(sorted(set(run_ids)), [win.c.window_start_us >= at_us - max_window_us, win.c.window_start_us < at_us,
                                                       win.c.window_end_us > at_us])

    def _windows_of(self, runs: list[str], conditions: list) -> list[StoredWindow]:
        """The stored windows of ``runs`` (sorted, distinct) where ``conditions`` hold, by run and start."""
        win = windows
        out: list[StoredWindow] = []
        with self._read() as conn:
            for i in range(0, len(runs), LOOKUP_CHUNK):
                query = (
                    select(win.c.run_id, win.c.window_start_us, win.c.window_end_us, win.c.engine_class, win.c.model_version, win.c.pending,
                           win.c.num_steps, win.c.measured_ns)
                    .where(win.c.run_id.in_(runs[i : i + LOOKUP_CHUNK]), *conditions)
                    .order_by(win.c.run_id, win.c.window_start_us)
                )
                out += [StoredWindow(str(r[0]), int(r[1]), int(r[2]), str(r[3]), None if r[4] is None else int(r[4]), bool(r[5]),
                                     int(r[6]), int(r[7]))
                        for r in conn.execute(query)]
        return out
