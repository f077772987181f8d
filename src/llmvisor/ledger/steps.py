"""Steps stored one by one: ingest (one transaction a batch, re-sends answered as duplicates or conflicts), the
slices' Parquet blobs and per-request, per-second usage they add to, pending steps attributed later, and stored steps
read back with their slices.

Each ingest is one transaction. Steps are keyed by (run_id, step_id): a step already stored with the same
content hash is acknowledged and skipped, one stored with a different hash is a conflict and the whole
batch is rejected, so a batch is either stored whole or not at all and no second is ever counted twice.
What a transaction writes (`schema`): a row per new step, the new steps' slices as one Parquet blob, and the
per-request, per-second usage they add to, summed into existing rows. The blob and the sums are built
before the write lock is taken, and again inside it only if some steps turn out to be stored already.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from sqlalchemy import Connection, bindparam, insert, select, update
from sqlalchemy.exc import IntegrityError, OperationalError

from llmvisor.core.tokens import CACHED_PROMPT_COLUMN, token_split
from llmvisor.ledger.connection import LOOKUP_CHUNK, WRITE_ATTEMPTS, now_us
from llmvisor.ledger.records import (
    SHARING_BLOB_COLUMNS,
    DuplicateRunError,
    HeldStepsError,
    IngestOutcome,
    StepConflictError,
    StepRecords,
    StoredSteps,
)
from llmvisor.ledger.runs import RunStore
from llmvisor.ledger.schema import (
    KV_USAGE_COLUMNS,
    LORA_USAGE_COLUMN,
    TOKEN_SPLIT_COLUMNS,
    USAGE_RESOLUTION_US,
    slice_batches,
    steps,
    usage_per_second,
)

_PARQUET_COMPRESSION = "zstd"
_USAGE_KEY = ("run_id", "request_id", "tenant", "second_us")
_USAGE_SUMS = ("attributed_ns", "num_slices", "num_new_tokens")
# `StoredBatch` builds rows as tuples in these column orders.
assert [c.name for c in steps.columns] == [
    "run_id", "step_id", "measured_ns", "predicted_s", "batch_size", "timestamp_us", "ingested_at_us", "content_sha256",
    "slice_batch_id", "engine_class", "model_version", "pending",
]
assert [c.name for c in usage_per_second.columns] == [*_USAGE_KEY, *_USAGE_SUMS, "first_timestamp_us", "last_timestamp_us",
                                                     *TOKEN_SPLIT_COLUMNS, *KV_USAGE_COLUMNS, LORA_USAGE_COLUMN]


class StoredBatch:
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
        kv = records.kv_columns
        if kv is not None:
            for name, values in kv.items():
                table = table.append_column(name, pa.array(values, pa.int64()))
        lora = records.lora_columns
        if lora is not None:  # format 4: the adapter columns as the trace has them
            for name, values in lora.items():
                table = table.append_column(name, pa.array(values, pa.int64() if name == "lora_rank" else pa.string()))
        adapter = (pa.nulls(self.n_slices, pa.string()) if lora is None
                   else pc.if_else(pc.equal(table["lora_name"], ""), pa.scalar(None, pa.string()), table["lora_name"]))
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
                **{name: (pa.nulls(self.n_slices, pa.int64()) if kv is None else pa.array(kv[name], pa.int64()))
                   for name in KV_USAGE_COLUMNS},
                LORA_USAGE_COLUMN: adapter,
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
                    ("kv_block_ns", "sum", pc.ScalarAggregateOptions(skip_nulls=True, min_count=1)),
                    ("kv_block_bytes", "max"),
                    (LORA_USAGE_COLUMN, "max"),  # a request runs one adapter (NULL: the base model)
                ]
            )
        )
        usage = usage.set_column(usage.schema.get_field_index("run_id"), "run_id", pc.cast(usage["run_id"], pa.string()))
        usage = usage.sort_by([(name, "ascending") for name in _USAGE_KEY])
        names = [*_USAGE_KEY, "attributed_ns_sum", "attributed_ns_count", "num_new_tokens_sum", "timestamp_us_min", "timestamp_us_max",
                 *(f"{name}_sum" for name in TOKEN_SPLIT_COLUMNS), "kv_block_ns_sum", "kv_block_bytes_max", f"{LORA_USAGE_COLUMN}_max"]
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


class StepStore(RunStore):
    """Step ingest, pending steps attributed, stored steps read back (module note)."""

    def ingest(self, records: StepRecords) -> IngestOutcome:
        """Store the steps not yet stored, in one transaction; raise `StepConflictError` if any differs."""
        keys = list(zip(records.run_id.tolist(), records.step_id.tolist()))
        # Built outside the lock on the expectation that every step is new, which holds unless this is a retry.
        all_new = StoredBatch(records) if records.n_steps else None
        for attempt in range(WRITE_ATTEMPTS):
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
                        batch = StoredBatch(records.select_steps(np.asarray(inserted)))
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
                if attempt == WRITE_ATTEMPTS - 1:
                    raise
                time.sleep(0.01 * 2**attempt)
        raise AssertionError("unreachable")

    def _stored_hashes(self, conn: Connection, keys: list[tuple[str, int]]) -> dict[tuple[str, int], bytes]:
        by_run: dict[str, list[int]] = {}
        for run_id, step_id in keys:
            by_run.setdefault(run_id, []).append(step_id)
        stored: dict[tuple[str, int], bytes] = {}
        for run_id, step_ids in by_run.items():
            for i in range(0, len(step_ids), LOOKUP_CHUNK):
                chunk = step_ids[i : i + LOOKUP_CHUNK]
                query = select(steps.c.step_id, steps.c.content_sha256).where(
                    steps.c.run_id == run_id, steps.c.step_id.in_(chunk)
                )
                for step_id, digest in conn.execute(query):
                    stored[(run_id, step_id)] = bytes(digest)
        return stored

    @staticmethod
    def _insert_blob(conn: Connection, batch: StoredBatch, ingested_at_us: int) -> int:
        return conn.execute(
            insert(slice_batches)
            .values(ingested_at_us=ingested_at_us, num_steps=batch.n_steps, num_slices=batch.n_slices,
                    slices_parquet=batch.slices_parquet)
            .returning(slice_batches.c.batch_id)
        ).scalar_one()

    def _insert(self, conn: Connection, batch: StoredBatch) -> None:
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

    def _upsert_usage(self, conn: Connection, batch: StoredBatch) -> None:
        if not batch.usage_columns[0]:
            return
        self._add_rows(conn, usage_per_second, batch.usage_columns, key=_USAGE_KEY, sums=(*_USAGE_SUMS, *TOKEN_SPLIT_COLUMNS),
                       least=("first_timestamp_us",), greatest=("last_timestamp_us",), known_sums=("kv_block_ns",),
                       first=("kv_block_bytes", LORA_USAGE_COLUMN))

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
                for i in range(0, len(step_ids), LOOKUP_CHUNK):
                    query = (
                        select(steps.c.step_id)
                        .where(steps.c.run_id == run_id, steps.c.step_id.in_(step_ids[i : i + LOOKUP_CHUNK]),
                               steps.c.engine_class == engine_class, steps.c.pending.is_(True))
                        .with_for_update()
                    )
                    still.update((run_id, int(step_id)) for (step_id,) in conn.execute(query))
            resolved = [k in still for k in keys]
            if not any(resolved):
                return IngestOutcome(resolved)
            chosen = records.select_steps(np.asarray(resolved)) if not all(resolved) else records
            batch = StoredBatch(chosen)
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
