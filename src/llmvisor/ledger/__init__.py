"""Durable per-tenant ledger of attributed engine time (SQLite or PostgreSQL via SQLAlchemy)."""

from llmvisor import extras

extras.require("llmvisor.ledger", "service", modules=["sqlalchemy"])

from llmvisor.ledger.keys import Principal  # noqa: E402
from llmvisor.ledger.store import (  # noqa: E402
    BUCKET_US,
    AdjustmentRow,
    IngestOutcome,
    KeyInfo,
    Ledger,
    LedgerError,
    ModelVersion,
    RequestUsageRow,
    RunGaps,
    RunHoldings,
    SliceShare,
    StepConflictError,
    StepDetail,
    StepGap,
    StepRecords,
    StoredSteps,
    Totals,
    UsageRow,
    WindowConflictError,
    WindowOutcome,
    normalize_url,
)

__all__ = [
    "AdjustmentRow",
    "BUCKET_US",
    "IngestOutcome",
    "KeyInfo",
    "Ledger",
    "LedgerError",
    "ModelVersion",
    "Principal",
    "RequestUsageRow",
    "RunGaps",
    "RunHoldings",
    "SliceShare",
    "StepGap",
    "StepConflictError",
    "StepDetail",
    "StepRecords",
    "StoredSteps",
    "Totals",
    "UsageRow",
    "WindowConflictError",
    "WindowOutcome",
    "normalize_url",
]
