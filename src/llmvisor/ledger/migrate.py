"""Copy a ledger of an older schema into a new, empty ledger of the current one; the old one is only read.

Schema 1 (a row per slice) is re-ingested step by step; schema 2 (no engine classes) is copied table by table,
its steps marked as attributed by the default model of no class; schema 3 is copied table by table as it is.
Schema 4's received step-id ranges (``step_ranges``) are built from the copied steps of schemas 2 and 3, and
copied as stored (with the adjustments) from schema 4; schema 5's tables (window aggregates, billing's ``prices``)
start empty from schemas 1 to 4 and are copied as stored from schema 5.

Schema 6's token split (``num_uncached_prompt_tokens``, ``num_cached_prompt_tokens``, ``num_output_tokens`` of
``usage_per_second``, ``window_tenant_usage`` and ``request_totals``) is NULL on every copied usage row: an older
ledger kept a request's new tokens per second, not which were prompt and which output, so the split is unknown,
never guessed (not even 0: a token price refuses such a row, `llmvisor.billing.charges`). Schema 1's re-ingest is
the exception: its slices carry their phase, so its rows get the split as any new ingest does (cached 0: schema 1
never had the fact). Schema 6 is copied with its split as stored.

Schema 7 keeps window usage per tenant, class, model version and second (``tenant_seconds``) instead of per window
and tenant (``window_tenant_usage`` of schemas 5 and 6): the old rows are summed into that key, each with its
window's class and version (0: pending); ``windows`` and ``request_totals`` are copied as stored.

A copy rather than an upgrade in place: nothing already stored can be damaged by a migration that stops
half way, the two can be compared afterwards, and the copy may go to another database (SQLite to
PostgreSQL). Steps keep their content digests (both schemas use digest encoding v1), so a step re-sent
after the migration is still recognised as a duplicate, or as a conflict. Keys keep their hashes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from sqlalchemy import (
    BigInteger,
    Column,
    Float,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    and_,
    case,
    cast,
    create_engine,
    func,
    insert,
    inspect,
    literal,
    select,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DatabaseError

from llmvisor.ledger.connection import normalize_url
from llmvisor.ledger.records import LedgerError, StepRecords
from llmvisor.ledger.schema import (
    KV_USAGE_COLUMNS,
    LORA_USAGE_COLUMN,
    TOKEN_SPLIT_COLUMNS,
    active_models,
    adjustments,
    api_keys,
    engine_models,
    ledger_info,
    prices,
    request_totals,
    slice_batches,
    step_ranges,
    steps,
    tenant_seconds,
    usage_per_second,
    windows,
)
from llmvisor.ledger.store import Ledger
from llmvisor.ledger.usage import split_sums

_schema_1 = MetaData()
_steps_1 = Table(
    "steps",
    _schema_1,
    Column("run_id", Text, primary_key=True),
    Column("step_id", BigInteger, primary_key=True),
    Column("measured_ns", BigInteger),
    Column("predicted_s", Float),
    Column("batch_size", Integer),
    Column("timestamp_us", BigInteger),
    Column("ingested_at_us", BigInteger),
    Column("content_sha256", LargeBinary(32)),
)
_slices_1 = Table(
    "slices",
    _schema_1,
    Column("run_id", Text, primary_key=True),
    Column("step_id", BigInteger, primary_key=True),
    Column("request_id", Text, primary_key=True),
    Column("tenant", Text),
    Column("num_new_tokens", BigInteger),
    Column("num_context_tokens", BigInteger),
    Column("phase", String(8)),
    Column("attributed_ns", BigInteger),
    Column("timestamp_us", BigInteger),
)
_ledger_info_1 = Table("ledger_info", _schema_1, Column("name", String(64), primary_key=True), Column("value", Text))
_api_keys_1 = api_keys.to_metadata(_schema_1)
SCHEMA_1_TABLES = (_ledger_info_1, _steps_1, _slices_1, _api_keys_1)
SCHEMA_3_STEP_COLUMNS = ("engine_class", "model_version", "pending")
"""Columns of ``steps`` that schema 3 added."""
"""Schema 1 as it was stored, for reading it (and for tests that build one)."""


@dataclass(frozen=True)
class MigrationReport:
    num_steps: int
    num_slices: int
    measured_ns: int
    attributed_ns: int
    num_keys: int
    attributed_ns_per_tenant: dict[str, int]


def _schema_1_totals(conn) -> MigrationReport:
    n_steps, measured = conn.execute(select(func.count(), func.coalesce(func.sum(_steps_1.c.measured_ns), 0))).one()
    n_slices, attributed = conn.execute(select(func.count(), func.coalesce(func.sum(_slices_1.c.attributed_ns), 0))).one()
    per_tenant = dict(conn.execute(select(_slices_1.c.tenant, func.sum(_slices_1.c.attributed_ns)).group_by(_slices_1.c.tenant)).all())
    n_keys = conn.execute(select(func.count()).select_from(_api_keys_1)).scalar_one()
    return MigrationReport(int(n_steps), int(n_slices), int(measured), int(attributed), int(n_keys),
                           {tenant: int(ns) for tenant, ns in per_tenant.items()})


def _records(rows: list[tuple]) -> StepRecords:
    """Rows of the step-slice join, whole steps in (run_id, step_id) order, as records to store."""
    columns = list(zip(*rows))
    run_id, step_id = np.asarray(columns[0], dtype=object), np.asarray(columns[1], dtype=np.int64)
    new_step = np.ones(len(rows), dtype=bool)
    new_step[1:] = (run_id[1:] != run_id[:-1]) | (step_id[1:] != step_id[:-1])
    starts = np.flatnonzero(new_step)
    measured_ns = np.asarray(columns[2], dtype=np.int64)[starts]
    return StepRecords(
        run_id=run_id[starts],
        step_id=step_id[starts],
        step_latency_s=measured_ns / 1e9,
        measured_ns=measured_ns,
        predicted_s=np.asarray(columns[3], dtype=np.float64)[starts],
        timestamp_us=np.asarray(columns[4], dtype=np.int64)[starts],
        content_sha256=[bytes(columns[5][k]) for k in starts.tolist()],
        step_offsets=np.append(starts, len(rows)).astype(np.int64),
        request_id=np.asarray(columns[7], dtype=object),
        tenant=np.asarray(columns[8], dtype=object),
        num_new_tokens=np.asarray(columns[9], dtype=np.int64),
        num_context_tokens=np.asarray(columns[10], dtype=np.int64),
        is_prefill=np.asarray(columns[11], dtype=object) == "prefill",
        attributed_ns=np.asarray(columns[12], dtype=np.int64),
        ingested_at_us=np.asarray(columns[6], dtype=np.int64)[starts],
    )


def _whole_steps(result, min_rows: int) -> Iterator[list[tuple]]:
    """Chunks of at least ``min_rows`` rows that never split a step."""
    chunk: list[tuple] = []
    for row in result:
        if len(chunk) >= min_rows and (row[0], row[1]) != (chunk[-1][0], chunk[-1][1]):
            yield chunk
            chunk = []
        chunk.append(row)
    if chunk:
        yield chunk


def migrate_schema_1(
    source_url: str,
    target_url: str,
    *,
    rows_per_batch: int = 200_000,
    progress: Callable[[int, int], None] | None = None,
) -> MigrationReport:
    """Copy every key, step and slice of a schema-1 ledger into an empty ledger at ``target_url``, then
    check that steps, slices, measured time and every tenant's attributed time match exactly.
    ``progress`` is called with the steps copied so far and the steps to copy, after each batch."""
    source, source_name, version = _read_version(source_url)
    if version != "1":
        source.dispose()
        raise LedgerError(f"{source_name}: ledger schema version {version}; only version 1 is migrated")
    try:
        with source.connect() as conn:
            expected = _schema_1_totals(conn)
    except DatabaseError as error:  # a schema-1 ledger missing its tables
        source.dispose()
        raise LedgerError(f"cannot read {source_name}: {' '.join(str(error.orig).split())}") from None

    target = Ledger(target_url)
    target_name = target.safe_url
    copied_steps = 0
    try:
        before = target.totals()
        if before.num_steps or target.list_keys():
            raise LedgerError(f"{target_name}: the target of a migration must be an empty ledger")
        with source.connect() as conn:
            keys = [dict(row._mapping) for row in conn.execute(select(_api_keys_1))]
        if keys:
            with target.write_transaction() as write:
                write.execute(insert(api_keys), keys)
        join = (
            select(
                _steps_1.c.run_id, _steps_1.c.step_id, _steps_1.c.measured_ns, _steps_1.c.predicted_s,
                _steps_1.c.timestamp_us, _steps_1.c.content_sha256, _steps_1.c.ingested_at_us,
                _slices_1.c.request_id, _slices_1.c.tenant, _slices_1.c.num_new_tokens, _slices_1.c.num_context_tokens,
                _slices_1.c.phase, _slices_1.c.attributed_ns,
            )
            .join(_slices_1, (_slices_1.c.run_id == _steps_1.c.run_id) & (_slices_1.c.step_id == _steps_1.c.step_id))
            .order_by(_steps_1.c.run_id, _steps_1.c.step_id, _slices_1.c.request_id)
        )
        with source.connect() as conn:
            result = conn.execution_options(stream_results=True, yield_per=10_000).execute(join)
            for chunk in _whole_steps(result, rows_per_batch):
                records = _records(chunk)
                outcome = target.ingest(records)
                if outcome.n_duplicate:
                    raise LedgerError(f"{target_name}: {outcome.n_duplicate} steps were already there during the copy")
                copied_steps += records.n_steps
                if progress is not None:
                    progress(copied_steps, expected.num_steps)
        _check_copy(target, expected, target_name)
    finally:
        target.close()
        source.dispose()
    return expected


_schema_2 = MetaData()
_steps_2 = Table(
    "steps",
    _schema_2,
    *(Column(c.name, c.type, primary_key=c.primary_key) for c in steps.columns if c.name not in SCHEMA_3_STEP_COLUMNS),
)
_slice_batches_2 = slice_batches.to_metadata(_schema_2)


def _before_split(table: Table, schema: MetaData) -> Table:
    """``table`` as schemas 2 to 5 stored it: without schema 6's token split columns (nor schema 9's KV columns, nor
    schema 10's adapter)."""
    return Table(table.name, schema, *(Column(c.name, c.type, primary_key=c.primary_key) for c in table.columns
                                       if c.name not in (*TOKEN_SPLIT_COLUMNS, *KV_USAGE_COLUMNS, LORA_USAGE_COLUMN)))


def _before_kv(table: Table, schema: MetaData) -> Table:
    """``table`` as schemas 6 to 8 stored it: without schema 9's KV memory columns (copied rows read NULL: not
    metered, billed for time only) nor schema 10's adapter (NULL: the base model)."""
    return Table(table.name, schema, *(Column(c.name, c.type, primary_key=c.primary_key) for c in table.columns
                                       if c.name not in (*KV_USAGE_COLUMNS, LORA_USAGE_COLUMN)))


_usage_2 = _before_split(usage_per_second, _schema_2)
_api_keys_2 = api_keys.to_metadata(_schema_2)
_ledger_info_2 = ledger_info.to_metadata(_schema_2)


def _read_version(source_url: str):
    """An engine on the source ledger, its printable name and its schema version (refusing what is not a ledger)."""
    parsed = make_url(normalize_url(source_url))
    source_name = parsed.render_as_string(hide_password=True)
    if parsed.get_backend_name() == "sqlite" and not Path(parsed.database or "").is_file():
        raise LedgerError(f"{source_name}: no such SQLite file")
    source = create_engine(parsed)
    try:
        with source.connect() as conn:
            if not inspect(conn).has_table("ledger_info"):
                raise LedgerError(f"{source_name}: not an llmvisor ledger (no ledger_info table)")
            version = conn.execute(select(_ledger_info_1.c.value).where(_ledger_info_1.c.name == "schema_version")).scalar()
    except DatabaseError as error:
        source.dispose()
        raise LedgerError(f"cannot read {source_name}: {' '.join(str(error.orig).split())}") from None
    except LedgerError:
        source.dispose()
        raise
    return source, source_name, version


def migrate(source_url: str, target_url: str, **kwargs) -> MigrationReport:
    """Copy a ledger of an older schema (1 to 6) into an empty ledger of the current schema."""
    source, source_name, version = _read_version(source_url)
    source.dispose()
    if version == "1":
        return migrate_schema_1(source_url, target_url, **kwargs)
    if version in ("2", "3", "4", "5", "6"):
        return migrate_schema_2(source_url, target_url, progress=kwargs.get("progress"))
    raise LedgerError(f"{source_name}: ledger schema version {version}; versions 1 to 6 are migrated "
                      "(a schema-7 or -8 ledger is upgraded in place when opened)")


_schema_3 = MetaData()
_steps_3 = steps.to_metadata(_schema_3)
_engine_models_3 = engine_models.to_metadata(_schema_3)
_active_models_3 = active_models.to_metadata(_schema_3)


def _copy_step_ranges(read, write) -> None:
    """Build ``step_ranges`` from the copied steps: each run's consecutive ids are one range (an id minus its
    rank within the run is constant along a range)."""
    has_class = "engine_class" in {c["name"] for c in inspect(read).get_columns("steps")}
    engine_class = _steps_3.c.engine_class if has_class else None
    table = _steps_3 if has_class else _steps_2
    rank = func.row_number().over(partition_by=table.c.run_id, order_by=table.c.step_id)
    numbered = select(
        table.c.run_id, table.c.step_id, table.c.ingested_at_us,
        (engine_class if engine_class is not None else literal("")).label("engine_class"),
        (table.c.step_id - rank).label("island"),
    ).subquery()
    query = select(
        numbered.c.run_id, func.min(numbered.c.step_id), func.max(numbered.c.step_id), func.min(numbered.c.engine_class),
        func.min(numbered.c.ingested_at_us),
    ).group_by(numbered.c.run_id, numbered.c.island)
    chunk: list[dict] = []
    for run_id, first, last, engine_class_of_run, received in read.execute(query):
        chunk.append({"run_id": run_id, "first_step_id": int(first), "last_step_id": int(last),
                      "engine_class": engine_class_of_run or "", "first_received_us": int(received)})
        if len(chunk) >= 10_000:
            write.execute(insert(step_ranges), chunk)
            chunk = []
    if chunk:
        write.execute(insert(step_ranges), chunk)


def migrate_schema_2(source_url: str, target_url: str, *, progress: Callable[[int, int], None] | None = None) -> MigrationReport:
    """Copy a schema-2 or schema-3 ledger into an empty current one: keys, each slice batch (blob as stored)
    with its steps (from schema 2: engine class '', the default model, none pending, as it had no classes;
    from schema 3: as stored, with its models and active versions), the usage rows as they are and the
    received step-id ranges built from the steps; then check steps, slices, measured and attributed ns and
    every tenant's total."""
    source, source_name, version = _read_version(source_url)
    if version not in ("2", "3", "4", "5", "6"):
        source.dispose()
        raise LedgerError(f"{source_name}: ledger schema version {version}; expected version 2 to 6")
    source_steps = _steps_3 if version in ("3", "4", "5", "6") else _steps_2
    source_usage = _usage_6 if version == "6" else _usage_2
    window_tables = _SCHEMA_6_TABLES if version == "6" else _SCHEMA_5_TABLES
    target = Ledger(target_url)
    target_name = target.safe_url
    try:
        with source.connect() as conn:
            billed = _steps_3.c.pending.is_(False) if version in ("3", "4", "5", "6") else True  # pending steps are not in the totals
            n_steps, measured = conn.execute(
                select(func.count(), func.coalesce(func.sum(source_steps.c.measured_ns), 0)).where(billed)
            ).one()
            n_slices, attributed = conn.execute(
                select(func.coalesce(func.sum(source_usage.c.num_slices), 0), func.coalesce(func.sum(source_usage.c.attributed_ns), 0))
            ).one()
            per_tenant = {t: int(ns) for t, ns in conn.execute(
                select(source_usage.c.tenant, func.sum(source_usage.c.attributed_ns)).group_by(source_usage.c.tenant))}
            if version in ("5", "6"):  # what was metered in window aggregates counts in the totals too
                (_, _), (win, _), (tenant_win, _), _ = window_tables
                more_steps, more_measured = conn.execute(select(
                    func.coalesce(func.sum(win.c.num_steps), 0), func.coalesce(func.sum(win.c.measured_ns), 0)).where(win.c.pending.is_(False))).one()
                more_slices, more_attributed = conn.execute(select(
                    func.coalesce(func.sum(tenant_win.c.num_slices), 0), func.coalesce(func.sum(tenant_win.c.attributed_ns), 0))).one()
                n_steps, measured = int(n_steps) + int(more_steps), int(measured) + int(more_measured)
                n_slices, attributed = int(n_slices) + int(more_slices), int(attributed) + int(more_attributed)
                for t, ns in conn.execute(select(tenant_win.c.tenant, func.sum(tenant_win.c.attributed_ns)).group_by(tenant_win.c.tenant)):
                    per_tenant[t] = per_tenant.get(t, 0) + int(ns)
            keys = [dict(row._mapping) for row in conn.execute(select(_api_keys_2))]
        expected = MigrationReport(int(n_steps), int(n_slices), int(measured), int(attributed), len(keys), per_tenant)
        before = target.totals()
        if before.num_steps or before.pending_steps or target.list_keys():
            raise LedgerError(f"{target_name}: the target of a migration must be an empty ledger")
        copied_steps = 0
        with source.connect() as read, target.write_transaction() as write:
            if keys:
                write.execute(insert(api_keys), keys)
            batches = read.execution_options(stream_results=True, yield_per=100).execute(
                select(_slice_batches_2).order_by(_slice_batches_2.c.batch_id)
            )
            for batch in batches:
                new_id = write.execute(
                    insert(slice_batches)
                    .values(ingested_at_us=batch.ingested_at_us, num_steps=batch.num_steps, num_slices=batch.num_slices,
                            slices_parquet=batch.slices_parquet)
                    .returning(slice_batches.c.batch_id)
                ).scalar_one()
                no_class = {"engine_class": "", "model_version": None, "pending": False} if version == "2" else {}
                rows = [
                    {**no_class, **dict(row._mapping), "slice_batch_id": new_id}
                    for row in read.execute(select(source_steps).where(source_steps.c.slice_batch_id == batch.batch_id))
                ]
                if rows:
                    write.execute(insert(steps), rows)
                copied_steps += len(rows)
                if progress is not None:
                    progress(copied_steps, expected.num_steps)
            _copy_rows(read, write, source_usage, usage_per_second)
            if version in ("3", "4", "5", "6"):
                for table in (_engine_models_3, _active_models_3):
                    rows = [dict(row._mapping) for row in read.execute(select(table))]
                    if rows:
                        write.execute(insert(engine_models if table is _engine_models_3 else active_models), rows)
            if version in ("4", "5", "6"):
                _copy_schema_4_tables(read, write)
            else:
                _copy_step_ranges(read, write)
            if version in ("5", "6"):
                (source_prices, _), (win, _), (tenant_win, _), (source_requests, _) = window_tables
                for source_table, target_table in ((source_prices, prices), (win, windows), (source_requests, request_totals)):
                    _copy_rows(read, write, source_table, target_table)
                _sum_window_tenant_usage(read, write, tenant_win, win)
        _check_copy(target, expected, target_name)
    finally:
        target.close()
        source.dispose()
    return expected


# ---------------------------------------------------------------------------------------------------------
# Schema 4 → 5 (window aggregates): schema 4's tables are copied as they are, its received step-id ranges and
# adjustments included; schema 5's window tables start empty (nothing was metered in windows before).

_schema_4 = MetaData()
_step_ranges_4 = step_ranges.to_metadata(_schema_4)
_adjustments_4 = adjustments.to_metadata(_schema_4)


_schema_6 = MetaData()
_window_tenant_usage_6 = Table(
    "window_tenant_usage", _schema_6,
    Column("run_id", Text, primary_key=True), Column("window_start_us", BigInteger, primary_key=True),
    Column("tenant", Text, primary_key=True), Column("second_us", BigInteger), Column("attributed_ns", BigInteger),
    Column("measured_ns", BigInteger), Column("num_slices", BigInteger), Column("num_new_tokens", BigInteger),
    *(Column(name, BigInteger) for name in TOKEN_SPLIT_COLUMNS),
)
"""Schemas 5 and 6's window usage: a row per window and tenant (schema 7 sums it into ``tenant_seconds``)."""
_usage_6 = _before_kv(usage_per_second, _schema_6)
_SCHEMA_6_TABLES = ((prices.to_metadata(_schema_6), prices), (windows.to_metadata(_schema_6), windows),
                    (_window_tenant_usage_6, tenant_seconds), (_before_kv(request_totals, _schema_6), request_totals))

_schema_5 = MetaData()
_SCHEMA_5_TABLES = ((prices.to_metadata(_schema_5), prices), (windows.to_metadata(_schema_5), windows),
                    (_before_split(_window_tenant_usage_6, _schema_5), tenant_seconds),
                    (_before_split(request_totals, _schema_5), request_totals))
"""Schema 5's own tables as it stored them, copied as they are (the token split NULL: module note)."""


def _sum_window_tenant_usage(read, write, tenant_win: Table, win: Table, chunk_rows: int = 10_000) -> None:
    """Schema 5/6's per-window tenant rows summed into schema 7's ``tenant_seconds`` (module note)."""
    w = tenant_win
    version = case((win.c.pending.is_(True), 0), else_=func.coalesce(win.c.model_version, 0)).label("model_version")
    has_split = all(name in w.c for name in TOKEN_SPLIT_COLUMNS)
    split = [cast(c, BigInteger) for c in split_sums(w)] if has_split else [literal(None, BigInteger) for _ in TOKEN_SPLIT_COLUMNS]
    key = (w.c.tenant, win.c.engine_class, version, w.c.second_us)
    sums = [cast(func.sum(w.c[name]), BigInteger).label(name) for name in ("attributed_ns", "measured_ns", "num_slices", "num_new_tokens")]
    query = (
        select(*key, *sums, *(column.label(name) for column, name in zip(split, TOKEN_SPLIT_COLUMNS)))
        .join(win, and_(win.c.run_id == w.c.run_id, win.c.window_start_us == w.c.window_start_us))
        .group_by(*key)
    )
    _copy_rows(read, write, query, tenant_seconds, chunk_rows)


def _copy_schema_4_tables(read, write) -> None:
    for source_table, target_table in ((_step_ranges_4, step_ranges), (_adjustments_4, adjustments)):
        _copy_rows(read, write, source_table, target_table)


def _copy_rows(read, write, source, target_table, chunk_rows: int = 10_000) -> None:
    """Every row of ``source`` (a table, or a query whose columns are named as the target's) into ``target_table`` as
    it is, streamed ``chunk_rows`` at a time."""
    rows = read.execution_options(stream_results=True, yield_per=chunk_rows).execute(
        select(source) if isinstance(source, Table) else source)
    chunk: list[dict] = []
    for row in rows:
        chunk.append(dict(row._mapping))
        if len(chunk) >= chunk_rows:
            write.execute(insert(target_table), chunk)
            chunk = []
    if chunk:
        write.execute(insert(target_table), chunk)


def _check_copy(target: Ledger, expected, target_name: str) -> None:
    """Refuse a copy whose steps, slices, measured and attributed nanoseconds, keys or any tenant's total differ
    from the source's."""
    copied = target.totals()
    copied_tenants = {row.tenant: row.attributed_ns for row in target.tenant_usage()}
    n_keys = len(target.list_keys())
    mismatches = [
        f"{name}: {have} copied, {want} in the source"
        for name, have, want in (
            ("steps", copied.num_steps, expected.num_steps),
            ("slices", copied.num_slices, expected.num_slices),
            ("measured ns", copied.measured_ns, expected.measured_ns),
            ("attributed ns", copied.attributed_ns, expected.attributed_ns),
            ("keys", n_keys, expected.num_keys),
        )
        if have != want
    ]
    mismatches += [
        f"tenant {tenant!r}: {copied_tenants.get(tenant, 0)} ns copied, {ns} in the source"
        for tenant, ns in expected.attributed_ns_per_tenant.items()
        if copied_tenants.get(tenant, 0) != ns
    ]
    if mismatches:
        raise LedgerError(f"the copy in {target_name} does not match its source ({'; '.join(mismatches)}); do not use it")
