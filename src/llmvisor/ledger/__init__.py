"""Durable per-tenant ledger of attributed engine time (SQLite or PostgreSQL via SQLAlchemy)."""

from llmvisor import extras

extras.require("llmvisor.ledger", "service", modules=["sqlalchemy"])

from llmvisor.ledger.keys import Principal  # noqa: E402
from llmvisor.ledger.store import (  # noqa: E402
    BUCKET_US,
    AdjustmentRow,
    DuplicateRunError,
    IngestOutcome,
    KeyInfo,
    Ledger,
    LedgerError,
    ModelVersion,
    RequestUsageRow,
    RunEnd,
    RunEndConflictError,
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
    "DuplicateRunError",
    "IngestOutcome",
    "KeyInfo",
    "Ledger",
    "LedgerError",
    "ModelVersion",
    "Principal",
    "RequestUsageRow",
    "RunEnd",
    "RunEndConflictError",
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
