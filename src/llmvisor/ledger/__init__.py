"""Durable per-tenant ledger of attributed engine time (SQLite or PostgreSQL via SQLAlchemy)."""

from llmvisor.ledger.keys import Principal
from llmvisor.ledger.store import (
    BUCKET_US,
    IngestOutcome,
    KeyInfo,
    Ledger,
    LedgerError,
    RequestUsageRow,
    SliceShare,
    StepConflictError,
    StepDetail,
    StepRecords,
    Totals,
    UsageRow,
    normalize_url,
)

__all__ = [
    "BUCKET_US",
    "IngestOutcome",
    "KeyInfo",
    "Ledger",
    "LedgerError",
    "Principal",
    "RequestUsageRow",
    "SliceShare",
    "StepConflictError",
    "StepDetail",
    "StepRecords",
    "Totals",
    "UsageRow",
    "normalize_url",
]
