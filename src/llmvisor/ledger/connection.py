"""The ledger's database: URL, engines (SQLite in WAL mode, or PostgreSQL), schema, transactions.

`LedgerConnection` is the base of `llmvisor.ledger.Ledger`: it opens the database, creates or upgrades its schema, and
gives the per-concern parts of the ledger (`llmvisor.ledger.steps`, `.windows`, `.usage`, `.runs`, `.registry`,
`.keys`, `.adjustments`) their transactions and the bulk insert-or-add they share (`_add_rows`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from sqlalchemy import Connection, Engine, create_engine, event, insert, inspect, select, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DatabaseError, DBAPIError, IntegrityError, OperationalError
from sqlalchemy.pool import StaticPool

from llmvisor import extras
from llmvisor.ledger.records import LedgerError
from llmvisor.ledger.schema import (
    IN_PLACE_UPGRADES,
    SCHEMA_8_TABLES,
    SCHEMA_9_COLUMNS,
    SCHEMA_10_COLUMNS,
    SCHEMA_VERSION,
    USAGE_RESOLUTION_US,
    ledger_info,
    metadata,
)

SQLITE_BUSY_TIMEOUT_S = 30.0
SQLITE_CACHE_KIB = 65536
LOOKUP_CHUNK = 500
"""Keys looked up per statement (an IN list of at most this many)."""
WRITE_ATTEMPTS = 5
"""Tries of a write transaction that a concurrent writer made fail on a key, or a busy database."""


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


class LedgerConnection:
    """The database of a ledger and its transactions (`llmvisor.ledger.Ledger` is built on it).

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
        self._create_schema()

    @property
    def safe_url(self) -> str:
        return make_url(self.url).render_as_string(hide_password=True)

    def _create_schema(self) -> None:
        """Create the tables of an empty database, add schema 8's tables and schema 9's and 10's columns to a schema-7, -8 or -9 one
        (`IN_PLACE_UPGRADES`); refuse, before writing anything, one of another schema."""
        try:
            with self._write_engine.begin() as conn:
                if inspect(conn).has_table(ledger_info.name):
                    version = conn.execute(select(ledger_info.c.value).where(ledger_info.c.name == "schema_version")).scalar()
                    if version in IN_PLACE_UPGRADES:  # later schemas only added tables and nullable columns
                        metadata.create_all(conn, tables=list(SCHEMA_8_TABLES), checkfirst=True)
                        self._add_missing_columns(conn)
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

    @staticmethod
    def _add_missing_columns(conn: Connection) -> None:
        """Schema 9's and 10's nullable columns (`SCHEMA_9_COLUMNS`, `SCHEMA_10_COLUMNS`), added where a table lacks them:
        existing rows read NULL."""
        inspector = inspect(conn)
        have: dict[str, set[str]] = {}
        for table, name in (*SCHEMA_9_COLUMNS, *SCHEMA_10_COLUMNS):
            if table.name not in have:
                have[table.name] = {c["name"] for c in inspector.get_columns(table.name)}
            if name not in have[table.name]:
                kind = table.c[name].type.compile(dialect=conn.dialect)
                conn.exec_driver_sql(f"ALTER TABLE {table.name} ADD COLUMN {name} {kind}")
                have[table.name].add(name)

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
        """One read transaction, for reads that take several ledger functions (`llmvisor.ledger.billing_tables`)."""
        with self._read() as conn:
            yield conn

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

    def _add_rows(self, conn: Connection, table, rows: list, *, key: Sequence[str] = (), sums: Sequence[str] = (),
                  least: Sequence[str] = (), greatest: Sequence[str] = (), known_sums: Sequence[str] = (),
                  first: Sequence[str] = ()) -> None:
        """Insert ``rows`` (dicts by column name, or lists of values column by column in the table's order) in one
        statement; with a ``key``, a row already there instead adds ``sums`` (NULL if either is), adds
        ``known_sums`` (NULL only if both are: the known part counts), widens ``least``/``greatest`` and keeps its
        ``first`` values where they are not NULL.
        On PostgreSQL the columns go as arrays through unnest: one round trip, where an executemany costs a
        pipelined statement per row (a fifth of a window's ingest)."""
        names = [column.name for column in table.columns]
        if isinstance(rows[0], dict):  # a nullable column a row leaves out is NULL (schema 9's KV memory in window mode)
            columns = [[row.get(name) for row in rows] if column.nullable else [row[name] for row in rows]
                       for name, column in zip(names, table.columns)]
        else:
            columns = rows
        conflict = ""
        if key:
            lowest, highest = ("LEAST", "GREATEST") if self.backend == "postgresql" else ("min", "max")
            sets = [*(f"{n} = {table.name}.{n} + excluded.{n}" for n in sums),
                    *(f"{n} = {lowest}({table.name}.{n}, excluded.{n})" for n in least),
                    *(f"{n} = {highest}({table.name}.{n}, excluded.{n})" for n in greatest),
                    *(f"{n} = CASE WHEN {table.name}.{n} IS NULL AND excluded.{n} IS NULL THEN NULL "
                      f"ELSE COALESCE({table.name}.{n}, 0) + COALESCE(excluded.{n}, 0) END" for n in known_sums),
                    *(f"{n} = COALESCE({table.name}.{n}, excluded.{n})" for n in first)]
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
    # Time ranges of queries: [start_us, end_us) on the step's timestamp, None meaning unbounded, in whole
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
