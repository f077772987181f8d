"""The ledger's tables, one definition shared by the store, the service and the tests.

Seconds are stored as integer nanoseconds (``*_ns``) so that sums are exact in SQL on every backend: a
tenant's total plus the other tenants' totals equals the measured total to the nanosecond, whatever the
order of summation. Times are integer microseconds since the Unix epoch (``*_us``), so time buckets are
integer divisions that SQLite and PostgreSQL compute alike.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Float,
    Boolean,
    Column,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
)

SCHEMA_VERSION = 1

metadata = MetaData()

ledger_info = Table(
    "ledger_info",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)

steps = Table(
    "steps",
    metadata,
    Column("run_id", Text, primary_key=True),
    Column("step_id", BigInteger, primary_key=True, autoincrement=False),
    Column("measured_ns", BigInteger, nullable=False),
    Column("predicted_s", Float, nullable=False, doc="the model's prediction, for residuals; not billed"),
    Column("batch_size", Integer, nullable=False),
    Column("timestamp_us", BigInteger, nullable=False, doc="step start (trace timestamp_s, else ingest time)"),
    Column("ingested_at_us", BigInteger, nullable=False),
    Column("content_sha256", LargeBinary(32), nullable=False, doc="canonical content, for idempotent re-sends"),
    Index("ix_steps_timestamp_us", "timestamp_us"),
)

slices = Table(
    "slices",
    metadata,
    Column("run_id", Text, primary_key=True),
    Column("step_id", BigInteger, primary_key=True, autoincrement=False),
    Column("request_id", Text, primary_key=True),
    Column("tenant", Text, nullable=False),
    Column("num_new_tokens", BigInteger, nullable=False),
    Column("num_context_tokens", BigInteger, nullable=False),
    Column("phase", String(8), nullable=False),
    Column("attributed_ns", BigInteger, nullable=False),
    Column("timestamp_us", BigInteger, nullable=False, doc="copied from the step so usage queries need no join"),
    ForeignKeyConstraint(["run_id", "step_id"], ["steps.run_id", "steps.step_id"], ondelete="CASCADE"),
    Index("ix_slices_tenant_timestamp_us", "tenant", "timestamp_us"),
)

api_keys = Table(
    "api_keys",
    metadata,
    Column("key_id", String(32), primary_key=True),
    Column("secret_sha256", LargeBinary(32), nullable=False),
    Column("tenant", Text, nullable=True, doc="the tenant a tenant key reads; null for admin keys"),
    Column("is_admin", Boolean, nullable=False),
    Column("created_at_us", BigInteger, nullable=False),
    Column("revoked_at_us", BigInteger, nullable=True),
)
