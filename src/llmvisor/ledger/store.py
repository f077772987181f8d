"""The ledger store: attributed steps in, usage out, over SQLite (WAL) or PostgreSQL.

Each ingest is one transaction. Steps are keyed by (run_id, step_id): a step already stored with the same
content hash is acknowledged and skipped, one stored with a different hash is a conflict and the whole
batch is rejected, so a batch is either stored whole or not at all and no second is ever counted twice.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from sqlalchemy import Connection, Engine, and_, create_engine, event, func, insert, select, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, IntegrityError, OperationalError
from sqlalchemy.pool import StaticPool

from llmvisor.errors import LlmvisorError
from llmvisor.ledger import keys as keys_module
from llmvisor.ledger.keys import Principal
from llmvisor.ledger.schema import SCHEMA_VERSION, api_keys, ledger_info, metadata, slices, steps

BUCKET_US = {"minute": 60_000_000, "hour": 3_600_000_000, "day": 86_400_000_000}
SQLITE_BUSY_TIMEOUT_S = 30.0
_LOOKUP_CHUNK = 500
_WRITE_ATTEMPTS = 5
# `_insert` builds rows as tuples in these column orders.
assert [c.name for c in steps.columns] == [
    "run_id", "step_id", "measured_ns", "predicted_s", "batch_size", "timestamp_us", "ingested_at_us", "content_sha256"
]
assert [c.name for c in slices.columns] == [
    "run_id", "step_id", "request_id", "tenant", "num_new_tokens", "num_context_tokens", "phase", "attributed_ns", "timestamp_us"
]


class LedgerError(LlmvisorError):
    """The ledger cannot be opened or used as asked (bad URL, unreachable database, other schema)."""


class StepConflictError(LlmvisorError):
    """Steps re-sent with a (run_id, step_id) already stored under different content."""

    def __init__(self, conflicts: Sequence[tuple[str, int]]):
        self.conflicts = list(conflicts)
        run_id, step_id = self.conflicts[0]
        more = f" (and {len(self.conflicts) - 1} more)" if len(self.conflicts) > 1 else ""
        super().__init__(
            f"step {step_id} of run {run_id!r}{more} is already stored with different content; "
            "a (run_id, step_id) can be ingested once, re-sends must be identical"
        )


@dataclass
class StepRecords:
    """Attributed steps ready to store, as plain Python lists (what the database drivers take fastest).

    Per step: ``run_id`` … ``content_sha256``; per slice: ``request_id`` … ``attributed_ns``, the slices of
    step k being ``step_offsets[k]:step_offsets[k + 1]``. ``attributed_ns`` of a step sum to its ``measured_ns``.
    """

    run_id: list[str]
    step_id: list[int]
    measured_ns: list[int]
    predicted_s: list[float]
    timestamp_us: list[int]
    content_sha256: list[bytes]
    step_offsets: np.ndarray
    request_id: list[str]
    tenant: list[str]
    num_new_tokens: list[int]
    num_context_tokens: list[int]
    phase: list[str]
    attributed_ns: list[int]

    @property
    def n_steps(self) -> int:
        return len(self.run_id)


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


@dataclass(frozen=True)
class Totals:
    """What reconciles: Σ attributed_ns over slices equals Σ measured_ns over steps, exactly."""

    num_steps: int
    measured_ns: int
    num_slices: int
    attributed_ns: int


@dataclass(frozen=True)
class KeyInfo:
    key_id: str
    tenant: str | None
    is_admin: bool
    created_at_us: int
    revoked_at_us: int | None


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
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection):
        connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


class Ledger:
    """Durable per-step, per-slice record of attributed time, with usage queries and API keys.

    Parameters
    ----------
    url : SQLAlchemy database URL: ``sqlite:///PATH`` (WAL mode) or ``postgresql+psycopg://USER@HOST/DB``.
    """

    def __init__(self, url: str):
        self.url = normalize_url(url)
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
        self._create_schema()

    @property
    def safe_url(self) -> str:
        return make_url(self.url).render_as_string(hide_password=True)

    def _create_schema(self) -> None:
        try:
            with self._write_engine.begin() as conn:
                metadata.create_all(conn, checkfirst=True)
                version = conn.execute(select(ledger_info.c.value).where(ledger_info.c.name == "schema_version")).scalar()
                if version is None:
                    conn.execute(insert(ledger_info).values(name="schema_version", value=str(SCHEMA_VERSION)))
                elif version != str(SCHEMA_VERSION):
                    raise LedgerError(f"{self.safe_url}: ledger schema version {version}, this llmvisor reads {SCHEMA_VERSION}")
        except OperationalError as error:
            raise LedgerError(f"cannot open database {self.safe_url}: {' '.join(str(error.orig).split())}") from None
        except IntegrityError:
            # Another process created the schema at the same moment; it is there now.
            pass

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
    def _write(self) -> Iterator[Connection]:
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

    # -----------------------------------------------------------------------------------------------------
    # Ingest

    def ingest(self, records: StepRecords) -> IngestOutcome:
        """Store the steps not yet stored, in one transaction; raise `StepConflictError` if any differs."""
        keys = list(zip(records.run_id, records.step_id))
        for attempt in range(_WRITE_ATTEMPTS):
            try:
                with self._write() as conn:
                    stored = self._stored_hashes(conn, keys)
                    conflicts = [k for k, digest in zip(keys, records.content_sha256) if k in stored and stored[k] != digest]
                    if conflicts:
                        raise StepConflictError(conflicts)
                    inserted = [k not in stored for k in keys]
                    self._insert(conn, records, inserted)
                return IngestOutcome(inserted)
            except (IntegrityError, OperationalError):
                # A concurrent writer stored some of these keys first (PostgreSQL) or the database was busy;
                # the next attempt sees its commit and treats those steps as duplicates or conflicts.
                if attempt == _WRITE_ATTEMPTS - 1:
                    raise
                time.sleep(0.01 * 2**attempt)
        raise AssertionError("unreachable")

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

    def _bulk_insert(self, conn: Connection, table, rows: list[tuple]) -> None:
        """Rows (tuples in the table's column order) straight to the driver: COPY on PostgreSQL, executemany
        on SQLite. SQLAlchemy's per-row parameter processing, and psycopg's executemany, each cost more than
        the database's own work at thousands of rows per batch."""
        columns = ", ".join(column.name for column in table.columns)
        if self.backend == "postgresql":
            statement = f"COPY {table.name} ({columns}) FROM STDIN"
            driver = self._write_engine.dialect.dbapi
            try:
                with conn.connection.driver_connection.cursor() as cursor:
                    with cursor.copy(statement) as copy:
                        for row in rows:
                            copy.write_row(row)
            except driver.Error as error:
                # The raw cursor bypasses SQLAlchemy; wrap its errors the way SQLAlchemy would (IntegrityError...).
                raise DBAPIError.instance(statement, None, error, driver.Error) from error
        else:
            placeholders = ", ".join(["?"] * len(table.columns))
            conn.exec_driver_sql(f"INSERT INTO {table.name} ({columns}) VALUES ({placeholders})", rows)

    def _insert(self, conn: Connection, records: StepRecords, inserted: list[bool]) -> None:
        new_steps = [k for k, new in enumerate(inserted) if new]
        if not new_steps:
            return
        ingested_at_us = now_us()
        offsets = records.step_offsets
        batch_size = np.diff(offsets).tolist()
        step_rows = [
            (
                records.run_id[k],
                records.step_id[k],
                records.measured_ns[k],
                records.predicted_s[k],
                batch_size[k],
                records.timestamp_us[k],
                ingested_at_us,
                records.content_sha256[k],
            )
            for k in new_steps
        ]
        self._bulk_insert(conn, steps, step_rows)

        step_of_slice = np.repeat(np.arange(records.n_steps), np.diff(offsets))
        keep = np.asarray(inserted, dtype=bool)[step_of_slice]
        all_new = bool(keep.all())
        step_of_slice = step_of_slice[keep]

        def per_slice(values: list) -> list:
            return values if all_new else np.asarray(values, dtype=object)[keep].tolist()

        slice_rows = zip(
            np.asarray(records.run_id, dtype=object)[step_of_slice].tolist(),
            np.asarray(records.step_id, dtype=np.int64)[step_of_slice].tolist(),
            per_slice(records.request_id),
            per_slice(records.tenant),
            per_slice(records.num_new_tokens),
            per_slice(records.num_context_tokens),
            per_slice(records.phase),
            per_slice(records.attributed_ns),
            np.asarray(records.timestamp_us, dtype=np.int64)[step_of_slice].tolist(),
        )
        self._bulk_insert(conn, slices, list(slice_rows))

    # -----------------------------------------------------------------------------------------------------
    # Queries; time ranges are [start_us, end_us) on the step's timestamp, None meaning unbounded.

    @staticmethod
    def _range(column, start_us: int | None, end_us: int | None) -> list:
        conditions = []
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
        """Attributed time per tenant (and per UTC bucket of ``bucket`` if given), ordered by tenant and time."""
        conditions = self._range(slices.c.timestamp_us, start_us, end_us)
        if tenant is not None:
            conditions.append(slices.c.tenant == tenant)
        columns = [slices.c.tenant]
        if bucket is not None:
            if bucket not in BUCKET_US:
                raise LedgerError(f"unknown bucket {bucket!r}; choose one of {', '.join(BUCKET_US)}")
            size = BUCKET_US[bucket]
            columns.append(((slices.c.timestamp_us // size) * size).label("bucket_start_us"))
        query = (
            select(
                *columns,
                func.sum(slices.c.attributed_ns),
                func.count(),
                func.sum(slices.c.num_new_tokens),
            )
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
                attributed_ns=int(row[-3]),
                num_slices=int(row[-2]),
                num_new_tokens=int(row[-1]),
            )
            for row in rows
        ]

    def request_usage(
        self,
        start_us: int | None = None,
        end_us: int | None = None,
        tenant: str | None = None,
        run_id: str | None = None,
        request_id: str | None = None,
        limit: int = 1000,
        offset: int = 0,
    ) -> list[RequestUsageRow]:
        """Attributed time per request, largest first."""
        conditions = self._range(slices.c.timestamp_us, start_us, end_us)
        for column, value in ((slices.c.tenant, tenant), (slices.c.run_id, run_id), (slices.c.request_id, request_id)):
            if value is not None:
                conditions.append(column == value)
        total = func.sum(slices.c.attributed_ns)
        query = (
            select(
                slices.c.run_id,
                slices.c.request_id,
                slices.c.tenant,
                total,
                func.count(),
                func.sum(slices.c.num_new_tokens),
                func.min(slices.c.timestamp_us),
                func.max(slices.c.timestamp_us),
            )
            .where(and_(True, *conditions))
            .group_by(slices.c.run_id, slices.c.request_id, slices.c.tenant)
            .order_by(total.desc(), slices.c.run_id, slices.c.request_id, slices.c.tenant)
            .limit(limit)
            .offset(offset)
        )
        with self._read() as conn:
            rows = conn.execute(query).all()
        return [RequestUsageRow(r[0], r[1], r[2], int(r[3]), int(r[4]), int(r[5]), int(r[6]), int(r[7])) for r in rows]

    def top_tenants(self, n: int, start_us: int | None = None, end_us: int | None = None) -> list[UsageRow]:
        """The ``n`` tenants with the most attributed time, largest first."""
        total = func.sum(slices.c.attributed_ns)
        query = (
            select(slices.c.tenant, total, func.count(), func.sum(slices.c.num_new_tokens))
            .where(and_(True, *self._range(slices.c.timestamp_us, start_us, end_us)))
            .group_by(slices.c.tenant)
            .order_by(total.desc(), slices.c.tenant)
            .limit(n)
        )
        with self._read() as conn:
            rows = conn.execute(query).all()
        return [UsageRow(r[0], None, int(r[1]), int(r[2]), int(r[3])) for r in rows]

    def totals(self, start_us: int | None = None, end_us: int | None = None) -> Totals:
        """Steps and measured time, slices and attributed time, read in one snapshot so they reconcile."""
        step_query = select(func.count(), func.coalesce(func.sum(steps.c.measured_ns), 0)).where(
            and_(True, *self._range(steps.c.timestamp_us, start_us, end_us))
        )
        slice_query = select(func.count(), func.coalesce(func.sum(slices.c.attributed_ns), 0)).where(
            and_(True, *self._range(slices.c.timestamp_us, start_us, end_us))
        )
        engine = self._read_engine
        if self.backend == "postgresql":
            engine = engine.execution_options(isolation_level="REPEATABLE READ")
        with engine.begin() as conn:
            n_steps, measured = conn.execute(step_query).one()
            n_slices, attributed = conn.execute(slice_query).one()
        return Totals(int(n_steps), int(measured), int(n_slices), int(attributed))

    # -----------------------------------------------------------------------------------------------------
    # API keys

    def create_key(self, tenant: str | None = None, *, is_admin: bool = False) -> str:
        """Store a new key and return it; it is not stored in the clear, so it cannot be shown again."""
        if is_admin == (tenant is not None):
            raise LedgerError("a key is either an admin key (no tenant) or a tenant key (with a tenant)")
        if tenant is not None and not tenant:
            raise LedgerError("the tenant name must not be empty")
        key_id, key, digest = keys_module.new_key()
        with self._write() as conn:
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
        with self._write() as conn:
            result = conn.execute(
                update(api_keys)
                .where(api_keys.c.key_id == key_id, api_keys.c.revoked_at_us.is_(None))
                .values(revoked_at_us=now_us())
            )
        return result.rowcount > 0
